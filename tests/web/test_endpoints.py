"""Handlers are bound to what their module declares, and none looks anything up on the app."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from starlette.requests import Request
from starlette.responses import Response

import controlplane.web
from controlplane.web.endpoints import bound

WEB = Path(controlplane.web.__file__).parent
# The edge reads its JSON depth limit, the OpenAPI route its settings, and app.py sets both.
MAY_READ_APP_STATE = {"edge.py", "openapi.py", "app.py"}


async def greet(name: str, _request: Request) -> Response:
    """Says hello."""
    return Response(f"hello {name}")


def test_a_bound_endpoint_keeps_the_handlers_name_and_passes_its_deps() -> None:
    endpoint = bound(greet, "runner")
    assert (endpoint.__name__, endpoint.__module__, endpoint.__doc__) == (
        "greet",
        __name__,
        "Says hello.",
    )
    answer = anyio.run(endpoint, Request({"type": "http", "method": "GET", "headers": []}))
    assert answer.body == b"hello runner"


def test_an_endpoint_built_only_to_be_described_refuses_to_serve() -> None:
    endpoint = bound(greet, None)
    with pytest.raises(RuntimeError, match="greet was built without what it needs"):
        anyio.run(endpoint, Request({"type": "http", "method": "GET", "headers": []}))


def test_no_route_module_reads_the_app_state() -> None:
    readers = sorted(
        path.name
        for path in WEB.glob("*.py")
        if path.name not in MAY_READ_APP_STATE and "app.state" in path.read_text()
    )
    assert readers == []
