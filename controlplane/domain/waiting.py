"""Why a pending job waits: a pure reading of who could take it.

A job waits for a runner session in its workspace whose labels include all the job's labels, or
for a provisioner whose template does (then a runner is launched for it). When there is neither,
nothing will ever take the job until one appears: the job is stuck, and the labels nobody offers
are the usual reason (a typo in a workflow, a pool not started).

Beyond who could take it, the dispatch policies (docs/policies.md) hold a job back: its
workspace or every matching runner paused, its concurrency key at its limit, higher-priority
jobs ahead of it, or its queue deadline passed. `waiting_reasons` names each that applies, with
a stable code, from the job's place in its queue (`QueuePlace`, read by store/job_views.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Takers:
    """Who could take jobs of one label set in one workspace, now."""

    live_runners: int  # sessions seen recently whose labels cover the job's, with claims left
    busy_runners: int  # of those, the ones holding a lease
    templates: int  # templates of connected provisioners whose labels cover the job's
    offered: frozenset[str]  # every label a live runner or connected template offers there
    paused_runners: int = 0  # of the live ones, those an operator paused (busy or idle)
    paused_idle: int = 0  # of those, the ones holding no lease


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
    if takers.live_runners - takers.busy_runners - takers.paused_idle > 0:
        return Waiting(False, (), "a matching runner is idle: it takes the job at its next poll")
    if takers.live_runners > 0 and takers.paused_runners == takers.live_runners:
        more = " (a provisioner can launch more)" if takers.templates else ""
        return Waiting(False, (), f"all {takers.live_runners} matching runners are paused{more}")
    if takers.live_runners > 0:
        busy = takers.live_runners
        more = " (a provisioner can launch more)" if takers.templates else ""
        return Waiting(False, (), f"all {busy} matching runners are busy{more}")
    return Waiting(False, (), "waiting for a provisioner to launch a matching runner")


# A job's place is counted up to this many jobs ahead of it: beyond, `ahead` says this number.
PLACE_CAP = 10_000


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a pending job stands: what a runner with exactly its labels would take first (jobs
    of its workspace whose labels it has, claimable now, in the queue's plain order: priority,
    then age), and the policies that concern it."""

    ahead: int  # claimable jobs taken before it, counted up to PLACE_CAP
    ahead_higher_priority: int  # of those, the ones of a higher priority (up to PLACE_CAP)
    priority: int
    concurrency_key: str | None
    concurrency_limit: int | None
    key_running: int  # executions of its key running now (0 without a key)
    workspace_paused: bool
    expired: bool  # its queue deadline passed; the leader removes it (no claim takes it)

    @property
    def position(self) -> int:
        return self.ahead + 1


# Stable, for programs; the wire's list too (wire/jobs.py `WaitingReasonOut`).
ReasonCode = Literal[
    "queue-expired",
    "workspace-paused",
    "no-taker",
    "runners-paused",
    "concurrency-key-full",
    "behind-higher-priority",
    "runners-busy",
]


@dataclass(frozen=True, slots=True)
class Reason:
    code: ReasonCode
    message: str  # for people


def waiting_reasons(
    waiting: Waiting, takers: Takers, place: QueuePlace | None = None
) -> tuple[Reason, ...]:
    """Every reason that holds the job back now, most decisive first; none when a runner can
    take it at its next poll. Without a `place` (a label set rather than one job), only the
    reasons of who could take it."""
    found: list[Reason] = []
    if place is not None and place.expired:
        found.append(
            Reason("queue-expired", "its queue timeout passed: it will be removed, never run")
        )
    if place is not None and place.workspace_paused:
        found.append(Reason("workspace-paused", "its workspace is paused: nothing is handed out"))
    if waiting.stuck:
        found.append(Reason("no-taker", waiting.reason))
    elif takers.live_runners > 0 and takers.paused_runners == takers.live_runners:
        found.append(
            Reason("runners-paused", f"every matching runner ({takers.live_runners}) is paused")
        )
    if (
        place is not None
        and place.concurrency_key is not None
        and place.concurrency_limit is not None
        and place.key_running >= place.concurrency_limit
    ):
        found.append(
            Reason(
                "concurrency-key-full",
                f"concurrency key {place.concurrency_key!r} is at its limit "
                f"({place.key_running} of {place.concurrency_limit} running)",
            )
        )
    if place is not None and place.ahead_higher_priority > 0:
        more = "+" if place.ahead_higher_priority >= PLACE_CAP else ""
        found.append(
            Reason(
                "behind-higher-priority",
                f"{place.ahead_higher_priority}{more} jobs of a higher priority than "
                f"{place.priority} are ahead of it",
            )
        )
    idle = takers.live_runners - takers.busy_runners - takers.paused_idle
    if not waiting.stuck and takers.live_runners > takers.paused_runners and idle <= 0:
        found.append(Reason("runners-busy", waiting.reason))
    return tuple(found)
