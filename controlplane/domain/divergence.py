"""Count divergence (spec provisioning 3.7): where a provisioner's advertised `starting` and
`running` counts per template differ from the runner instances stored for it.

An advertisement is the provisioner's snapshot, so it is compared once, when it arrives.
Duplicate template keys add up (the actor refuses them, but the rule does not rely on it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from controlplane.domain.demand import Template

State = Literal["starting", "running"]
Direction = Literal["backend-higher", "advertised-higher"]


@dataclass(frozen=True, slots=True)
class Divergence:
    template_key: str
    state: State
    direction: Direction
    delta: int  # always > 0


def divergences(
    advertised: Iterable[Template], stored: Mapping[tuple[str, str], int]
) -> list[Divergence]:
    """Every (template, state) of the advertisement whose count differs from `stored` (keyed by
    (template key, state)), sorted; templates the provisioner did not advertise are not
    compared, as it said nothing about them."""
    claimed: dict[tuple[str, State], int] = {}
    for template in advertised:
        counts: tuple[tuple[State, int], ...] = (
            ("starting", template.starting),
            ("running", template.running),
        )
        for state, n in counts:
            claimed[(template.key, state)] = claimed.get((template.key, state), 0) + n
    found: list[Divergence] = []
    for (template_key, state), n in sorted(claimed.items()):
        delta = stored.get((template_key, state), 0) - n
        if delta:
            direction: Direction = "backend-higher" if delta > 0 else "advertised-higher"
            found.append(Divergence(template_key, state, direction, abs(delta)))
    return found
