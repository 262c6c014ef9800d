"""The Starlette application: routes and the one error mapping. Nothing else lives here."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from controlplane.errors import ControlPlaneError
from controlplane.web import (
    admin,
    control,
    health,
    jobs,
    openapi,
    orchestrator,
    provisioners,
    runner_control,
    runners,
)
from controlplane.web.errors import (
    DATABASE_FAULTS,
    handle_control_plane_error,
    handle_http_exception,
    handle_unexpected,
)
from controlplane.web.services import Services


def build(services: Services | None) -> Starlette:
    app = Starlette(
        routes=[
            *health.routes,
            *runners.routes,
            *orchestrator.routes,
            *admin.routes,
            *jobs.routes,
            *provisioners.routes,
            *control.routes,
            *runner_control.routes,
            Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
        ],
        exception_handlers={
            ControlPlaneError: handle_control_plane_error,
            HTTPException: handle_http_exception,
            **dict.fromkeys(DATABASE_FAULTS, handle_unexpected),
            Exception: handle_unexpected,
        },
    )
    app.state.services = services
    if services is not None:  # None: only the routes are wanted (OpenAPI generation)
        app.state.assignments = services.assignments  # parked assignment long-polls
    return app
