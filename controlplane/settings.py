"""Settings: config/controlplane.toml (every knob, with its default) plus environment overrides.

Precedence, lowest first: the defaults below, a TOML file (`--config`, or CONTROLPLANE_CONFIG), then
environment variables named CONTROLPLANE_<SECTION>_<KNOB> (e.g. CONTROLPLANE_SERVER_PORT=9000).
DATABASE_URL is honoured as CONTROLPLANE_DATABASE_URL. Every value is validated once, at start-up;
an invalid one stops the daemon with a message naming the knob.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from controlplane.domain.labels import LabelSet, parse_reserved
from controlplane.domain.ordering import MAX_CONCURRENCY_LIMIT, PRIORITY_BOUND
from controlplane.errors import ConfigError, InvalidInput

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400 * 365)]


class Database(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str = ""  # empty: start the embedded PostgreSQL in `embedded_data_dir`
    embedded_data_dir: str = "var/postgres"
    # 0: the port of the embedded server's last start (kept in <embedded_data_dir>.port), else
    # any free one. Set, it is used as it is.
    embedded_port: Annotated[int, msgspec.Meta(ge=0, le=65_535)] = 0
    pool_min_size: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2
    pool_max_size: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    statement_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 10_000
    lock_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 5_000
    # Client-side deadlines, so a hung connection cannot hang a request: waiting for a pooled
    # connection (or opening one), and any one statement (above statement_timeout_ms, so the
    # server's own timeout fires first while the server answers at all).
    acquire_timeout_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=600)] = 5.0
    command_timeout_seconds: Annotated[float, msgspec.Meta(ge=0.2, le=3600)] = 15.0


class Server(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65_535)] = 8080
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    # Arrays and objects nested in one request body or control-session frame, the job payload
    # included. The ceiling keeps every decoder well inside Python's recursion limit.
    max_json_depth: Annotated[int, msgspec.Meta(ge=8, le=256)] = 64
    shutdown_grace_seconds: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0
    keep_alive_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 75
    # Connection limits, applied before any route or credential check (controlplane/web/server.py).
    max_connections: Annotated[int, msgspec.Meta(ge=8, le=1_000_000)] = 16_384
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1024 * 1024)] = 16 * 1024
    header_read_timeout_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=300)] = 10.0
    body_read_timeout_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 30.0
    websocket_max_message_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024)] = 64 * 1024


class Queue(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_payload_bytes: Annotated[int, msgspec.Meta(ge=2, le=16 * 1024 * 1024)] = 64 * 1024
    max_batch_size: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 500
    # A job's priority must lie in priority_min..priority_max (0 is the default and always in);
    # the defaults are the widest the API's schema allows, a deployment may narrow them.
    priority_min: Annotated[int, msgspec.Meta(ge=-PRIORITY_BOUND, le=0)] = -PRIORITY_BOUND
    priority_max: Annotated[int, msgspec.Meta(ge=0, le=PRIORITY_BOUND)] = PRIORITY_BOUND
    max_concurrency_limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONCURRENCY_LIMIT)] = (
        MAX_CONCURRENCY_LIMIT
    )
    # The life of an execution (docs/policies.md). A job's run timeout, when it sends none, is
    # GitHub's default (6 h); the largest it may ask is GitHub's self-hosted ceiling (5 days).
    default_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=30 * 86_400)] = 6 * 3600
    max_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=30 * 86_400)] = 5 * 86_400
    # After its run deadline a lease's runner is told to stop; this long after, the leader ends it.
    timeout_grace_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    # How long a job may wait in the queue: GitHub drops self-hosted jobs queued 24 h.
    default_queue_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=30 * 86_400)] = 86_400
    max_queue_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=30 * 86_400)] = 7 * 86_400
    # Retries of a lease lost with its runner a job may ask for (it asks for none by default).
    max_retries_on_lost: Annotated[int, msgspec.Meta(ge=0, le=100)] = 5


class Runners(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    long_poll_max_seconds: Annotated[float, msgspec.Meta(ge=1, le=300)] = 50.0
    liveness_throttle_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 10
    stale_lease_threshold_seconds: Annotated[int, msgspec.Meta(ge=2, le=86_400)] = 180
    no_first_heartbeat_grace_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    heartbeat_interval_seconds: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 10.0
    cancel_wait_max_seconds: Annotated[float, msgspec.Meta(ge=1, le=300)] = 30.0
    reserved_labels: str = ""
    session_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=90 * 86_400)] = 7 * 86_400
    lease_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=30, le=86_400)] = 900
    manual_session_retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 30
    capped_session_retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 7
    output_tail_bytes: Annotated[int, msgspec.Meta(ge=0, le=1024 * 1024)] = 16 * 1024
    paused_retry_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 30
    tool_capabilities_stale_after_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60


class Maintenance(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    reaper_interval_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 5.0
    reaper_batch_limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    session_gc_interval_seconds: Annotated[float, msgspec.Meta(ge=1, le=86_400)] = 300.0
    session_gc_batch_size: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    dispatch_safety_tick_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=600)] = 5.0
    # A workspace's dispatch actor retires this long after its last parked runner left.
    dispatch_actor_idle_seconds: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 5.0
    provisioning_interval_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 10.0
    retention_interval_seconds: Annotated[float, msgspec.Meta(ge=1, le=86_400)] = 3600.0
    retention_batch_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    event_retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 30
    tombstone_retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 90


class Provisioners(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    last_seen_throttle_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 10
    # The replica stamps the last-seen of its pinged control sessions in one statement this often.
    session_seen_batch_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=3600)] = 10.0
    installation_enabled: bool = True
    # An installation provisioner's walk gives each workspace at most an even share of its slots
    # (issue 14's fair share) instead of serving the oldest demand first with all of them.
    installation_fair_share: bool = False
    reservation_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 60
    reservation_ttl_max_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 600
    # The replica's demand sweep: one statement for all its sessions, waking those whose
    # figures moved (actors/provisioning/sweep.py).
    demand_safety_tick_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=600)] = 2.0
    # Pending jobs the sweep counts per workspace, at most.
    demand_sweep_pending_cap: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1000
    # The slow safety net: a session with anything a round could act on has one at least this
    # often (the replica's sweep asks about all its sessions in one statement every half of it;
    # an idle session: no round, so it costs nothing).
    demand_full_round_seconds: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 600.0
    # An installation walk leaves out covered, unchanged workspaces (issue 16) but visits every
    # one this often all the same.
    demand_full_walk_seconds: Annotated[float, msgspec.Meta(ge=1, le=86_400)] = 60.0
    active_window_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 120
    bootstrap_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 300
    control_session_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 3600
    activation_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 300
    assignment_poll_max_wait_seconds: Annotated[int, msgspec.Meta(ge=1, le=300)] = 30
    demand_activation_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 300
    reconcile_terminate_grace_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 120
    stale_runner_threshold_seconds: Annotated[int, msgspec.Meta(ge=2, le=86_400)] = 300
    stale_runner_reaper_limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    runner_active_window_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    ephemeral_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 300
    ephemeral_register_rate_limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 5
    ephemeral_register_rate_window_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    ephemeral_token_retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 7
    eligibility_max_workspaces: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000
    divergence_by_template: bool = False


class Events(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held (long-poll) event-feed reads."""

    held_reads_per_key: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100
    recheck_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=60)] = 0.25


class Health(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """/readyz and /metrics, which answer without a credential."""

    refresh_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=60)] = 1.0
    # The longest that read may take before /readyz answers 503 (a failure is cached too).
    deadline_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=30)] = 1.0


class Pages(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The operator pages under /ui/ (controlplane/web/ui/)."""

    session_ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=7 * 86_400)] = 8 * 3600
    sign_in_link_ttl_seconds: Annotated[int, msgspec.Meta(ge=10, le=86_400)] = 600
    list_limit: Annotated[int, msgspec.Meta(ge=10, le=1000)] = 100
    form_max_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1_048_576)] = 16_384
    live_keepalive_seconds: Annotated[float, msgspec.Meta(ge=1, le=300)] = 15.0
    live_min_interval_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=60)] = 0.5
    live_stream_max_seconds: Annotated[float, msgspec.Meta(ge=5, le=86_400)] = 300.0
    plot_sample_seconds: Annotated[float, msgspec.Meta(ge=5, le=600)] = 30.0


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    database: Database = msgspec.field(default_factory=Database)
    server: Server = msgspec.field(default_factory=Server)
    queue: Queue = msgspec.field(default_factory=Queue)
    runners: Runners = msgspec.field(default_factory=Runners)
    maintenance: Maintenance = msgspec.field(default_factory=Maintenance)
    provisioners: Provisioners = msgspec.field(default_factory=Provisioners)
    events: Events = msgspec.field(default_factory=Events)
    health: Health = msgspec.field(default_factory=Health)
    pages: Pages = msgspec.field(default_factory=Pages)

    @property
    def reserved_labels(self) -> LabelSet:
        return parse_reserved(self.runners.reserved_labels)


# Variables the client commands read (`enqueue`, `status`, `runner`, `provisioner local`, ...), and
# those a runner sets for its job. `dev` writes several of them to var/dev.env for a second shell,
# so a shell that sourced it must still start a server: they are not settings, and not typos.
CLIENT_VARIABLES = frozenset(
    {
        "CONTROLPLANE_URL",
        "CONTROLPLANE_WORKSPACE",
        "CONTROLPLANE_ORCHESTRATOR_KEY",
        "CONTROLPLANE_ADMIN_KEY",
        "CONTROLPLANE_RUNNER_TOKEN",
        "CONTROLPLANE_BOOTSTRAP_TOKEN",
        "CONTROLPLANE_PROVISIONER_TOKEN",
        "CONTROLPLANE_JOB_EXECUTION_ID",
        "CONTROLPLANE_JOB_ID",
    }
)


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    known = {field.name: field.type for field in msgspec.structs.fields(Settings)}
    if "DATABASE_URL" in environ:
        overrides.setdefault("database", {})["url"] = environ["DATABASE_URL"]
    for name, value in environ.items():
        if not name.startswith("CONTROLPLANE_") or name == "CONTROLPLANE_CONFIG":
            continue
        if name in CLIENT_VARIABLES:
            continue
        rest = name.removeprefix("CONTROLPLANE_").lower()
        section, _, knob = rest.partition("_")
        if section not in known or not knob:
            raise ConfigError(f"unknown setting in environment: {name}")
        knobs = {field.name for field in msgspec.structs.fields(known[section])}
        if knob not in knobs:
            raise ConfigError(f"unknown setting in environment: {name}")
        overrides.setdefault(section, {})[knob] = value
    return overrides


def _merge(base: dict[str, Any], overrides: dict[str, dict[str, str]]) -> dict[str, Any]:
    merged = {section: dict(values) for section, values in base.items()}
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    return merged


def _check(settings: Settings) -> Settings:
    runners = settings.runners
    if runners.no_first_heartbeat_grace_seconds >= runners.stale_lease_threshold_seconds:
        raise ConfigError(
            "runners.no_first_heartbeat_grace_seconds must be below "
            "runners.stale_lease_threshold_seconds"
        )
    if runners.heartbeat_interval_seconds * 2 > runners.stale_lease_threshold_seconds:
        raise ConfigError(
            "runners.heartbeat_interval_seconds must be at most half of "
            "runners.stale_lease_threshold_seconds, or live leases would expire"
        )
    queue = settings.queue
    if queue.default_timeout_seconds > queue.max_timeout_seconds:
        raise ConfigError("queue.default_timeout_seconds must not exceed queue.max_timeout_seconds")
    if queue.default_queue_timeout_seconds > queue.max_queue_timeout_seconds:
        raise ConfigError(
            "queue.default_queue_timeout_seconds must not exceed queue.max_queue_timeout_seconds"
        )
    if queue.timeout_grace_seconds <= runners.heartbeat_interval_seconds:
        raise ConfigError(
            "queue.timeout_grace_seconds must exceed runners.heartbeat_interval_seconds, so a "
            "runner that does not hold its heartbeat still hears of its timeout within the grace"
        )
    url = settings.database.url
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            "database.url must be a postgresql:// URL, or empty for the embedded server"
        )
    if not settings.database.embedded_data_dir.strip():
        raise ConfigError("database.embedded_data_dir must name a folder")
    host = settings.server.host
    if not host or host != host.strip() or " " in host:
        raise ConfigError("server.host must be an address or host name, without spaces")
    if settings.database.pool_min_size > settings.database.pool_max_size:
        raise ConfigError("database.pool_min_size must not exceed database.pool_max_size")
    if settings.database.command_timeout_seconds * 1000 <= settings.database.statement_timeout_ms:
        raise ConfigError(
            "database.command_timeout_seconds must exceed database.statement_timeout_ms, so the "
            "server cancels a slow statement before the client gives up on its connection"
        )
    prov = settings.provisioners
    if prov.reservation_ttl_seconds > prov.reservation_ttl_max_seconds:
        raise ConfigError(
            "provisioners.reservation_ttl_seconds must not exceed "
            "provisioners.reservation_ttl_max_seconds"
        )
    if prov.stale_runner_threshold_seconds <= max(
        prov.last_seen_throttle_seconds, runners.liveness_throttle_seconds
    ):
        raise ConfigError(
            "provisioners.stale_runner_threshold_seconds must exceed "
            "provisioners.last_seen_throttle_seconds and runners.liveness_throttle_seconds"
        )
    try:
        parse_reserved(runners.reserved_labels)
    except InvalidInput as error:
        raise ConfigError(f"runners.reserved_labels: {error.message}") from error
    return settings


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, merge and validate settings. Raises ConfigError naming the offending knob."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get("CONTROLPLANE_CONFIG"):
        path = Path(environ["CONTROLPLANE_CONFIG"])
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError as error:
            raise ConfigError(f"config file not found: {path}") from error
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from error
    merged = _merge(raw, _env_overrides(environ))
    try:
        # Environment values arrive as text; strict=False parses them as the knob's type.
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as error:
        raise ConfigError(f"invalid setting: {_knob_message(error)}") from error
    return _check(settings)


def _knob_message(error: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.runners.long_poll_max_seconds`", or "... - at `$`" for the top
    # level, or nothing after the message; lead with the section or knob's name when there is one.
    text = str(error)
    message, marker, where = text.rpartition(" - at `$")
    if not marker:
        return text
    where = where.removeprefix(".").removesuffix("`")
    return f"{where}: {message}" if where else message
