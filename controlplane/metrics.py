"""Every metric, declared once. Labels are bounded: no ids, only small fixed vocabularies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

claims = Counter(
    "controlplane_job_claims_total",
    "Job requests answered, by outcome (claimed, empty, error).",
    ["outcome"],
    registry=REGISTRY,
)
enqueued = Counter(
    "controlplane_jobs_enqueued_total",
    "Job executions offered by the orchestrator, by result (enqueued, duplicate, running, ended).",
    ["result"],
    registry=REGISTRY,
)
completed = Counter(
    "controlplane_jobs_completed_total",
    "Leases completed by their runner, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
leases_expired = Counter(
    "controlplane_leases_expired_total", "Leases expired by the reaper.", registry=REGISTRY
)
put_backs = Counter(
    "controlplane_put_backs_total",
    "Claims returned to the queue because their runner was gone.",
    registry=REGISTRY,
)
parked_runners = Gauge(
    "controlplane_parked_runners", "Job requests held on a long poll.", registry=REGISTRY
)
workspace_actors = Gauge(
    "controlplane_workspace_actors", "Live workspace dispatch actors.", registry=REGISTRY
)
pending_jobs = Gauge(
    "controlplane_pending_job_executions",
    "Pending job executions (all replicas).",
    registry=REGISTRY,
)
running_jobs = Gauge(
    "controlplane_running_job_executions",
    "Leased job executions (all replicas).",
    registry=REGISTRY,
)
listener_connected = Gauge(
    "controlplane_listener_connected", "1 while LISTEN/NOTIFY is connected.", registry=REGISTRY
)
dispatch_latency = Histogram(
    "controlplane_dispatch_seconds",
    "From job request arrival to its answer, by outcome.",
    ["outcome"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
    registry=REGISTRY,
)
