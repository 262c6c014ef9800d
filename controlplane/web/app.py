"""The Starlette application: routes and the one error mapping. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.errors import ControlPlaneError
from controlplane.web import (
    admin,
    control,
    fleet,
    health,
    jobs,
    openapi,
    orchestrator,
    provisioners,
    runner_control,
    runners,
)
from controlplane.web.errors import (
    handle_control_plane_error,
    handle_http_exception,
    handle_unexpected,
)
from controlplane.web.services import Services

Endpoint = Callable[[Request], Awaitable[Response]]


class Resource(Route):
    """One path served by one endpoint per method. Starlette answers a method a Route lacks with
    405 and the Allow of the first Route on the path, so a GET list and a POST create as two
    Routes would answer OPTIONS with `Allow: POST`; as one Route, Allow names both."""

    def __init__(self, path: str, endpoints: dict[str, Endpoint]) -> None:
        self.endpoints = endpoints

        async def by_method(request: Request) -> Response:
            method = "GET" if request.method == "HEAD" else request.method
            return await endpoints[method](request)

        super().__init__(path, by_method, methods=list(endpoints))


def one_route_per_path(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """The routes, with the HTTP routes of a path joined into one Resource (first one's place)."""
    by_path: dict[str, list[Route]] = {}
    for route in routes:
        if type(route) is Route:
            by_path.setdefault(route.path, []).append(route)
    out: list[BaseRoute] = []
    for route in routes:
        if type(route) is not Route or len(by_path[route.path]) == 1:
            out.append(route)
        elif by_path[route.path][0] is route:
            endpoints = {
                method: same.endpoint
                for same in by_path[route.path]
                for method in sorted((same.methods or set()) - {"HEAD"})
            }
            out.append(Resource(route.path, endpoints))
    return out


def build(services: Services | None) -> Starlette:
    app = Starlette(
        routes=one_route_per_path(
            [
                *health.routes,
                *runners.routes,
                *orchestrator.routes,
                *fleet.routes,
                *admin.routes,
                *jobs.routes,
                *provisioners.routes,
                *control.routes,
                *runner_control.routes,
                Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
            ]
        ),
        exception_handlers={
            ControlPlaneError: handle_control_plane_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    app.state.services = services
    if services is not None:  # None: only the routes are wanted (OpenAPI generation)
        app.state.assignments = services.assignments  # parked assignment long-polls
    return app
