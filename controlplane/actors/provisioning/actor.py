"""The provisioner actor: one per live control session, on the replica holding its WebSocket.

It answers every request of its session (advertise, create, attach, assign, report, reconcile,
mint, ping) through the session's `ProvisioningStore`, whose every write holds the session's
fencing row first, and returns domain values; the web layer decodes the requests and encodes
the answers. It owns the provisioner's current advertisement (templates, max reservations,
launch TTL) and runs allocation rounds (rounds.py) in its own task, one at a time, so the
rounds of one provisioner never interleave. A round runs when:

* the provisioner advertises (always followed by a `demand` push);
* a job is enqueued in a workspace it serves (NOTIFY `cp_enqueued`, via `DemandBoard`);
* it reported or reconciled runners, which may have released units;
* the replica's demand sweep (sweep.py) saw the figures its rounds read move without a
  notification (a claim on another replica, another provisioner's reservation expiring, ...);
* a deadline it knows of falls due: a reservation it granted or bound expires (round time plus
  the launch lifetime or the activation grace), an instance it created reaches the activation
  timeout, a grant outstanding at hello expires, a warm launch it pushed stops counting;
* the replica's slow full round (sweep.py, every `provisioners.demand_full_round_seconds`)
  finds something a round could act on (`full_round`): the safety net under all of the above.

Between those it sleeps and costs the database nothing, with no timer of its own for the safety
net; whether its own state calls for the full round (`holds_work`) it says reading nothing.

An installation provisioner's walk leaves out the workspaces that were covered and have not
changed since (changes.py): `demand_changed` marks one, `resync` (an advertisement, a
reconnected listener) and `provisioners.demand_full_walk_seconds` walk them all.

After a round the actor pushes demand (`send`) when it has something new to say: grants, warm
launches, terminate intents that changed, or demand figures that changed. If the push fails
(the socket is gone), the grants it carried are deleted again, so demand no provisioner heard of
is not held for a reservation lifetime. Grants that were delivered stay until they are used or
expire; a provisioner that reconnects finds them in `welcome.outstanding` (`outstanding`).

A session that lost its generation raises `errors.Fenced`, from a request or from a round; the
round loop then ends, and the session closes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import anyio

from controlplane import metrics
from controlplane.actors.provisioning.changes import WalkMemory
from controlplane.actors.provisioning.rounds import (
    ProvisioningStore,
    RoundOutcome,
    WorkspaceDemand,
    grant_of,
    installation_walk,
    workspace_round,
)
from controlplane.domain.assignment import Batch
from controlplane.domain.binding import Scope
from controlplane.domain.demand import (
    ReservationKind,
    Template,
    WarmLaunch,
    advertised_templates,
    reservation_ttl,
    warm_pool_launches,
)
from controlplane.domain.divergence import divergences
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.reports import ReconcileOutcome, ReportOutcome, RunnerEvent
from controlplane.domain.rounds import Grant
from controlplane.errors import Fenced, InvalidInput, RunnerNotAssignable
from controlplane.store.control_sessions import PROMOTION_FAILURES
from controlplane.store.ephemeral import MintedToken
from controlplane.store.provisioning import RoundTerms

log = logging.getLogger("controlplane.provisioning")
minted_log = logging.getLogger("controlplane.ephemeral")


@dataclass(frozen=True, slots=True)
class Advertisement:
    templates: tuple[Template, ...]
    max_reservations: int
    launch_ttl: timedelta


@dataclass(frozen=True, slots=True)
class Limits:
    """The session's settings (`provisioners.*`), read once when it opens."""

    activation_grace: timedelta
    activation_timeout: timedelta
    covering_window: timedelta
    reservation_ttl_seconds: int  # a launch grant's lifetime when the advertisement names none
    reservation_ttl_max_seconds: int
    bootstrap_ttl: timedelta
    reconcile_grace: timedelta
    ephemeral_ttl: timedelta
    reserved_labels: LabelSet
    installation_fair_share: bool = False  # an installation walk shares slots across workspaces
    full_walk_seconds: float = 60.0  # an installation walk visits every workspace this often
    divergence_by_template: bool = False  # label count divergence with the template key


@dataclass(frozen=True, slots=True)
class DemandPush:
    """One `demand` message: what a round has to tell the provisioner."""

    seq: int
    stats: list[WorkspaceDemand]
    grants: list[Grant]
    warm: list[WarmLaunch]
    newly_reserved: int
    terminate: list[str]  # provider runner ids, sorted


Send = Callable[[DemandPush], Awaitable[None]]


class ProvisionerActor:
    def __init__(
        self,
        store: ProvisioningStore,
        provisioner: Provisioner,
        limits: Limits,
        send: Send,
        clock: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.provisioner = provisioner
        self._scope = Scope(provisioner.scope)
        self.limits = limits
        self._send = send
        self._clock = clock
        self._advertisement: Advertisement | None = None
        self._fresh_advertisement = False
        self._wake = anyio.Event()  # set by a wake-up, or by a new deadline (to re-plan)
        self._woken = False  # a wake-up since the last round started
        self._full = False  # the wake-up was the replica's full round (sweep.py)
        self._seq = 0
        self._last_stats: list[WorkspaceDemand] | None = None
        self._last_terminate: list[str] = []
        # Warm launches pushed whose instances have not been created yet, per template, with
        # the time they stop counting (the provisioner may have ignored them).
        self._warm_pending: dict[str, list[float]] = {}
        # Monotonic times at which a round may find something new with nobody waking the actor
        # (reservations it made expiring, instances it created timing out).
        self._deadlines: list[float] = []
        self._walks = WalkMemory(limits.full_walk_seconds)  # installation scope only
        # Rounds begun so far, the last when: the demand sweep skips waking an actor that began
        # one after its read (that round read everything the sweep saw), or lately (sweep.py).
        self.rounds_begun, self.round_began_at = 0, float("-inf")

    @property
    def scope(self) -> Scope:
        return self._scope

    def serves(self, workspace_id: UUID) -> bool:
        return self.scope is Scope.INSTALLATION or self.provisioner.workspace_id == workspace_id

    def wake(self) -> None:
        self._woken = True
        self._wake.set()

    def full_round(self) -> None:
        """The replica's slow full round found something this session's round could act on."""
        self._full = True
        self.wake()

    @property
    def holds_work(self) -> bool:
        """Whether its own state calls for the full round, the database aside: its last push
        told of demand or terminate intents, or it keeps a warm pool (idle targets, warm launches
        out). Never before an advertisement: a round then does nothing."""
        ad, warm = self._advertisement, any(self._warm_pending.values())
        held = bool(self._last_stats or self._last_terminate or warm)
        return ad is not None and (held or any(t.idle_target for t in ad.templates))

    def demand_changed(self, workspace_id: UUID) -> None:
        """A workspace's demand may have grown: walk it next round (and wake)."""
        self._walks.changed(workspace_id)
        self.wake()

    def resync(self) -> None:
        """Notifications may have been lost: walk every workspace next round (and wake)."""
        self._walks.resync()
        self.wake()

    # --- requests ------------------------------------------------------------------------------

    async def ping(self) -> None:
        """Stamp the session's last-seen; raises Fenced when it lost its generation (asked when
        a session was superseded, for its close code; a wire `ping` is batched instead)."""
        await self.store.ping()

    async def outstanding(self) -> list[Grant]:
        """The launch units granted earlier and not launched yet (`welcome.outstanding`)."""
        grants = [grant_of(r, pending) for r, pending in await self.store.outstanding_grants()]
        now, now_mono = self._clock(), anyio.current_time()
        for grant in grants:  # their expiry makes demand again: a round is due then
            self._deadlines.append(now_mono + (grant.expires_at - now).total_seconds())
        return grants

    async def advertise(
        self, ads: Sequence[Template], max_reservations: int, reservation_ttl_seconds: int | None
    ) -> int:
        """Store the templates and run a round; the number of templates kept. The round is woken
        after the last await, so its push cannot overtake the answer (the protocol's order)."""
        templates = advertised_templates(self.provisioner.scope, ads, self.limits.reserved_labels)
        await self.store.replace_templates(templates)
        await self._count_divergence(ads)
        ttl = reservation_ttl(
            reservation_ttl_seconds,
            default_seconds=self.limits.reservation_ttl_seconds,
            ceiling_seconds=self.limits.reservation_ttl_max_seconds,
        )
        self._advertisement = Advertisement(templates, max_reservations, ttl)
        self._fresh_advertisement = True
        self.resync()  # new templates: what was covered may not be
        return len(templates)

    async def _count_divergence(self, ads: Sequence[Template]) -> None:
        """Compare the advertised counts with the stored instances, once per advertisement
        (spec 3.7). A metric: a failed read is logged and never fails the advertisement."""
        try:
            stored = await self.store.instance_counts()
        except Exception as error:
            log.warning("provisioner.divergence_read_failed", extra={"error": repr(error)})
            return
        for found in divergences(ads, stored):
            key = metrics.template_label(found.template_key)
            metrics.count_divergence.labels(
                found.state, found.direction, key if self.limits.divergence_by_template else ""
            ).inc(found.delta)
            log.debug(
                "provisioner.count_divergence",
                extra={
                    "provisioner_id": str(self.provisioner.id),
                    "template_key": found.template_key,
                    "state": found.state,
                    "direction": found.direction,
                    "delta": found.delta,
                },
            )

    async def create_instances(
        self, provider_kind: str | None, entries: Sequence[tuple[str | None, UUID | None]]
    ) -> Batch:
        """Create instances for (template key, reservation id) entries; warm ones (no
        reservation) take the place of pushed warm launches."""
        batch = await self.store.create_instances(provider_kind, entries, self.limits.bootstrap_ttl)
        if any(reservation_id is not None for _, reservation_id in entries):
            # A demand launch that never activates is timed out from its creation on.
            self._after(self.limits.activation_timeout)
        for reason, units in batch.capacity_failures.items():
            metrics.capacity_failures.labels(reason).inc(units)
        self._warm_created(
            entries[c.request_index][0]
            for c in batch.instances
            if entries[c.request_index][1] is None
        )
        return batch

    async def attach_provider(self, runner_instance_id: UUID, provider_runner_id: str) -> bool:
        return await self.store.attach_provider(runner_instance_id, provider_runner_id)

    async def assign(self, reservation_id: UUID, runner_instance_ids: Sequence[UUID]) -> list[UUID]:
        if len(set(runner_instance_ids)) != len(runner_instance_ids):
            raise InvalidInput("runner_instance_ids must be unique")
        try:
            assigned = await self.store.assign(reservation_id, runner_instance_ids)
        except PROMOTION_FAILURES as error:
            reason = error.reason if isinstance(error, RunnerNotAssignable) else error.code
            metrics.assignments_rejected.labels(reason, "provisioner").inc()
            raise
        for lag in assigned.lags:
            metrics.observe_seconds(
                metrics.control_session_to_assignment,
                lag.seconds,
                metrics.provider_label(lag.provider_kind),
                lag.launch_kind,
                "provisioner",
            )
        return assigned.runner_instance_ids

    async def report(self, events: Sequence[RunnerEvent]) -> ReportOutcome:
        received_at = self._clock()
        outcome = await self.store.report(
            events,
            received_at=received_at,
            reserved_labels=self.limits.reserved_labels,
            activation_timeout=self.limits.activation_timeout,
        )
        for event in events:
            metrics.runner_reports.labels(event.state.value).inc()
        metrics.units_released.labels("report").inc(outcome.reservations_released)
        for honored in outcome.terminate_intents_honored:
            metrics.terminate_intents_honored.labels(honored.reason).inc()
        self.wake()  # released units are demand again
        return outcome

    async def reconcile(self, observed: Sequence[str]) -> ReconcileOutcome:
        if len(set(observed)) != len(observed):
            raise InvalidInput("observed_provider_runner_ids must be unique")
        result = await self.store.reconcile(observed, grace=self.limits.reconcile_grace)
        metrics.reconciles.inc()
        metrics.absent_terminated.inc(len(result.terminated_absent_provider_runner_ids))
        metrics.units_released.labels("reconcile").inc(result.reservations_released)
        for runner in result.runners:
            if runner.desired_intent == "terminate":
                reason = runner.intent_reason or "unknown"
                metrics.terminate_intents_issued.labels("reconcile", reason).inc()
        self.wake()
        return result

    async def mint(
        self, provider_runner_ids: Sequence[str], reservation_id: UUID | None
    ) -> list[MintedToken]:
        """Ephemeral registration tokens, one per provider runner id, all or none. Refusals
        (nothing minted): `validation-error` (duplicate ids; an installation provisioner
        without `reservation_id`), `reservation-not-found`, `reservation-expired`,
        `reservation-capacity-exhausted`, `ephemeral-token-active`."""
        if len(set(provider_runner_ids)) != len(provider_runner_ids):
            raise InvalidInput("provider_runner_ids must be unique")
        if reservation_id is None and self.provisioner.workspace_id is None:
            raise InvalidInput("an installation provisioner must name the reservation_id")
        minted = await self.store.mint(
            provider_runner_ids, reservation_id, self.limits.ephemeral_ttl
        )
        minted_log.info(
            "ephemeral.minted",
            extra={
                "provisioner_id": str(self.provisioner.id),
                "reservation_id": None if reservation_id is None else str(reservation_id),
                "count": len(minted),
            },
        )
        return minted

    def _warm_created(self, template_keys: Iterable[str | None]) -> None:
        """Instances created without a reservation take the place of pushed warm launches."""
        for key in template_keys:
            pending = self._warm_pending.get(key or "")
            if pending:
                pending.pop(0)

    # --- rounds --------------------------------------------------------------------------------

    def _after(self, delay: timedelta) -> None:
        """A round is due `delay` from now (measured after the write that started the clock,
        so never before the database's own deadline); a sleep in progress re-plans."""
        self._deadlines.append(anyio.current_time() + delay.total_seconds())
        self._wake.set()

    def next_deadline(self) -> float | None:
        """The earliest monotonic time a known deadline (or a pushed warm launch's expiry)
        makes a round due, if any."""
        warm = [d for deadlines in self._warm_pending.values() for d in deadlines]
        return min(self._deadlines + warm, default=None)

    async def _sleep(self) -> str:
        """Until woken or a deadline; what ended the sleep (`fallback`: woken by the full round)."""
        while True:
            due = self.next_deadline()
            wait = None if due is None else max(0.0, due - anyio.current_time())
            with anyio.move_on_after(wait):
                await self._wake.wait()
            if self._woken:
                return "fallback" if self._full else "wake"
            if not self._wake.is_set():
                return "deadline"
            self._wake = anyio.Event()  # a deadline was added: plan again

    async def run(self) -> None:
        """Rounds until cancelled; raises Fenced when the session lost its generation."""
        with metrics.control_sessions.track_inprogress():
            while True:
                trigger = await self._sleep()
                self._wake, self._woken, self._full = anyio.Event(), False, False
                started = anyio.current_time()
                # Deadlines passed by now are seen by the round that starts now.
                self._deadlines = [d for d in self._deadlines if d > started]
                for key, deadlines in list(self._warm_pending.items()):
                    self._warm_pending[key] = [d for d in deadlines if d > started]
                advertisement = self._advertisement
                if advertisement is None:
                    continue
                metrics.allocation_triggers.labels(trigger).inc()
                self.rounds_begun, self.round_began_at = self.rounds_begun + 1, started
                fresh, self._fresh_advertisement = self._fresh_advertisement, False
                outcome = await self._measured_round(advertisement)
                self._expect(outcome, advertisement.launch_ttl)
                await self._maybe_push(outcome, advertisement, force=fresh)

    def _expect(self, outcome: RoundOutcome, launch_ttl: timedelta) -> None:
        """The deadlines the round's own reservations set: a launch grant that is not used,
        or a bound runner that does not activate, expires and is demand again."""
        kinds = {new.kind for r in outcome.rounds for new in r.allocation.reservations}
        if ReservationKind.LAUNCH in kinds:
            self._after(launch_ttl)
        if ReservationKind.BOUND in kinds:
            self._after(self.limits.activation_grace)

    async def _measured_round(self, advertisement: Advertisement) -> RoundOutcome:
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

    async def _round(self, advertisement: Advertisement) -> RoundOutcome:
        terms = RoundTerms(
            templates=advertisement.templates,
            max_reservations=advertisement.max_reservations,
            launch_ttl=advertisement.launch_ttl,
            activation_grace=self.limits.activation_grace,
            activation_timeout=self.limits.activation_timeout,
            covering_window=self.limits.covering_window,
            fair_share=self.limits.installation_fair_share,
        )
        if self.scope is Scope.WORKSPACE:
            assert self.provisioner.workspace_id is not None
            return await workspace_round(self.store, self.provisioner.workspace_id, terms)
        outcome = RoundOutcome(remaining=advertisement.templates)
        await installation_walk(self.store, terms, outcome, self._walks, anyio.current_time())
        return outcome

    async def _warm(self, advertisement: Advertisement, outcome: RoundOutcome) -> list[WarmLaunch]:
        if not any(t.idle_target for t in advertisement.templates):
            return []
        now_mono = anyio.current_time()
        for key, deadlines in list(self._warm_pending.items()):
            self._warm_pending[key] = [d for d in deadlines if d > now_mono]
        runners, live, now = await self.store.idle_candidates()
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
        return list(launches)

    async def _maybe_push(
        self, outcome: RoundOutcome, advertisement: Advertisement, *, force: bool
    ) -> None:
        warm = await self._warm(advertisement, outcome)
        terminate = sorted(set(outcome.terminate))
        stats, grants = outcome.stats, outcome.grants
        changed = (
            force
            or grants
            or warm
            or outcome.newly_reserved
            or terminate != self._last_terminate
            or stats != self._last_stats
        )
        if not changed:
            return
        self._seq += 1
        message = DemandPush(self._seq, stats, grants, warm, outcome.newly_reserved, terminate)
        try:
            await self._send(message)
        except BaseException:
            metrics.demand_pushes.labels("failed").inc()
            # Never delivered: give the demand back rather than hold it for a lifetime.
            if grants:
                with anyio.CancelScope(shield=True):
                    await self._forget([g.reservation_id for g in grants])
            raise
        metrics.demand_pushes.labels("sent").inc()
        reasons = outcome.intent_reasons
        for runner_id in set(terminate) - set(self._last_terminate):
            metrics.terminate_intents_issued.labels(
                "demand", reasons.get(runner_id, "unknown")
            ).inc()
        self._last_stats = stats
        self._last_terminate = terminate

    async def _forget(self, reservation_ids: list[UUID]) -> None:
        try:
            await self.store.delete_reservations(reservation_ids)
        except Exception:
            log.exception(
                "provisioning.grant_release_failed",
                extra={"provisioner_id": str(self.provisioner.id), "count": len(reservation_ids)},
            )
