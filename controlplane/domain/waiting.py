"""Why a pending job waits: a pure reading of who could take it.

A job waits for a runner session in its workspace whose labels include all the job's labels, or
for a provisioner whose template does (then a runner is launched for it). When there is neither,
nothing will ever take the job until one appears: the job is stuck, and the labels nobody offers
are the usual reason (a typo in a workflow, a pool not started).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Takers:
    """Who could take jobs of one label set in one workspace, now."""

    live_runners: int  # sessions seen recently whose labels cover the job's, with claims left
    busy_runners: int  # of those, the ones holding a lease
    templates: int  # templates of connected provisioners whose labels cover the job's
    offered: frozenset[str]  # every label a live runner or connected template offers there


@dataclass(frozen=True, slots=True)
class Waiting:
    stuck: bool  # nothing can take it until a runner or provisioner with its labels appears
    missing_labels: tuple[str, ...]  # its labels that no live runner or template offers
    reason: str


def why_waiting(required: Iterable[str], takers: Takers) -> Waiting:
    labels = sorted(set(required))
    missing = tuple(label for label in labels if label not in takers.offered)
    if takers.live_runners == 0 and takers.templates == 0:
        if missing:
            what = ", ".join(missing)
            return Waiting(True, missing, f"no live runner or connected provisioner offers {what}")
        return Waiting(
            True,
            (),
            "every label is offered, but no single live runner or provisioner template offers "
            f"all of {', '.join(labels)}",
        )
    if takers.live_runners > takers.busy_runners:
        return Waiting(False, (), "a matching runner is idle: it takes the job at its next poll")
    if takers.live_runners > 0:
        busy = takers.live_runners
        more = " (a provisioner can launch more)" if takers.templates else ""
        return Waiting(False, (), f"all {busy} matching runners are busy{more}")
    return Waiting(False, (), "waiting for a provisioner to launch a matching runner")
