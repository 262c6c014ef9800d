"""Query strings into the Structs of wire/queries.py, and those Structs as OpenAPI parameters.

`decode` reads each field's msgspec type: a UUID, an integer or a number in its range (a
number's maximum may be a setting: the serving daemon's), one of a Literal's or an enum's values,
or a string that its handler parses further. Each kind is refused with the parsers of
web/edge.py, so a bad value gets the code, message and `details.field` that docs/api.md lists;
fields are decoded in their declared order, after unknown parameters when the Struct forbids
them. `parameters` describes the same fields for the document, so the two cannot disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import msgspec
import msgspec.inspect as mi
from starlette.requests import Request

from controlplane.errors import InvalidInput
from controlplane.settings import Settings
from controlplane.web.edge import query_integer, query_number, query_only, query_uuid, query_value

Q = TypeVar("Q", bound=msgspec.Struct)


@dataclass(frozen=True)
class Field:
    """One query parameter: its name, its inner type (no None, no metadata) and what the
    metadata around it says."""

    name: str
    kind: mi.Type
    choices: tuple[str, ...]  # a Literal's values in declared order (msgspec sorts its own)
    required: bool
    default: Any
    description: str
    extra: dict[str, Any]


def _unwrap(kind: mi.Type, found: dict[str, Any]) -> mi.Type:
    """The type inside `Optional[...]` and `Annotated[...]`, collecting their metadata."""
    while True:
        if isinstance(kind, mi.Metadata):
            found["description"] = (kind.extra_json_schema or {}).get("description", "")
            found["extra"] = {**found.get("extra", {}), **(kind.extra or {})}
            kind = kind.type
        elif isinstance(kind, mi.UnionType):
            others = [item for item in kind.types if not isinstance(item, mi.NoneType)]
            assert len(others) == 1, f"a query field is one type or None, not {kind}"
            kind = others[0]
        else:
            return kind


def _literal(hint: Any) -> tuple[str, ...]:
    if get_origin(hint) is Literal:
        return tuple(str(value) for value in get_args(hint))
    return next((found for arg in get_args(hint) if (found := _literal(arg))), ())


@cache
def fields(kind: type[msgspec.Struct]) -> tuple[Field, ...]:
    info = mi.type_info(kind)
    assert isinstance(info, mi.StructType)
    hints = get_type_hints(kind, include_extras=True)
    out = []
    for item in info.fields:
        found: dict[str, Any] = {}
        inner = _unwrap(item.type, found)
        default = None if item.default is msgspec.NODEFAULT else item.default
        out.append(
            Field(
                item.encode_name,
                inner,
                _literal(hints[item.name]),
                item.required,
                default,
                found.get("description", ""),
                found.get("extra", {}),
            )
        )
    return tuple(out)


def _knob(settings: Settings, name: str) -> Any:
    section, _, field_name = name.partition(".")
    return getattr(getattr(settings, section), field_name)


def _choice(request: Request, field: Field, allowed: tuple[str, ...]) -> str | None:
    if (refusal := field.extra.get("refusal")) is not None:
        raw = request.query_params.get(field.name)
        if raw is not None and raw not in allowed:
            raise InvalidInput(refusal, field=field.name)
        return raw
    raw = query_value(request, field.name)
    if raw is not None and raw not in allowed:
        raise InvalidInput(
            f"query {field.name} must be one of {', '.join(allowed)}", field=field.name
        )
    return raw


def _value(request: Request, field: Field, settings: Settings) -> Any:
    """The field's value in `request`, or None when absent; a malformed one is refused."""
    name, kind = field.name, field.kind
    if isinstance(kind, mi.LiteralType):
        return _choice(request, field, field.choices)
    if isinstance(kind, mi.EnumType):
        members: list[enum.Enum] = list(kind.cls)
        raw = _choice(request, field, tuple(str(member.value) for member in members))
        return None if raw is None else kind.cls(raw)
    if isinstance(kind, mi.UUIDType):
        return query_uuid(request, name)
    if isinstance(kind, mi.StrType):
        if field.extra.get("raw"):
            return request.query_params.get(name)
        return query_value(request, name, code=field.extra.get("code"))
    if request.query_params.get(name) is None:
        return None
    if isinstance(kind, mi.IntType):
        assert kind.ge is not None
        assert kind.le is not None
        return query_integer(request, name, low=kind.ge, high=kind.le, default=0)
    if isinstance(kind, mi.FloatType):
        assert kind.ge is not None
        high = _knob(settings, field.extra["maximum"]) if "maximum" in field.extra else kind.le
        assert high is not None
        return query_number(request, name, low=kind.ge, high=high, default=0)
    raise TypeError(f"no query decoding for {kind}")


def decode(request: Request, kind: type[Q], settings: Settings) -> Q:
    """`request`'s query as a `kind`; 400 for an unknown parameter (when `kind` forbids them),
    a missing required one, or a malformed value."""
    declared = fields(kind)
    if kind.__struct_config__.forbid_unknown_fields:
        query_only(request, *(field.name for field in declared))
    values: dict[str, Any] = {}
    for field in declared:
        value = _value(request, field, settings)
        if value is None and field.required:
            raise InvalidInput(f"query {field.name} is required", field=field.name)
        if value is not None:
            values[field.name] = value
    return kind(**values)


def _schema(field: Field, settings: Settings) -> dict[str, Any]:
    kind = field.kind
    if isinstance(kind, mi.UUIDType):
        return {"type": "string", "format": "uuid"}
    if isinstance(kind, mi.LiteralType):
        return {"type": "string", "enum": list(field.choices)}
    if isinstance(kind, mi.EnumType):
        return {"type": "string", "enum": [member.value for member in kind.cls]}
    if isinstance(kind, mi.StrType):
        bounds = {"minLength": kind.min_length, "maxLength": kind.max_length}
        schema: dict[str, Any] = {"type": "string"}
        schema.update((key, value) for key, value in bounds.items() if value is not None)
        if kind.pattern is not None:
            schema["pattern"] = kind.pattern
        return schema
    if isinstance(kind, mi.IntType | mi.FloatType):
        high = _knob(settings, field.extra["maximum"]) if "maximum" in field.extra else kind.le
        schema = {"type": "integer" if isinstance(kind, mi.IntType) else "number"}
        schema.update(minimum=kind.ge, maximum=high)
        if isinstance(kind, mi.IntType) and field.default is not None:
            schema["default"] = field.default
        return schema
    raise TypeError(f"no query schema for {kind}")


def parameters(kind: type[msgspec.Struct], settings: Settings) -> list[dict[str, Any]]:
    """The fields of `kind` as OpenAPI query parameters, the maxima that are settings taken
    from `settings`."""
    return [
        {
            "name": field.name,
            "in": "query",
            "required": field.required,
            "schema": _schema(field, settings),
            "description": field.description,
        }
        for field in fields(kind)
    ]
