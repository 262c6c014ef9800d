"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import logging

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane import metrics
from controlplane.store import migrations, queries
from controlplane.web import auth
from controlplane.web.edge import json_response

_READY_TIMEOUT_SECONDS = 1.0

log = logging.getLogger("controlplane.health")


async def healthz(_request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when the database answers, no migration is pending, and LISTEN is connected."""
    svc = auth.services(request)
    checks: dict[str, str] = {}
    try:
        with anyio.fail_after(_READY_TIMEOUT_SECONDS):
            async with svc.pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
                checks["database"] = "ok"
                todo = await migrations.pending(conn)
                checks["migrations"] = "ok" if not todo else f"{len(todo)} pending"
    except Exception as error:
        checks.setdefault("database", f"unreachable: {type(error).__name__}")
        checks.setdefault("migrations", "unknown")
    listening = svc.listener is not None and svc.listener.connected
    checks["listener"] = "ok" if listening else "disconnected"
    ready = all(value == "ok" for value in checks.values())
    return json_response({"ready": ready, "checks": checks}, 200 if ready else 503)


async def metrics_text(request: Request) -> Response:
    svc = auth.services(request)
    metrics.parked_runners.set(svc.dispatcher.parked)
    metrics.workspace_actors.set(svc.dispatcher.actors)
    metrics.listener_connected.set(1 if svc.listener is not None and svc.listener.connected else 0)
    try:
        with anyio.fail_after(_READY_TIMEOUT_SECONDS):
            async with svc.pool.acquire() as conn:
                depth = await queries.depth(conn)
        metrics.pending_jobs.set(depth.pending)
        metrics.running_jobs.set(depth.running)
    except Exception as error:  # the gauges keep their last value; readiness reports the database
        log.warning("metrics.depth_failed", extra={"error": repr(error)})
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics_text, methods=["GET"]),
]
