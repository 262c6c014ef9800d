"""Liveness, readiness and Prometheus metrics: no credential, so no query per request.

What they say about the database comes from `DatabaseProbe`, read at most once per
`health.refresh_seconds` whatever the request rate (its query: store/readiness.py); the rest is
this process's own state.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import asyncpg
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane import metrics
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.listener import Listener
from controlplane.store.readiness import DatabaseFacts, read_facts
from controlplane.web.edge import json_response
from controlplane.web.endpoints import bound
from controlplane.web.operations import TEXT, Op, operation


class DatabaseProbe:
    """The database facts, read at most once per `refresh_seconds` however many requests ask:
    a request finding them stale reads them while concurrent ones wait for that same read.
    /readyz and /metrics answer without a credential, so nothing they do may cost a query per
    request. A read is bounded by `deadline_seconds` and, on failure, cached like a success."""

    def __init__(
        self, pool: asyncpg.Pool, *, refresh_seconds: float, deadline_seconds: float = 1.0
    ) -> None:
        self._pool = pool
        self._refresh = refresh_seconds
        self._deadline = deadline_seconds
        self._lock = anyio.Lock()
        self._facts: DatabaseFacts | None = None
        self._due = 0.0
        self.reads = 0

    async def facts(self) -> DatabaseFacts:
        if self._facts is not None and anyio.current_time() < self._due:
            return self._facts
        async with self._lock:
            if self._facts is None or anyio.current_time() >= self._due:
                self.reads += 1
                self._facts = await read_facts(self._pool, deadline_seconds=self._deadline)
                # Counted from the end of the read: a database that hangs for the whole
                # deadline is asked again a full interval later, not at once.
                self._due = anyio.current_time() + self._refresh
            return self._facts


@dataclass(frozen=True, slots=True)
class Deps:
    probe: DatabaseProbe
    dispatcher: Dispatcher  # parked runners and workspace actors, for the gauges
    listener: Listener

    @property
    def listening(self) -> bool:
        return self.listener.connected


_READY = {
    "type": "object",
    "properties": {"ready": {"type": "boolean"}, "checks": {"type": "object"}},
    "required": ["ready", "checks"],
}
_NOT_READY = {"description": "Not ready", "content": {"application/json": {"schema": _READY}}}


@operation(Op("Liveness", answer={"type": "object", "required": ["status"]}))
async def healthz(_request: Request) -> Response:
    return json_response({"status": "ok"})


@operation(Op("Readiness", answer=_READY, also={"503": _NOT_READY}))
async def readyz(svc: Deps, _request: Request) -> Response:
    """Ready when the database answers, no migration is pending, and LISTEN is connected."""
    facts = await svc.probe.facts()
    checks = {
        "database": facts.database,
        "migrations": facts.migrations,
        "listener": "ok" if svc.listening else "disconnected",
    }
    ready = all(value == "ok" for value in checks.values())
    return json_response({"ready": ready, "checks": checks}, 200 if ready else 503)


@operation(Op("Prometheus metrics", answer=TEXT))
async def metrics_text(svc: Deps, _request: Request) -> Response:
    metrics.parked_runners.set(svc.dispatcher.parked)
    metrics.workspace_actors.set(svc.dispatcher.actors)
    metrics.listener_connected.set(1 if svc.listening else 0)
    facts = await svc.probe.facts()
    if facts.depth is not None:  # else the gauges keep their last value; /readyz says why
        metrics.pending_jobs.set(facts.depth.pending)
        metrics.running_jobs.set(facts.depth.running)
        metrics.paused_workspaces.set(facts.depth.paused_workspaces)
        metrics.paused_runners.set(facts.depth.paused_runners)
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", bound(readyz, svc), methods=["GET"]),
        Route("/metrics", bound(metrics_text, svc), methods=["GET"]),
    ]
