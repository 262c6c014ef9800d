"""Every metric, declared once. Labels are bounded: no ids, only small fixed vocabularies."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

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
jobs_timed_out = Counter(
    "controlplane_jobs_timed_out_total",
    "Leases ended by the leader past their run timeout and its grace (outcome timed_out).",
    registry=REGISTRY,
)
jobs_queue_expired = Counter(
    "controlplane_jobs_queue_expired_total",
    "Pending executions removed by the leader past their queue timeout (outcome queue_expired).",
    registry=REGISTRY,
)
jobs_retried = Counter(
    "controlplane_jobs_retried_total",
    "Leases lost with their runner whose execution went back to the queue for another attempt.",
    registry=REGISTRY,
)
claims_key_full = Counter(
    "controlplane_claim_key_full_steps_total",
    "Pending jobs a claim locked and then stepped over because their concurrency key had no free "
    "slot at admission (full, or its key row held by another claim admitting).",
    registry=REGISTRY,
)
put_backs = Counter(
    "controlplane_put_backs_total",
    "Claims returned to the queue because their runner was gone.",
    registry=REGISTRY,
)
paused_answers = Counter(
    "controlplane_paused_answers_total",
    'Job requests answered "paused" (204 Controlplane-Paused), parked or new.',
    registry=REGISTRY,
)
pause_changes = Counter(
    "controlplane_pause_changes_total",
    "Pause changes made through this replica, by kind (workspace, runner, runner_instance) "
    "and action (pause, resume; drain and undrain for a runner instance).",
    ["kind", "action"],
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
paused_workspaces = Gauge(
    "controlplane_paused_workspaces", "Paused workspaces (all replicas).", registry=REGISTRY
)
paused_runners = Gauge(
    "controlplane_paused_runner_sessions",
    "Paused runner sessions (all replicas).",
    registry=REGISTRY,
)
connections_closed = Counter(
    "controlplane_http_connections_closed_total",
    "Connections this replica closed or refused at its connection limits, by reason "
    "(evicted, refused, header-too-large, header-timeout, body-timeout, "
    "websocket-message-too-large, "
    "websocket-protocol-error).",
    ["reason"],
    registry=REGISTRY,
)
listener_connected = Gauge(
    "controlplane_listener_connected", "1 while LISTEN/NOTIFY is connected.", registry=REGISTRY
)
event_reads_held = Gauge(
    "controlplane_event_reads_held", "Event-feed reads held on a long poll.", registry=REGISTRY
)
dispatch_latency = Histogram(
    "controlplane_dispatch_seconds",
    "From job request arrival to its answer, by outcome.",
    ["outcome"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
    registry=REGISTRY,
)

# --- provisioning ------------------------------------------------------------------------------
# Durations are seconds. `provider` is a runner instance's provider kind as its provisioner named
# it, bounded by `provider_label`; `launch_kind` is demand, warm, manual or unknown.

LIFECYCLE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_TIME_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 900, 1800, 3600, 14_400)

runner_reports = Counter(
    "controlplane_runner_reports_total",
    "Runner instance report events accepted from provisioners, by reported state.",
    ["state"],
    registry=REGISTRY,
)
bootstrap_exchanges = Counter(
    "controlplane_runner_bootstrap_exchanges_total",
    "Bootstrap token exchanges, by outcome (accepted, rejected).",
    ["outcome"],
    registry=REGISTRY,
)
activation_not_issued = Counter(
    "controlplane_runner_activation_not_issued_total",
    "Activation tokens not issued to an assigned runner, by reason (runner-not-found, "
    "missing-workspace, existing-session, not-running) and surface (enrollment, poll).",
    ["reason", "surface"],
    registry=REGISTRY,
)
control_heartbeats = Counter(
    "controlplane_runner_control_heartbeats_total",
    "Accepted control-session heartbeats of provisioned runners.",
    registry=REGISTRY,
)
runners_reaped = Counter(
    "controlplane_runner_instances_reaped_total",
    "Active runner instances failed by maintenance (neither they nor their provisioner heard).",
    registry=REGISTRY,
)
reconciles = Counter(
    "controlplane_runner_reconciles_total",
    "Successful reconcile requests of provisioners.",
    registry=REGISTRY,
)
absent_terminated = Counter(
    "controlplane_runner_instances_absent_terminated_total",
    "Runner instances terminated by reconcile because the provider no longer had them.",
    registry=REGISTRY,
)
terminate_intents_issued = Counter(
    "controlplane_terminate_intents_issued_total",
    "Terminate intents told to provisioners, by surface (demand: newly in a pushed demand "
    "message; reconcile: in a reconcile answer) and reason (activation-timeout, job-cancelled, "
    "terminal-state).",
    ["surface", "reason"],
    registry=REGISTRY,
)
terminate_intents_honored = Counter(
    "controlplane_terminate_intents_honored_total",
    "Runner instances first reported terminated after a terminate intent, by its reason.",
    ["reason"],
    registry=REGISTRY,
)
activation_outcomes = Counter(
    "controlplane_runner_activation_outcomes_total",
    "What became of demand runners that were not activated in time: rebound (bound to new "
    "demand of their workspace) or reaped (first delivery of an activation-timeout intent).",
    ["outcome"],
    registry=REGISTRY,
)
units_released = Counter(
    "controlplane_reservation_units_released_total",
    "Reservation units given back by runner reports, reconciles and maintenance, by source.",
    ["source"],
    registry=REGISTRY,
)
promotion_failures = Counter(
    "controlplane_reservation_promotion_failures_total",
    "Enrollments whose intended reservation could not be promoted to an assignment, by reason "
    "(reservation-expired, reservation-not-found, already-assigned, not-assignable, unexpected).",
    ["reason"],
    registry=REGISTRY,
)
capacity_failures = Counter(
    "controlplane_reservation_capacity_failures_total",
    "Runner instance units refused at creation, by reason (reservation-not-found, "
    "reservation-kind-mismatch, reservation-expired, capacity-exhausted).",
    ["reason"],
    registry=REGISTRY,
)
assignments_rejected = Counter(
    "controlplane_runner_assignments_rejected_total",
    "Rejected assignments of runner instances to reservations, by reason and surface "
    "(provisioner: an assign request; enrollment: a promotion at enrollment).",
    ["reason", "surface"],
    registry=REGISTRY,
)
created_to_control_session = Histogram(
    "controlplane_runner_created_to_control_session_seconds",
    "From a runner instance's creation to its bootstrap exchange (its control session).",
    ["provider", "launch_kind"],
    buckets=LIFECYCLE_BUCKETS,
    registry=REGISTRY,
)
activation_to_first_claim = Histogram(
    "controlplane_runner_activation_to_first_claim_seconds",
    "From a provisioned runner's activation (its runner session) to its first claim.",
    ["provider", "launch_kind"],
    buckets=LIFECYCLE_BUCKETS,
    registry=REGISTRY,
)
queue_time = Histogram(
    "controlplane_job_queue_seconds",
    "From enqueue to claim of a job execution (long-poll claims), by the claiming runner's "
    "provider and launch kind (manual runners: provider unknown, launch kind manual).",
    ["provider", "launch_kind"],
    buckets=QUEUE_TIME_BUCKETS,
    registry=REGISTRY,
)
allocation_rounds = Counter(
    "controlplane_allocation_rounds_total",
    "Allocation rounds of provisioner actors, by outcome (ok, fenced, error).",
    ["outcome"],
    registry=REGISTRY,
)
allocation_seconds = Histogram(
    "controlplane_allocation_round_seconds",
    "Duration of one allocation round of a provisioner actor (every workspace it serves).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
allocation_triggers = Counter(
    "controlplane_allocation_round_triggers_total",
    "What started a provisioner actor's allocation round: wake (a notification, a request or "
    "the demand sweep), deadline (a reservation, activation or warm launch it knew of fell "
    "due), fallback (the replica's full round, every provisioners.demand_full_round_seconds, "
    "found something the round could act on).",
    ["trigger"],
    registry=REGISTRY,
)
dispatch_ticks = Counter(
    "controlplane_dispatch_ticks_total",
    "Per-replica dispatch safety ticks (one read for every workspace actor with parked runners), "
    "by outcome (ok, error).",
    ["outcome"],
    registry=REGISTRY,
)
dispatch_tick_woken = Counter(
    "controlplane_dispatch_tick_woken_total",
    "Workspace actors the dispatch safety tick woke because a claim could take work there (a "
    "lost notification, or work a claim stepped over); after a failed read, every actor.",
    registry=REGISTRY,
)
demand_sweeps = Counter(
    "controlplane_demand_sweeps_total",
    "Per-replica demand sweeps (one statement for every control session on the replica), by "
    "outcome (ok, error; full: the full round's check, one more statement).",
    ["outcome"],
    registry=REGISTRY,
)
demand_sweep_woken = Counter(
    "controlplane_demand_sweep_woken_total",
    "Provisioner actors the demand sweep woke because their figures moved.",
    registry=REGISTRY,
)
demand_pushes = Counter(
    "controlplane_demand_pushes_total",
    "Demand messages pushed to provisioners, by outcome (sent, failed).",
    ["outcome"],
    registry=REGISTRY,
)
control_sessions = Gauge(
    "controlplane_provisioner_control_sessions",
    "Live provisioner control sessions (with a running actor) on this replica.",
    registry=REGISTRY,
)
control_session_to_assignment = Histogram(
    "controlplane_runner_control_session_to_assignment_seconds",
    "From a runner instance's control session to the assignment that committed for it, by "
    "surface (provisioner: an assign request; enrollment: a promotion at enrollment).",
    ["provider", "launch_kind", "surface"],
    buckets=LIFECYCLE_BUCKETS,
    registry=REGISTRY,
)
assignment_to_activation = Histogram(
    "controlplane_runner_assignment_to_activation_seconds",
    "From a provisioned runner's assignment to its activation (its runner session).",
    ["provider", "launch_kind"],
    buckets=LIFECYCLE_BUCKETS,
    registry=REGISTRY,
)
count_divergence = Counter(
    "controlplane_runner_count_divergence_total",
    "Runner instances by which a provisioner's advertised starting or running count of a "
    "template differs from the stored instances, counted once per advertisement, by state "
    "(starting, running), direction (backend-higher, advertised-higher) and template_key "
    "(empty unless provisioners.divergence_by_template).",
    ["state", "direction", "template_key"],
    registry=REGISTRY,
)
rate_limit_checks = Counter(
    "controlplane_rate_limit_checks_total",
    "Rate-limiter checks, by action (ephemeral-register) and outcome (allowed, blocked, "
    "unavailable).",
    ["action", "outcome"],
    registry=REGISTRY,
)
rate_limit_prune_failures = Counter(
    "controlplane_rate_limit_prune_failures_total",
    "Failed prunes of rate-limiter rows. They go with their ephemeral token, so this counts "
    "maintenance rounds whose ephemeral-token GC failed.",
    registry=REGISTRY,
)


_VALUES_KEPT = 32
_providers: set[str] = set()
_template_keys: set[str] = set()


def _kept(kept: set[str], value: str) -> str:
    """`value` if it is one of the first few distinct values of its label, else `other`."""
    if value in kept:
        return value
    if len(kept) < _VALUES_KEPT and value.isascii() and len(value) <= 64:
        kept.add(value)
        return value
    return "other"


def provider_label(kind: str | None) -> str:
    """A provider kind as a label value. Provisioners name it freely, so the first few distinct
    kinds this process sees are kept and later ones become `other`; missing is `unknown`."""
    return _kept(_providers, kind) if kind else "unknown"


def template_label(key: str) -> str:
    """A template key as a label value, bounded as provider kinds are."""
    return _kept(_template_keys, key)


def observe_seconds(histogram: Histogram, seconds: float, *labels: str) -> None:
    """Record a lifecycle duration. Negative ones (clock skew between rows) are dropped."""
    if seconds >= 0:
        histogram.labels(*labels).observe(seconds)


class _PhaseSnapshot(Collector):
    """Sessionless starting/running runner instances per lifecycle phase, as the maintenance
    leader last counted them (it takes a query, so one replica does it each provisioning run).
    A snapshot is exposed only until `fresh_until`, so a replica that stopped leading stops
    reporting instead of repeating old figures."""

    def __init__(self) -> None:
        self._rows: list[tuple[str, str, str, int, float]] = []
        self._fresh_until = 0.0

    def update(self, rows: list[tuple[str, str, str, int, float]], fresh_for: float) -> None:
        merged: dict[tuple[str, str, str], tuple[int, float]] = {}
        for phase, provider, launch_kind, n, age in rows:  # providers folded into `other` add up
            before, oldest = merged.get((phase, provider, launch_kind), (0, 0.0))
            merged[(phase, provider, launch_kind)] = (before + n, max(oldest, age))
        self._rows = [(*key, n, age) for key, (n, age) in sorted(merged.items())]
        self._fresh_until = time.monotonic() + fresh_for

    def collect(self) -> Iterable[Metric]:
        labels = ["phase", "provider", "launch_kind"]
        count = GaugeMetricFamily(
            "controlplane_runner_instances_by_phase",
            "Starting or running runner instances without a runner session, by phase "
            "(control_session, enrollment, assignment, activation, idle); maintenance leader only.",
            labels=labels,
        )
        oldest = GaugeMetricFamily(
            "controlplane_runner_instances_by_phase_oldest_age_seconds",
            "Age of the oldest instance in each phase, from the phase's start; leader only.",
            labels=labels,
        )
        if time.monotonic() < self._fresh_until:
            for phase, provider, launch_kind, n, age in self._rows:
                count.add_metric([phase, provider, launch_kind], n)
                oldest.add_metric([phase, provider, launch_kind], age)
        yield count
        yield oldest


runner_phases = _PhaseSnapshot()
REGISTRY.register(runner_phases)


class _LeaderGauge(Collector):
    """One figure the maintenance leader counts, exposed only while fresh (as `runner_phases`)."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name, self._documentation = name, documentation
        self._value = 0.0
        self._fresh_until = 0.0

    def update(self, value: float, fresh_for: float) -> None:
        self._value = value
        self._fresh_until = time.monotonic() + fresh_for

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily(self._name, self._documentation)
        if time.monotonic() < self._fresh_until:
            gauge.add_metric([], self._value)
        yield gauge


enrolled_without_recent_report = _LeaderGauge(
    "controlplane_runner_instances_enrolled_without_recent_report",
    "Running runner instances with an open control session, no workspace and no runner session "
    "whose last report is older than provisioners.stale_runner_threshold_seconds; maintenance "
    "leader only.",
)
REGISTRY.register(enrolled_without_recent_report)
