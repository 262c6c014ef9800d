"""The daemon: database, migrations, and one root task group that owns everything that runs.

Start-up: the embedded PostgreSQL when no URL is configured, then migrations (serialised across
replicas by an advisory lock), the pool, the signing keys, then the root task group: the
LISTEN connection, the dispatcher (which supervises workspace actors), maintenance, and uvicorn
(assembled with its connection limits in web/server.py).

Shutdown on SIGTERM or SIGINT: new job requests are refused and every parked one is answered with
204 and Retry-After; held heartbeats and event polls are released; uvicorn then stops accepting
and gives in-flight requests `server.shutdown_grace_seconds`. A claim in flight when the signal
arrives is shielded, and either reaches its runner or is put back, so nothing is left claimed and
undelivered. The embedded server, if we started it, is stopped last.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from uuid import UUID

import anyio
import asyncpg

from controlplane import metrics
from controlplane.actors.assignments import AssignmentBoard
from controlplane.actors.cancels import CancelBoard
from controlplane.actors.control import ControlSessions, LastSeen, PoolSeen
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.feed import FeedWatch
from controlplane.actors.listener import Listener
from controlplane.actors.maintenance.deadlines import Deadlines, PoolDeadlineStore
from controlplane.actors.maintenance.leadership import Leadership
from controlplane.actors.maintenance.provisioning import PoolUpkeepStore, ProvisioningUpkeep
from controlplane.actors.maintenance.reaper import LeaseReaper, PoolReaperStore
from controlplane.actors.maintenance.retention import PoolRetentionStore, Retention
from controlplane.actors.maintenance.sessions import PoolSessionStore, SessionCleanup
from controlplane.actors.provisioning import DemandBoard, DemandSweep
from controlplane.actors.provisioning.sweep import PoolSweep
from controlplane.domain import pauses
from controlplane.domain.jobs import ClaimedJob, SessionClaims, StaleRule
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.settings import Settings
from controlplane.store import (
    claiming,
    migrations,
    parked,
    queue,
    reservations,
)
from controlplane.store.credentials import KeyRing
from controlplane.store.embedded import EmbeddedPostgres
from controlplane.store.events import EVENTS_CHANNEL
from controlplane.store.leases import CANCEL_CHANNEL
from controlplane.store.locks import LeaderLock
from controlplane.store.ordering import KnownOrderings
from controlplane.store.pauses import PAUSED_CHANNEL
from controlplane.store.pool import PoolSettings, borrow, connect, create_pool
from controlplane.store.provisioner_sessions import TAKEOVER_CHANNEL
from controlplane.web import app as web_app
from controlplane.web import server as http_server
from controlplane.web.auth import Authenticator
from controlplane.web.health import DatabaseProbe
from controlplane.web.ui.plots import QueueHistory
from controlplane.web.ui.pulse import Pulse

log = logging.getLogger("controlplane.app")


class PoolClaims:
    """The dispatcher's view of the store: claim and put back, the replica's tick read and
    liveness stamp (store/parked.py), each on a pooled connection.
    `orderings`: the replica's belief of each workspace's ordering, shared with the HTTP claim
    (store/ordering.py `KnownOrderings`)."""

    def __init__(
        self, pool: asyncpg.Pool, throttle: timedelta, orderings: KnownOrderings | None = None
    ) -> None:
        self._pool = pool
        self._throttle = throttle
        self._orderings = KnownOrderings() if orderings is None else orderings

    async def claim(self, session: SessionClaims) -> ClaimedJob | None:
        async with borrow(self._pool) as conn:
            return await claiming.claim(
                conn, session, liveness_throttle=self._throttle, orderings=self._orderings
            )

    async def claim_batch(
        self, workspace_id: UUID, labels: LabelSet, runner_session_ids: list[UUID]
    ) -> dict[UUID, ClaimedJob]:
        async with borrow(self._pool) as conn:
            return await claiming.claim_batch(
                conn, workspace_id, labels, runner_session_ids, self._orderings
            )

    async def claimable(self, pairs: Sequence[tuple[UUID, LabelSet]]) -> list[bool]:
        async with borrow(self._pool) as conn:
            return await parked.claimable(conn, pairs)

    async def touch(self, sessions: Sequence[tuple[UUID, UUID]]) -> None:
        async with borrow(self._pool) as conn:
            await parked.touch_sessions(conn, sessions, self._throttle)

    async def put_back(self, job_execution_id: UUID, runner_session_id: UUID) -> bool:
        async with borrow(self._pool) as conn:
            done = await queue.put_back(conn, job_execution_id, runner_session_id)
        metrics.put_backs.inc()
        return done


def pool_settings(settings: Settings, url: str) -> PoolSettings:
    db = settings.database
    return PoolSettings(
        url=url,
        min_size=db.pool_min_size,
        max_size=db.pool_max_size,
        statement_timeout_ms=db.statement_timeout_ms,
        lock_timeout_ms=db.lock_timeout_ms,
        acquire_timeout_seconds=db.acquire_timeout_seconds,
        command_timeout_seconds=db.command_timeout_seconds,
    )


@contextlib.asynccontextmanager
async def database(settings: Settings) -> AsyncIterator[str]:
    """The configured database URL, or an embedded server started (and later stopped) for us."""
    if settings.database.url:
        yield settings.database.url
        return
    server = EmbeddedPostgres(
        Path(settings.database.embedded_data_dir), port=settings.database.embedded_port
    )
    url = await anyio.to_thread.run_sync(server.start)
    # The URL carries the password: it stays in this process, and only the masked one is logged.
    log.info(
        "embedded_postgres.started" if server.owned else "embedded_postgres.attached",
        extra={
            "data_dir": str(server.data_dir),
            "url": server.masked_url,
            "secret_file": str(server.secret_file),
        },
    )
    try:
        yield url
    finally:
        with anyio.CancelScope(shield=True):
            await _leave_embedded(server, url)


async def _leave_embedded(server: EmbeddedPostgres, url: str) -> None:
    """The last process out stops the embedded server, whichever started it: one that others
    still use (replicas, a CLI command, `dev` started from the same folder) is left running for
    them, and the last of them stops it. Our own pool is closed by now."""
    try:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            others: int = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            )
        finally:
            await conn.close()
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return  # already stopped by someone else, or unreachable: nothing to decide
    if others:
        log.info(
            "embedded_postgres.left_running",
            extra={"data_dir": str(server.data_dir), "other_connections": others},
        )
        return
    await anyio.to_thread.run_sync(server.stop)
    log.info("embedded_postgres.stopped", extra={"data_dir": str(server.data_dir)})


async def migrate(url: str, settings: Settings) -> list[migrations.Migration]:
    conn = await connect(pool_settings(settings, url))
    try:
        return await migrations.migrate(conn)
    finally:
        await conn.close()


def _on_enqueued(
    dispatcher: Dispatcher, demand: DemandBoard, pulse: Pulse
) -> Callable[[str], None]:
    def wake(payload: str) -> None:
        pulse.poke()
        workspace, _, labels = payload.partition("|")
        try:
            workspace_id = UUID(workspace)
        except ValueError:
            return
        label_set = canonicalise(labels.split(",")) if labels else None
        dispatcher.wake(workspace_id, label_set)
        demand.wake_workspace(workspace_id, label_set)

    return wake


def _on_paused(dispatcher: Dispatcher, demand: DemandBoard) -> Callable[[str], None]:
    """A pause changed (store/pauses.py): a paused runner's parked polls are answered, a resumed
    workspace's parked runners claim at once and its provisioners allocate at once, a drain or
    undrain changes what provisioners may bind (and a drained idle runner leaves its template's
    warm pool)."""

    def changed(payload: str) -> None:
        change = pauses.parse_change(payload)
        if change is None:
            return
        if change.kind is pauses.PauseKind.RUNNER and change.workspace_id is not None:
            dispatcher.runner_paused(change.workspace_id, change.target_id, change.paused)
        elif change.kind is pauses.PauseKind.WORKSPACE:
            # A paused workspace's jobs are no demand (store/demand_inputs.py): either way its
            # provisioners' rounds are due now, not at their next sweep or full round.
            demand.wake_workspace(change.target_id)
            if not change.paused:
                dispatcher.wake(change.target_id, None)
        elif change.kind is pauses.PauseKind.RUNNER_INSTANCE:
            demand.wake_all()

    return changed


def _on_cancel(cancels: CancelBoard, demand: DemandBoard) -> Callable[[str], None]:
    def wake(payload: str) -> None:
        cancels.notify(payload)
        # A cancelled lease on a provisioned runner is a terminate intent for its provisioner;
        # the payload names only the execution, so every local provisioner re-checks.
        demand.wake_all()

    return wake


async def serve(settings: Settings, *, on_ready: Callable[[str], None] | None = None) -> None:
    """Run the daemon until SIGTERM or SIGINT."""

    def ready(address: str) -> None:
        # What start-up built lives as long as the process: out of every later full collection.
        # With thousands of parked long-polls a full collection stalls the event loop (about
        # 150 ms of CPU each, a few a minute, as the polls turn over); frozen start-up objects
        # halved that in bench/installation's parked part (docs/benchmarks.md). Not in Daemon:
        # tests run many daemons in one process.
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            on_ready(address)

    async with database(settings) as url:
        daemon = Daemon(settings, url)
        await daemon.run(on_ready=ready, handle_signals=True)


class Daemon:
    """One replica. `run()` serves until `shutdown()` (or a signal, when asked to handle them)."""

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url
        self.address = ""
        self._stop = anyio.Event()
        self.replica: web_app.Replica | None = None  # once running

    def shutdown(self) -> None:
        self._stop.set()

    async def run(
        self, *, on_ready: Callable[[str], None] | None = None, handle_signals: bool = False
    ) -> None:
        settings = self.settings
        applied = await migrate(self.url, settings)
        if applied:
            log.info("migrations.applied", extra={"count": len(applied)})
        connection = pool_settings(settings, self.url)
        pool = await create_pool(connection)
        try:
            await self._serve(connection, pool, on_ready, handle_signals)
        finally:
            with anyio.CancelScope(shield=True):
                await pool.close()

    async def _serve(
        self,
        connection: PoolSettings,
        pool: asyncpg.Pool,
        on_ready: Callable[[str], None] | None,
        handle_signals: bool,
    ) -> None:
        settings = self.settings
        runners = settings.runners
        throttle = timedelta(seconds=runners.liveness_throttle_seconds)
        orderings = KnownOrderings()  # one belief per replica, for every claim path
        dispatcher = Dispatcher(
            PoolClaims(pool, throttle, orderings),
            tick_seconds=settings.maintenance.dispatch_safety_tick_seconds,
            idle_seconds=settings.maintenance.dispatch_actor_idle_seconds,
            # Parked runners are stamped every three throttle windows (30 s by default): well
            # inside the admin view's 60 s "seen recently", a third of the row writes.
            touch_seconds=3 * runners.liveness_throttle_seconds,
        )
        cancels = CancelBoard()
        keys = KeyRing(pool)
        await keys.load()
        # Told of new events by the listener (`cp_events`, rare events from any replica) and by
        # this replica's own claims and completions, which do not NOTIFY (store/events.py).
        feed = FeedWatch(
            pool,
            recheck_seconds=settings.events.recheck_seconds,
            held_per_key=settings.events.held_reads_per_key,
        )
        demand = DemandBoard()
        knobs = settings.provisioners
        sweep = DemandSweep(
            demand,
            PoolSweep(
                pool,
                timedelta(seconds=knobs.demand_activation_timeout_seconds),
                timedelta(seconds=knobs.active_window_seconds),
                knobs.demand_sweep_pending_cap,
            ),
            tick_seconds=knobs.demand_safety_tick_seconds,
            full_round_seconds=knobs.demand_full_round_seconds,
        )
        control = ControlSessions()
        last_seen = LastSeen(control, PoolSeen(pool), every=knobs.session_seen_batch_seconds)
        assignments = AssignmentBoard()
        pulse = Pulse()
        history = QueueHistory(
            pool,
            every_seconds=settings.pages.plot_sample_seconds,
            workspaces=settings.pages.list_limit,
        )

        def reconnected() -> None:
            dispatcher.paused.forget()
            dispatcher.wake_all()
            demand.resync()
            cancels.wake_all()
            feed.poke()

        listener = Listener(
            connection,
            {
                queue.ENQUEUED_CHANNEL: _on_enqueued(dispatcher, demand, pulse),
                CANCEL_CHANNEL: _on_cancel(cancels, demand),
                PAUSED_CHANNEL: _on_paused(dispatcher, demand),
                EVENTS_CHANNEL: lambda _payload: feed.poke(),
                TAKEOVER_CHANNEL: control.notify,
                reservations.ASSIGNED_CHANNEL: assignments.notify,
            },
            reconnected,
        )
        replica = web_app.Replica(
            settings=settings,
            pool=pool,
            auth=Authenticator(pool, keys, settings),
            keys=keys,
            dispatcher=dispatcher,
            cancels=cancels,
            feed=feed,
            probe=DatabaseProbe(
                pool,
                refresh_seconds=settings.health.refresh_seconds,
                deadline_seconds=settings.health.deadline_seconds,
            ),
            listener=listener,
            control=control,
            demand=demand,
            assignments=assignments,
            closing=anyio.Event(),
            pulse=pulse,
            history=history,
            orderings=orderings,
        )
        self.replica = replica
        maintain = settings.maintenance
        maintenance = Leadership(
            LeaderLock(connection),
            [
                LeaseReaper(
                    PoolReaperStore(pool),
                    rule=StaleRule(
                        threshold=timedelta(seconds=runners.stale_lease_threshold_seconds),
                        grace=timedelta(seconds=runners.no_first_heartbeat_grace_seconds),
                    ),
                    interval=maintain.reaper_interval_seconds,
                    limit=maintain.reaper_batch_limit,
                ),
                Deadlines(
                    PoolDeadlineStore(pool),
                    grace=timedelta(seconds=settings.queue.timeout_grace_seconds),
                    interval=maintain.reaper_interval_seconds,
                    limit=maintain.reaper_batch_limit,
                ),
                SessionCleanup(
                    PoolSessionStore(pool),
                    interval=maintain.session_gc_interval_seconds,
                    limit=maintain.session_gc_batch_size,
                    manual_retention=timedelta(days=runners.manual_session_retention_days),
                    capped_retention=timedelta(days=runners.capped_session_retention_days),
                ),
                Retention(
                    PoolRetentionStore(pool),
                    interval=maintain.retention_interval_seconds,
                    events=timedelta(days=maintain.event_retention_days),
                    tombstones=timedelta(days=maintain.tombstone_retention_days),
                    batch=maintain.retention_batch_size,
                ),
                ProvisioningUpkeep(
                    PoolUpkeepStore(pool),
                    interval=maintain.provisioning_interval_seconds,
                    stale_threshold=timedelta(
                        seconds=settings.provisioners.stale_runner_threshold_seconds
                    ),
                    reaper_limit=settings.provisioners.stale_runner_reaper_limit,
                    ephemeral_retention=timedelta(
                        days=settings.provisioners.ephemeral_token_retention_days
                    ),
                ),
            ],
        )
        server = http_server.build(web_app.build(replica), settings)
        sock = http_server.bind(settings.server.host, settings.server.port)
        host, port = sock.getsockname()[:2]
        self.address = f"http://{host}:{port}"

        async def stop_when_asked() -> None:
            await self._stop.wait()
            log.info("shutdown.requested")
            dispatcher.close()
            replica.close()
            server.exit()

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("signal.received", extra={"signal": int(signum)})
                    self.shutdown()
                    return

        async with anyio.create_task_group() as root:
            root.start_soon(stop_when_asked)
            if handle_signals:
                root.start_soon(stop_on_signal)
            await root.start(listener.run)
            await root.start(dispatcher.run)
            await root.start(feed.run)
            await root.start(history.run)
            await root.start(sweep.run)
            await root.start(last_seen.run)
            root.start_soon(maintenance.run)
            log.info("server.listening", extra={"address": self.address})
            if on_ready is not None:
                on_ready(self.address)
            await server.serve(sockets=[sock])
            root.cancel_scope.cancel()
        log.info("server.stopped")
