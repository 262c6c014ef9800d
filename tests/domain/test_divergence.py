"""Count divergence as a pure rule: advertised counts per template against stored instances."""

from __future__ import annotations

from controlplane.domain.demand import Template
from controlplane.domain.divergence import Divergence, divergences
from controlplane.domain.labels import LabelSet


def _template(key: str, starting: int, running: int) -> Template:
    return Template(key, LabelSet(("linux",)), 4, starting=starting, running=running)


def test_p58_only_differences_count_each_in_its_direction() -> None:
    stored = {("a", "starting"): 1, ("a", "running"): 3, ("b", "running"): 2, ("z", "running"): 9}
    found = divergences([_template("a", 2, 3), _template("b", 0, 0)], stored)
    assert found == [
        Divergence("a", "starting", "advertised-higher", 1),
        Divergence("b", "running", "backend-higher", 2),
    ]  # `z` was not advertised, so nothing is said about it


def test_duplicate_template_keys_add_up() -> None:
    assert divergences([_template("a", 1, 0), _template("a", 1, 0)], {("a", "starting"): 2}) == []


def test_an_empty_advertisement_compares_nothing() -> None:
    assert divergences([], {("a", "running"): 4}) == []
