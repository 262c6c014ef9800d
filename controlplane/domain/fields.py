"""A value built from another whose attributes carry its fields' names: a wire Struct from a
domain value, a domain value from a decoded wire one or from settings. Written once so that
such a conversion names only the fields it renames or computes."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def by_name(kind: type[T], found: object, /, **given: object) -> T:
    """A `kind` (a dataclass or a msgspec Struct) whose fields are read from the attributes of
    `found` of the same names; `given` holds the fields `found` names otherwise, or that are
    computed. Values are taken as they are: a tuple stays a tuple and an enum an enum, which
    encode as the list and the value a wire type declares."""
    names = getattr(kind, "__struct_fields__", None) or getattr(kind, "__dataclass_fields__")  # noqa: B009 -- mypy knows neither of type[T]
    return kind(**{name: getattr(found, name) for name in names if name not in given}, **given)
