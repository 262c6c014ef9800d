"""fields.by_name: a value built from the attributes of the same names of one or more others."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from controlplane.domain.fields import by_name


@dataclass(frozen=True, slots=True)
class Counts:
    live: int
    busy: int
    reason: str = "from counts"


@dataclass(frozen=True, slots=True)
class Verdict:
    stuck: bool
    reason: str


class Out(msgspec.Struct):
    stuck: bool
    reason: str
    live: int
    busy: int
    position: int | None = None


def test_each_field_is_read_from_the_first_value_that_has_it() -> None:
    out = by_name(Out, Verdict(True, "no runner"), Counts(2, 1), position=3)
    assert out == Out(stuck=True, reason="no runner", live=2, busy=1, position=3)
    later = by_name(Out, Counts(2, 1), Verdict(True, "no runner"), position=None)
    assert later.reason == "from counts"


def test_a_field_no_value_has_is_an_error() -> None:
    with pytest.raises(AttributeError, match="busy"):
        by_name(Out, Verdict(False, "ok"), Verdict(True, "no"), live=1)
