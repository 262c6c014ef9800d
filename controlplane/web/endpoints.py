"""Route handlers bound to what their module needs.

A route module declares the capabilities its handlers use (its `Deps`), writes each handler as
`handler(deps, request)`, and gives web/app.py its routes with `bound`: web/app.py builds them
once per app with the objects app.py made. No handler looks anything up on the app.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import HTTPConnection

D = TypeVar("D")
C = TypeVar("C", bound=HTTPConnection)
Out = TypeVar("Out")


def bound(
    handler: Callable[[D, C], Awaitable[Out]], deps: D | None
) -> Callable[[C], Awaitable[Out]]:
    """`handler` as an endpoint Starlette calls with the request (or socket) alone, carrying the
    handler's name, module and docstring (OpenAPI's operation ids come from them). `deps` None:
    routes built only to be described; such an endpoint refuses to serve."""

    if deps is not None:
        # A partial, not a wrapper coroutine: one frame less on every request (Starlette
        # unwraps partials to see the async function behind them).
        served = functools.partial(handler, deps)
        functools.update_wrapper(served, handler)
        return served

    async def refused(connection: C) -> Out:
        raise RuntimeError(f"{handler.__name__} was built without what it needs")

    functools.update_wrapper(refused, handler)
    return refused
