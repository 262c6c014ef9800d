"""The OpenAPI 3.1 document, generated from the app's routes, what each endpoint declares
beside its handler (web/operations.py), the wire Structs and the error classes.

`document()` refuses an endpoint that declares nothing. Bodies are the msgspec Structs the routes
decode and encode (schemas under components/schemas). The error catalogue is errors.py's: every
code a `ControlPlaneError` subclass owns, described by the first paragraph of its docstring, with
the status web/errors.py's table gives its class. The error codes of an operation are completed
from what it declares: its token kind's auth codes, a body's `validation-error` and
`payload-too-large`, a path or query parameter's `validation-error`.

The document says what the server enforces, so that a request valid by it is not refused: body
schemas are msgspec's own (the constraints the decoder applies), query parameters carry the ranges
and patterns their parsers apply, and the limits that are settings (long-poll maxima, the batch
size) are the serving daemon's. Descriptions name each knob with its built-in default.
`python -m controlplane.web.openapi > docs/openapi.json` writes the document of the default
settings (`__main__.py`, the one module here that imports the app); tests/web/test_openapi.py
checks that file, and what a running daemon serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from controlplane import errors
from controlplane.settings import Settings
from controlplane.web import queries
from controlplane.web.edge import json_response
from controlplane.web.errors import STATUS
from controlplane.web.operations import (
    KNOBS,
    ROLE_KEYS,
    SECURITY,
    TEXT,
    UUID_SCHEMA,
    Op,
    declared,
    operation,
)
from controlplane.wire.common import ErrorEnvelope
from controlplane.wire.orchestrator import EnqueueJob, EnqueueRequest
from controlplane.wire.provisioners import SetEligibility

_REF = "#/components/schemas/{name}"
_RETRY = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}


@cache
def _catalogue() -> dict[str, type[errors.ControlPlaneError]]:
    # Built on first use, when every module defining an error class has been imported.
    return errors.catalogue()


def status(code: str) -> int:
    kind = _catalogue()[code]
    return next(value for base, value in STATUS if issubclass(kind, base))


def codes(route: Route, op: Op) -> list[str]:
    """Every error code the route can answer with, in catalogue order."""
    found = set(op.errors.split())
    if unknown := sorted(found - set(_catalogue())):
        raise ValueError(f"{route.path}: no error class owns {unknown}")
    if op.auth is not None:
        found.update((*SECURITY[op.auth][1], "database-unavailable", "server-error"))
        for other in op.alternative_auth:
            found.update(SECURITY[other][1])
        if {op.auth, *op.alternative_auth} & ROLE_KEYS and "GET" not in (route.methods or ()):
            found.add("admin-key-read-only")  # an observer key asked for a change
    if op.body is not None:
        found.update(("validation-error", "payload-too-large"))
    if op.query is not None or route.param_convertors:
        found.add("validation-error")
    return [code for code in _catalogue() if code in found]


@dataclass(frozen=True)
class _Build:
    """What one document is built with: the serving daemon's settings, and the `$ref` msgspec
    gave each Struct (its name, qualified by module only when two Structs share one)."""

    settings: Settings
    refs: dict[type, dict[str, str]]
    shared_names: set[str]  # endpoint names that two modules use (`heartbeat`)

    def operation_id(self, route: Route, method: str) -> str:
        """The endpoint's name; prefixed with its module's when shared, as operationIds are
        unique in a document."""
        module, name = _endpoint_name(route, method)
        return f"{module}_{name}" if name in self.shared_names else name

    def schema(self, kind: Any) -> Any:
        return self.refs[kind] if isinstance(kind, type) else kind

    def json(self, schema: Any) -> dict[str, Any]:
        return {"application/json": {"schema": self.schema(schema)}}

    def errors(self, found: Sequence[str]) -> dict[str, Any]:
        by_status: dict[int, list[str]] = {}
        for code in found:
            by_status.setdefault(status(code), []).append(code)
        out: dict[str, Any] = {}
        for value, group in sorted(by_status.items()):
            only = {"properties": {"error": {"properties": {"code": {"enum": group}}}}}
            out[str(value)] = {
                "description": "; ".join(
                    f"`{code}`: {errors.when(_catalogue()[code])}" for code in group
                ),
                "content": self.json({"allOf": [self.schema(ErrorEnvelope), only]}),
                **({"headers": _RETRY} if value in (429, 503) else {}),
            }
        return out

    def operation(self, route: Route, method: str, op: Op) -> dict[str, Any]:
        ok: dict[str, Any] = {"description": op.summary}
        if op.answer is TEXT:
            ok["content"] = {TEXT: {"schema": {"type": "string"}}}
        elif op.answer is not None:
            ok["content"] = self.json(op.answer)
        out: dict[str, Any] = {
            "operationId": self.operation_id(route, method),
            "summary": op.summary,
            "tags": [op.tag or (SECURITY[op.auth][0] if op.auth else "health")],
        }
        if op.notes is not None:
            out["description"] = op.notes
        if op.auth is not None:
            out["security"] = [{name: []} for name in (op.auth, *op.alternative_auth)]
        path = [
            {"name": name, "in": "path", "required": True, "schema": UUID_SCHEMA}
            for name in route.param_convertors
        ]
        query = [] if op.query is None else queries.parameters(op.query, self.settings)
        if parameters := path + query + [header.openapi() for header in op.headers]:
            out["parameters"] = parameters
        if op.body is not None:
            # An optional body may also be `null` (or absent: not required).
            body = (
                {"anyOf": [self.schema(op.body), {"type": "null"}]} if op.optional_body else op.body
            )
            out["requestBody"] = {"required": not op.optional_body, "content": self.json(body)}
        out["responses"] = {str(op.ok): ok, **op.also, **self.errors(codes(route, op))}
        return out


def _endpoint(route: Route, method: str) -> Any:
    """The endpoint serving `method` on `route` (a Resource has one per method)."""
    return getattr(route, "endpoints", {}).get(method, route.endpoint)


def _endpoint_name(route: Route, method: str) -> tuple[str, str]:
    """(module, name) of the endpoint serving `method` on `route`."""
    endpoint = _endpoint(route, method)
    module = getattr(endpoint, "__module__", "").rsplit(".", 1)[-1]
    return module, getattr(endpoint, "__name__", route.name)


def _components(
    settings: Settings, ops: Sequence[Op]
) -> tuple[dict[type, dict[str, str]], dict[str, Any]]:
    """msgspec's schemas of every Struct, with the rules a Struct checks beyond its fields'
    constraints (its `json_schema_extra`) and the limits that are settings."""
    found: set[type] = {ErrorEnvelope}
    for op in ops:
        found.update(kind for kind in (op.body, op.answer) if isinstance(kind, type))
    kinds = sorted(found, key=lambda kind: (kind.__name__, kind.__module__))
    refs, schemas = msgspec.json.schema_components(kinds, ref_template=_REF)
    by_kind = dict(zip(kinds, refs, strict=True))
    for kind, ref in by_kind.items():
        name = ref["$ref"].rsplit("/", 1)[1]
        schemas[name].update(getattr(kind, "json_schema_extra", {}))
    if EnqueueRequest in by_kind:
        enqueue = schemas[by_kind[EnqueueRequest]["$ref"].rsplit("/", 1)[1]]
        enqueue["properties"]["jobs"]["maxItems"] = settings.queue.max_batch_size
        # The job Struct is nested, not a body of its own: its rules are added here.
        if (job := schemas.get(EnqueueJob.__name__)) is not None:
            job.update(EnqueueJob.json_schema_extra)
    if SetEligibility in by_kind:
        eligibility = schemas[by_kind[SetEligibility]["$ref"].rsplit("/", 1)[1]]
        listed = eligibility["properties"]["workspace_ids"]
        listed["maxItems"] = settings.provisioners.eligibility_max_workspaces
    if "EnqueueJob" in schemas:
        _life_policy_maxima(schemas["EnqueueJob"], settings)
    return by_kind, dict(sorted(schemas.items()))


def _life_policy_maxima(job: dict[str, Any], settings: Settings) -> None:
    """An enqueued job's life policies are bounded by settings (web/orchestrator.py)."""
    for field, maximum in (
        ("timeout_seconds", settings.queue.max_timeout_seconds),
        ("queue_timeout_seconds", settings.queue.max_queue_timeout_seconds),
        ("retries_on_lost", settings.queue.max_retries_on_lost),
    ):
        schema = job["properties"][field]
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") in ("integer", "number"):
                branch["maximum"] = maximum


def document(routes: Sequence[BaseRoute], settings: Settings | None = None) -> dict[str, Any]:
    """The document for `routes` served with `settings` (default: the built-in defaults).
    Raises ValueError for an endpoint that declares no operation."""
    settings = settings or KNOBS
    http: list[tuple[Route, str, Op]] = []
    for route in routes:
        if isinstance(route, WebSocketRoute):
            continue  # OpenAPI has no WebSocket; docs/provisioner-protocol.md describes it
        if not isinstance(route, Route):
            raise ValueError(f"cannot document {route!r}")
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op = declared(_endpoint(route, method))
            if op is None:
                raise ValueError(f"{method} {route.path} declares no operation")
            http.append((route, method, op))
    refs, schemas = _components(settings, [op for _, _, op in http])
    modules: dict[str, set[str]] = {}
    for route, method, _ in http:
        module, name = _endpoint_name(route, method)
        modules.setdefault(name, set()).add(module)
    build = _Build(settings, refs, {name for name, found in modules.items() if len(found) > 1})
    paths: dict[str, dict[str, Any]] = {}
    for route, method, op in http:
        paths.setdefault(route.path, {})[method.lower()] = build.operation(route, method, op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "controlplane",
            "version": version("controlplane"),
            "description": "Dispatches CI job executions to self-hosted runners. Every error "
            "body is an ErrorEnvelope. Strings never hold NUL (U+0000). A credential is sent "
            "as `Authorization: Bearer <token>`, exactly one space between the two (the scheme "
            "in any case). Guide: docs/api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                name: {"type": "http", "scheme": "bearer", "description": text}
                for name, (_, _, text) in SECURITY.items()
            },
        },
    }


def encode(doc: dict[str, Any]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"


@operation(Op("This document", answer={"type": "object"}))
async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the document for this app's routes, built on first use."""
    state = request.app.state
    if getattr(state, "openapi", None) is None:
        state.openapi = document(request.app.routes, getattr(state, "settings", None))
    return json_response(state.openapi)
