"""Liveness, readiness and Prometheus metrics: no credential, so no query per request.

What they say about the database comes from `DatabaseProbe` (web/services.py), read at most once
per `health.refresh_seconds` whatever the request rate; the rest is this process's own state.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane import metrics
from controlplane.web import auth
from controlplane.web.edge import json_response
from controlplane.web.operations import TEXT, Op, operation

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
async def readyz(request: Request) -> Response:
    """Ready when the database answers, no migration is pending, and LISTEN is connected."""
    svc = auth.services(request)
    facts = await svc.probe.facts()
    listening = svc.listener is not None and svc.listener.connected
    checks = {
        "database": facts.database,
        "migrations": facts.migrations,
        "listener": "ok" if listening else "disconnected",
    }
    ready = all(value == "ok" for value in checks.values())
    return json_response({"ready": ready, "checks": checks}, 200 if ready else 503)


@operation(Op("Prometheus metrics", answer=TEXT))
async def metrics_text(request: Request) -> Response:
    svc = auth.services(request)
    metrics.parked_runners.set(svc.dispatcher.parked)
    metrics.workspace_actors.set(svc.dispatcher.actors)
    metrics.listener_connected.set(1 if svc.listener is not None and svc.listener.connected else 0)
    facts = await svc.probe.facts()
    if facts.depth is not None:  # else the gauges keep their last value; /readyz says why
        metrics.pending_jobs.set(facts.depth.pending)
        metrics.running_jobs.set(facts.depth.running)
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics_text, methods=["GET"]),
]
