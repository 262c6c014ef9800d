"""The pages as their own small Starlette app, served beside the API: web/app.py hands it every
request no API route matched (the router's default), and it answers `/` and `/ui/...` and
passes anything else back, so the API's 404s and OpenAPI document are untouched.

Its errors are pages, not JSON envelopes: the API's error mapping never sees them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.errors import ControlPlaneError
from controlplane.web.endpoints import bound
from controlplane.web.errors import status_of
from controlplane.web.ui import actions, live, pages, sessions
from controlplane.web.ui.render import HERE, page
from controlplane.web.ui.sessions import Deps

PREFIX = "/ui"
Handler = Callable[[Deps, Request], Awaitable[Response]]


async def _home(_request: Request) -> Response:
    return RedirectResponse(f"{PREFIX}/", status_code=307)


async def _error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code in (301, 302, 303, 307, 308):
        return Response(status_code=exc.status_code, headers=exc.headers)
    return page(
        request,
        "error.html",
        None,
        {"status": exc.status_code, "detail": exc.detail},
        exc.status_code,
    )


async def _refusal(request: Request, exc: Exception) -> Response:
    """One of our errors (the database unavailable, above all) as a page, with the API's status."""
    assert isinstance(exc, ControlPlaneError)
    status = status_of(exc)
    return page(request, "error.html", None, {"status": status, "detail": exc.message}, status)


def build(svc: Deps) -> Starlette:
    def get(path: str, handler: Handler, method: str = "GET") -> Route:
        return Route(PREFIX + path, bound(handler, svc), methods=[method])

    def post(path: str, handler: Handler) -> Route:
        return get(path, handler, "POST")

    return Starlette(
        routes=[
            Route("/", _home, methods=["GET"]),
            Route(PREFIX, _home, methods=["GET"]),
            Route(PREFIX + "/sign-in", bound(sessions.sign_in, svc), methods=["GET", "POST"]),
            get("/sign-in/{link}", sessions.sign_in_link),
            post("/sign-out", sessions.sign_out),
            get("/", pages.overview),
            get("/jobs", pages.jobs),
            get("/jobs/{job_execution_id}", pages.job),
            post("/jobs/{job_execution_id}/cancel", actions.cancel),
            get("/runners", pages.runners),
            post("/runners/{target_id}/pause", actions.pause_runner),
            post("/runners/{target_id}/resume", actions.resume_runner),
            post("/workspaces/{target_id}/pause", actions.pause_workspace),
            post("/workspaces/{target_id}/resume", actions.resume_workspace),
            get("/provisioners", pages.provisioner_page),
            get("/credentials", pages.credential_page),
            post("/credentials", actions.create_credential),
            post("/credentials/{family}/{credential_id}/revoke", actions.revoke_credential),
            get("/live", live.stream),
            Mount(PREFIX + "/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        exception_handlers={HTTPException: _error, ControlPlaneError: _refusal},
    )


def beside(api_default: ASGIApp, svc: Deps) -> ASGIApp:
    """The router default that serves the pages, and leaves every other path to `api_default`."""
    pages_app = build(svc)

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in ("/", PREFIX) or path.startswith(PREFIX + "/")):
            await pages_app(scope, receive, send)
        else:
            await api_default(scope, receive, send)

    return default
