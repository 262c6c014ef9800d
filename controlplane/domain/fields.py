"""A value built from another whose attributes carry its fields' names: a wire Struct from a
domain value, a domain value from a decoded wire one or from settings. Written once so that
such a conversion names only the fields it renames or computes."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def by_name(kind: type[T], *found: object, **given: object) -> T:
    """A `kind` (a dataclass or a msgspec Struct) whose fields are read from the attributes of
    the same names of `found`, each from the first value that has one (a view made of two
    domain values); `given` holds the fields `found` names otherwise, or that are computed.
    Values are taken as they are: a tuple stays a tuple and an enum an enum, which encode as the
    list and the value a wire type declares."""
    names = getattr(kind, "__struct_fields__", None) or getattr(kind, "__dataclass_fields__")  # noqa: B009 -- mypy knows neither of type[T]
    *others, last = found

    def read(name: str) -> object:
        for source in others:
            if hasattr(source, name):
                return getattr(source, name)
        return getattr(last, name)  # raises if no source has it

    return kind(**{name: read(name) for name in names if name not in given}, **given)
