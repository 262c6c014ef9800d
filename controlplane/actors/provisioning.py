"""The provisioner actor: one per live control session, on the replica holding its WebSocket.

It owns the provisioner's current advertisement (templates, max reservations, launch TTL) and
runs allocation rounds one at a time, so the rounds of one provisioner never interleave. A round
runs when:

* the provisioner advertises (always followed by a `demand` push);
* a job is enqueued in a workspace it serves (NOTIFY `cp_enqueued`, via `DemandBoard`);
* it reported or reconciled runners, which may have released units;
* the safety tick passes (`provisioners.demand_safety_tick_seconds`): reservations expire and
  notifications can be lost, and both only show on a re-read.

A round for one workspace is one transaction. Its first lock is the control session's fencing
row (`provisioner_sessions.hold_fence`, FOR SHARE), then the workspace advisory lock and the rest
of the global order (store/reservations.py). The workspace lock serialises allocation for that
workspace across every provisioner and replica; the fencing lock makes a superseded session's
round commit before the takeover or not at all. An installation provisioner walks the workspaces
with demand, oldest first, one transaction each, try-locking (a busy workspace waits for the next
round), carrying its budget from one workspace to the next; its slots for each workspace are the
advertised ones minus its launch units still pending in every other workspace, read fresh in that
workspace's transaction (so a busy, skipped workspace still holds what it was granted).

After a round the actor pushes a `demand` message when it has something new to say: grants,
warm launches, terminate intents that changed, or demand figures that changed. If the push fails
(the socket is gone), the grants it carried are deleted again, so demand no provisioner heard of
is not held for a reservation lifetime. Grants that were delivered stay until they are used or
expire; a provisioner that reconnects finds them in `welcome.outstanding`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg

from controlplane import metrics
from controlplane.domain.binding import Scope
from controlplane.domain.demand import Template, warm_pool_launches
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Fence, Provisioner
from controlplane.domain.rounds import WorkspaceRound
from controlplane.domain.terminate_intents import TerminateReason
from controlplane.store import demand, reservation_cleanup, reservations
from controlplane.store.pool import Conn
from controlplane.store.provisioner_sessions import hold_fence
from controlplane.wire import control as wire

log = logging.getLogger("controlplane.provisioning")


class Fenced(Exception):
    """The session lost its generation (takeover, revocation, expiry) during a round."""

    def __init__(self, verdict: Fence) -> None:
        super().__init__(verdict.value)
        self.verdict = verdict


@dataclass(frozen=True, slots=True)
class Advertisement:
    templates: tuple[Template, ...]
    max_reservations: int
    launch_ttl: timedelta


@dataclass(frozen=True, slots=True)
class Limits:
    activation_grace: timedelta
    activation_timeout: timedelta
    covering_window: timedelta
    tick_seconds: float


@dataclass
class _Outcome:
    stats: list[wire.DemandStat] = field(default_factory=list)
    grants: list[wire.Grant] = field(default_factory=list)
    terminate: list[str] = field(default_factory=list)
    intent_reasons: dict[str, str] = field(default_factory=dict)  # provider runner id -> reason
    newly_reserved: int = 0
    remaining: tuple[Template, ...] = ()
    bound_ids: frozenset[UUID] = frozenset()


Send = Callable[[wire.Demand], Awaitable[None]]


class ProvisionerActor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        provisioner: Provisioner,
        generation: int,
        limits: Limits,
        send: Send,
    ) -> None:
        self.pool = pool
        self.provisioner = provisioner
        self.generation = generation
        self.limits = limits
        self._send = send
        self._advertisement: Advertisement | None = None
        self._fresh_advertisement = False
        self._wake = anyio.Event()
        self._seq = 0
        self._last_stats: list[wire.DemandStat] | None = None
        self._last_terminate: list[str] = []
        # Warm launches pushed whose instances have not been created yet, per template, with
        # the time they stop counting (the provisioner may have ignored them).
        self._warm_pending: dict[str, list[float]] = {}

    @property
    def scope(self) -> Scope:
        return Scope(self.provisioner.scope)

    def serves(self, workspace_id: UUID) -> bool:
        return self.scope is Scope.INSTALLATION or self.provisioner.workspace_id == workspace_id

    def advertise(self, advertisement: Advertisement) -> None:
        self._advertisement = advertisement
        self._fresh_advertisement = True
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def warm_created(self, template_keys: Iterable[str | None]) -> None:
        """Instances created without a reservation take the place of pushed warm launches."""
        for key in template_keys:
            pending = self._warm_pending.get(key or "")
            if pending:
                pending.pop(0)

    async def run(self) -> None:
        """Rounds until cancelled; raises Fenced when the session lost its generation."""
        with metrics.control_sessions.track_inprogress():
            while True:
                with anyio.move_on_after(self.limits.tick_seconds):
                    await self._wake.wait()
                self._wake = anyio.Event()
                advertisement = self._advertisement
                if advertisement is None:
                    continue
                fresh, self._fresh_advertisement = self._fresh_advertisement, False
                outcome = await self._measured_round(advertisement)
                await self._maybe_push(outcome, advertisement, force=fresh)

    async def _measured_round(self, advertisement: Advertisement) -> _Outcome:
        started = anyio.current_time()
        try:
            outcome = await self._round(advertisement)
        except Fenced:
            metrics.allocation_rounds.labels("fenced").inc()
            raise
        except Exception:
            metrics.allocation_rounds.labels("error").inc()
            raise
        metrics.allocation_rounds.labels("ok").inc()
        metrics.allocation_seconds.observe(anyio.current_time() - started)
        return outcome

    async def _round(self, advertisement: Advertisement) -> _Outcome:
        outcome = _Outcome(remaining=advertisement.templates)
        if self.scope is Scope.WORKSPACE:
            assert self.provisioner.workspace_id is not None
            await self._workspace_round(outcome, advertisement, self.provisioner.workspace_id)
            return outcome

        async def record(result: WorkspaceRound) -> None:
            self._record(outcome, result)

        walk = await demand.allocate_installation(
            self.pool,
            provisioner_id=self.provisioner.id,
            templates=advertisement.templates,
            max_reservations=advertisement.max_reservations,
            launch_ttl=advertisement.launch_ttl,
            activation_grace=self.limits.activation_grace,
            covering_window=self.limits.covering_window,
            activation_timeout=self.limits.activation_timeout,
            fence=self._fence,
            on_round=record,
        )
        outcome.remaining = walk.remaining_templates
        return outcome

    async def _fence(self, conn: Conn) -> None:
        """The first lock of every round's transaction: this session's generation, FOR SHARE."""
        verdict = await hold_fence(conn, self.provisioner.id, self.generation)
        if verdict is not Fence.CURRENT:
            raise Fenced(verdict)

    async def _workspace_round(
        self, outcome: _Outcome, advertisement: Advertisement, workspace_id: UUID
    ) -> None:
        """A workspace provisioner's round: one fenced allocation transaction."""
        async with self.pool.acquire() as conn, conn.transaction():
            await self._fence(conn)
            result = await demand.allocate_workspace(
                conn,
                provisioner_id=self.provisioner.id,
                scope=self.scope,
                workspace_id=workspace_id,
                templates=advertisement.templates,
                max_reservations=advertisement.max_reservations,
                launch_ttl=advertisement.launch_ttl,
                activation_grace=self.limits.activation_grace,
                activation_timeout=self.limits.activation_timeout,
            )
        assert result is not None  # a blocking workspace lock: never skipped
        self._record(outcome, result)
        outcome.remaining = result.allocation.remaining_templates

    def _record(self, outcome: _Outcome, result: WorkspaceRound) -> None:
        """Add one committed workspace round to what this round will push."""
        workspace_id = result.workspace_id
        allocation = result.allocation
        outcome.bound_ids = outcome.bound_ids | allocation.bound_runner_ids
        outcome.newly_reserved += allocation.newly_reserved
        outcome.stats.extend(
            wire.DemandStat(
                workspace_id=workspace_id,
                labels=list(stat.labels),
                queued=stat.queued,
                reserved=stat.reserved,
                oldest_queued_at=stat.oldest_queued_at,
            )
            for stat in allocation.stats
        )
        outcome.grants.extend(
            wire.Grant(
                reservation_id=grant.reservation_id,
                workspace_id=grant.workspace_id,
                labels=list(grant.labels),
                count=grant.count,
                expires_at=grant.expires_at,
            )
            for grant in result.grants
        )
        outcome.terminate.extend(intent.provider_runner_id for intent in result.terminate_intents)
        outcome.intent_reasons.update(
            (intent.provider_runner_id, intent.reason.value) for intent in result.terminate_intents
        )
        metrics.activation_outcomes.labels("rebound").inc(result.rebound)
        reaped = sum(
            1
            for intent in result.terminate_intents
            if intent.reason is TerminateReason.ACTIVATION_TIMEOUT and not intent.retry
        )
        metrics.activation_outcomes.labels("reaped").inc(reaped)

    async def _warm(self, advertisement: Advertisement, outcome: _Outcome) -> list[wire.WarmLaunch]:
        if not any(t.idle_target for t in advertisement.templates):
            return []
        now_mono = anyio.current_time()
        for key, deadlines in list(self._warm_pending.items()):
            self._warm_pending[key] = [d for d in deadlines if d > now_mono]
        async with self.pool.acquire() as conn:
            runners, live, now = await reservations.idle_candidates(conn, self.provisioner.id)
        launches = warm_pool_launches(
            outcome.remaining,
            runners,
            live=live,
            now=now,
            just_bound=outcome.bound_ids,
            unacknowledged={k: len(v) for k, v in self._warm_pending.items()},
        )
        expiry = now_mono + advertisement.launch_ttl.total_seconds()
        for launch in launches:
            self._warm_pending.setdefault(launch.template_key, []).extend([expiry] * launch.count)
        return [
            wire.WarmLaunch(template_key=w.template_key, labels=list(w.labels), count=w.count)
            for w in launches
        ]

    async def _maybe_push(
        self, outcome: _Outcome, advertisement: Advertisement, *, force: bool
    ) -> None:
        warm = await self._warm(advertisement, outcome)
        terminate = sorted(set(outcome.terminate))
        changed = (
            force
            or outcome.grants
            or warm
            or outcome.newly_reserved
            or terminate != self._last_terminate
            or outcome.stats != self._last_stats
        )
        if not changed:
            return
        self._seq += 1
        message = wire.Demand(
            seq=self._seq,
            stats=outcome.stats,
            grants=outcome.grants,
            warm=warm,
            newly_reserved=outcome.newly_reserved,
            terminate_provider_runner_ids=terminate,
        )
        try:
            await self._send(message)
        except BaseException:
            metrics.demand_pushes.labels("failed").inc()
            # Never delivered: give the demand back rather than hold it for a lifetime.
            if outcome.grants:
                with anyio.CancelScope(shield=True):
                    await self._forget([g.reservation_id for g in outcome.grants])
            raise
        metrics.demand_pushes.labels("sent").inc()
        for runner_id in set(terminate) - set(self._last_terminate):
            reason = outcome.intent_reasons.get(runner_id, "unknown")
            metrics.terminate_intents_issued.labels("demand", reason).inc()
        self._last_stats = outcome.stats
        self._last_terminate = terminate

    async def _forget(self, reservation_ids: list[UUID]) -> None:
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await reservation_cleanup.delete_reservations(conn, reservation_ids)
        except Exception:
            log.exception(
                "provisioning.grant_release_failed",
                extra={"provisioner_id": str(self.provisioner.id), "count": len(reservation_ids)},
            )


class DemandBoard:
    """The provisioner actors on this replica, woken when a workspace's demand may have grown.
    Synchronous: the listener's callbacks run on the same event loop as the actors."""

    def __init__(self) -> None:
        self._actors: set[ProvisionerActor] = set()

    def add(self, actor: ProvisionerActor) -> None:
        self._actors.add(actor)

    def remove(self, actor: ProvisionerActor) -> None:
        self._actors.discard(actor)

    def __len__(self) -> int:
        return len(self._actors)

    def wake_workspace(self, workspace_id: UUID, labels: LabelSet | None = None) -> None:
        del labels  # every template may match some label set; the round decides
        for actor in self._actors:
            if actor.serves(workspace_id):
                actor.wake()

    def wake_all(self) -> None:
        for actor in self._actors:
            actor.wake()
