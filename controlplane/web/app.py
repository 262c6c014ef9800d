"""The Starlette application: routes, each module's given what it needs, and the one error
mapping. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import asyncpg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.actors.assignments import AssignmentBoard
from controlplane.actors.cancels import CancelBoard
from controlplane.actors.control import ControlSessions
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.feed import FeedWatch
from controlplane.actors.listener import Listener
from controlplane.actors.provisioning import DemandBoard
from controlplane.errors import ControlPlaneError
from controlplane.settings import Settings
from controlplane.store.credentials import KeyRing
from controlplane.store.ordering import KnownOrderings
from controlplane.web import (
    admin,
    control,
    control_deps,
    eligibility,
    fleet,
    health,
    jobs,
    openapi,
    orchestrator,
    pauses,
    provisioners,
    readback,
    runner_control,
    runners,
    workspace_settings,
    workspaces,
)
from controlplane.web.auth import Authenticator, utc_now
from controlplane.web.errors import (
    handle_client_disconnect,
    handle_control_plane_error,
    handle_http_exception,
    handle_unexpected,
)
from controlplane.web.ui import app as ui
from controlplane.web.ui.plots import QueueHistory
from controlplane.web.ui.pulse import Pulse
from controlplane.web.ui.sessions import Deps as PageDeps

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Replica:
    """The live parts of one replica the routes are built from (app.py makes them). Only
    `build` reads it: each route module is handed the few parts it declares it needs."""

    settings: Settings
    pool: asyncpg.Pool
    auth: Authenticator
    keys: KeyRing
    dispatcher: Dispatcher
    cancels: CancelBoard
    feed: FeedWatch
    probe: health.DatabaseProbe
    listener: Listener
    control: ControlSessions
    demand: DemandBoard
    assignments: AssignmentBoard
    closing: anyio.Event
    pulse: Pulse  # the operator pages' live updates (web/ui/)
    history: QueueHistory  # and their plots
    orderings: KnownOrderings  # the claims' belief of each workspace's ordering

    def close(self) -> None:
        """Shutdown: release held heartbeats and event reads so they answer now."""
        self.closing.set()
        self.cancels.wake_all()
        self.feed.wake_all()


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


D = TypeVar("D")


def _routes(replica: Replica | None) -> list[BaseRoute]:
    """Every route, each module's bound to what it declares it needs (None: describing)."""

    def given(needs: Callable[[Replica], D]) -> D | None:
        return None if replica is None else needs(replica)

    return [
        *health.routes(given(lambda r: health.Deps(r.probe, r.dispatcher, r.listener))),
        *runners.routes(
            given(
                lambda r: runners.Deps(
                    r.settings,
                    r.pool,
                    r.auth,
                    r.dispatcher,
                    r.cancels,
                    r.feed,
                    r.closing,
                    r.settings.reserved_labels,
                    r.orderings,
                )
            )
        ),
        *orchestrator.routes(
            given(lambda r: orchestrator.Deps(r.settings, r.pool, r.auth, r.feed, r.closing))
        ),
        *readback.routes(given(lambda r: readback.Deps(r.settings, r.pool, r.auth))),
        *fleet.routes(given(lambda r: fleet.Deps(r.settings, r.pool, r.auth))),
        *admin.routes(given(lambda r: admin.Deps(r.settings, r.pool, r.auth, r.keys))),
        *workspace_settings.routes(
            given(lambda r: workspace_settings.Deps(r.settings, r.pool, r.auth))
        ),
        *workspaces.routes(given(lambda r: admin.Deps(r.settings, r.pool, r.auth, r.keys))),
        *eligibility.routes(
            given(lambda r: eligibility.Deps(r.settings, r.pool, r.auth, r.demand.wake_all))
        ),
        *jobs.routes(given(lambda r: jobs.Deps(r.settings, r.pool, r.auth, r.feed))),
        *pauses.routes(
            given(lambda r: pauses.Deps(r.settings, r.pool, r.auth, r.dispatcher.runner_paused))
        ),
        *provisioners.routes(
            given(lambda r: provisioners.Deps(r.settings, r.pool, r.auth, r.keys))
        ),
        *control.routes(
            given(
                lambda r: control_deps.Deps(
                    r.settings,
                    r.pool,
                    r.auth,
                    r.settings.reserved_labels,
                    utc_now,
                    r.control,
                    r.demand,
                )
            )
        ),
        *runner_control.routes(
            given(
                lambda r: runner_control.Deps(
                    r.settings, r.pool, r.auth, r.settings.reserved_labels, r.assignments
                )
            )
        ),
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
    ]


def build(replica: Replica | None) -> Starlette:
    """The app serving `replica`; None: the routes alone, to be described (OpenAPI)."""
    app = Starlette(
        routes=one_route_per_path(_routes(replica)),
        exception_handlers={
            ControlPlaneError: handle_control_plane_error,
            HTTPException: handle_http_exception,
            ClientDisconnect: handle_client_disconnect,
            Exception: handle_unexpected,
        },
    )
    # Read by the edge's body decoding and the served OpenAPI document; handlers get theirs.
    app.state.settings = None if replica is None else replica.settings
    if replica is not None:  # the operator pages answer where no API route does
        r = replica
        pages = PageDeps(
            r.settings, r.pool, r.feed, r.pulse, r.closing, r.history, r.dispatcher.runner_paused
        )
        app.router.default = ui.beside(app.router.default, pages)
    return app
