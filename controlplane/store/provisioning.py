"""One provisioner control session's view of the store: what its actor
(actors/provisioning/) asks the database, bound to the session's fencing generation.

The fence is checked here and nowhere else. Every transaction run for the session starts with
its fencing row (`provisioner_sessions.hold_fence`, FOR SHARE): a session superseded or revoked
meanwhile gets `errors.Fenced` and writes nothing, and a takeover or a revocation (both update
that row) waits for a write already holding it, which therefore commits under the generation
that checked it or not at all. The store functions called inside take their own locks after
it, in the global order of store/reservations.py; their docstrings name them.

Reads that change nothing (the workspaces with demand and their figures, outstanding grants,
warm-pool candidates) and the release of undelivered grants run unfenced, as a cleanup must
also work for a session that has just been superseded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypedDict
from uuid import UUID

from controlplane.domain.assignment import Batch
from controlplane.domain.binding import Scope
from controlplane.domain.demand import Reservation, Template
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Fence, Provisioner
from controlplane.domain.reports import ReconcileOutcome, ReportOutcome, RunnerEvent
from controlplane.domain.rounds import WalkEntry, WorkspaceRound
from controlplane.domain.runner_instances import ProvisionedRunner
from controlplane.errors import Fenced
from controlplane.store import (
    demand,
    demand_inputs,
    demand_list,
    ephemeral,
    lifecycle,
    reconcile,
    reservation_cleanup,
    reservations,
    runner_instances,
    runner_reports,
    walk_figures,
)
from controlplane.store.lifecycle import Assigned
from controlplane.store.pool import Conn, Pool
from controlplane.store.provisioner_sessions import fence, hold_fence, take_over


class Offer(TypedDict):
    """The advertisement's part of a round's terms, as every allocation read takes it."""

    templates: Sequence[Template]
    launch_ttl: timedelta
    activation_grace: timedelta


@dataclass(frozen=True, slots=True)
class RoundTerms:
    """What one allocation transaction is asked to allocate: the advertisement as it stands
    (templates, budget, launch lifetime) and the session's limits."""

    templates: tuple[Template, ...]
    max_reservations: int
    launch_ttl: timedelta
    activation_grace: timedelta
    activation_timeout: timedelta | None
    covering_window: timedelta | None
    fair_share: bool = False  # an installation walk caps each workspace at its even share

    @property
    def offer(self) -> Offer:
        return Offer(
            templates=self.templates,
            launch_ttl=self.launch_ttl,
            activation_grace=self.activation_grace,
        )


class SessionStore:
    """The `ProvisioningStore` of one control session (provisioner, generation) over a pool."""

    def __init__(self, pool: Pool, provisioner: Provisioner, generation: int) -> None:
        self.pool = pool
        self.provisioner = provisioner
        self.generation = generation

    @asynccontextmanager
    async def _fenced(self) -> AsyncIterator[Conn]:
        """A transaction whose first lock is this session's fencing row."""
        async with self.pool.acquire() as conn, conn.transaction():
            verdict = await hold_fence(conn, self.provisioner.id, self.generation)
            if verdict is not Fence.CURRENT:
                raise Fenced(verdict.value)
            yield conn

    async def ping(self) -> None:
        """Stamp the session's last-seen if it still holds its generation (one statement that
        writes and checks, no transaction); raises Fenced otherwise."""
        async with self.pool.acquire() as conn:
            verdict = await fence(conn, self.provisioner.id, self.generation)
        if verdict is not Fence.CURRENT:
            raise Fenced(verdict.value)

    async def replace_templates(self, templates: Sequence[Template]) -> None:
        async with self._fenced() as conn:
            await demand_inputs.replace_templates(
                conn, self.provisioner.id, self.provisioner.workspace_id, templates
            )

    async def allocate_workspace(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound:
        """A workspace provisioner's round: one transaction, the workspace lock waited for."""
        async with self._fenced() as conn:
            result = await demand.allocate_workspace(
                conn,
                provisioner_id=self.provisioner.id,
                scope=Scope.WORKSPACE,
                workspace_id=workspace_id,
                max_reservations=terms.max_reservations,
                activation_timeout=terms.activation_timeout,
                **terms.offer,
            )
        assert result is not None  # a blocking workspace lock: never skipped
        return result

    async def demand_workspaces(self) -> list[UUID]:
        """The workspaces with demand that this provisioner's eligibility admits (spec 3.5),
        read afresh by every walk: an operator's change applies from the next round on."""
        async with self.pool.acquire() as conn:
            return await demand_list.demand_workspaces(conn, provisioner_id=self.provisioner.id)

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]:
        """`demand_workspaces`, with `changed` listed whatever their age, and each workspace's
        reservation fingerprint, for a walk that skips what did not change
        (actors/provisioning/changes.py); prunes the summary rows of workspaces left without
        pending jobs, in a transaction of its own."""
        async with self.pool.acquire() as conn:
            entries, empty = await demand_list.walk_list(
                conn, provisioner_id=self.provisioner.id, changed=changed
            )
            await demand_list.prune_demand(conn, empty)
        return entries

    async def walk_figures(
        self, workspace_ids: Sequence[UUID], terms: RoundTerms
    ) -> list[WorkspaceRound]:
        """The demand figures of workspaces a walk can give nothing (store/walk_figures.py)."""
        async with self.pool.acquire() as conn:
            return await walk_figures.walk_figures(
                conn,
                provisioner_id=self.provisioner.id,
                workspace_ids=workspace_ids,
                covering_window=terms.covering_window,
                **terms.offer,
            )

    async def allocate_in_walk(
        self, workspace_id: UUID, terms: RoundTerms
    ) -> WorkspaceRound | None:
        """One workspace of an installation walk in its own transaction; None when busy."""
        async with self._fenced() as conn:
            return await demand.allocate_in_walk(
                conn,
                provisioner_id=self.provisioner.id,
                workspace_id=workspace_id,
                max_reservations=terms.max_reservations,
                covering_window=terms.covering_window,
                activation_timeout=terms.activation_timeout,
                **terms.offer,
            )

    async def outstanding_grants(self) -> list[tuple[Reservation, int]]:
        async with self.pool.acquire() as conn:
            return await reservations.outstanding_grants(conn, self.provisioner.id)

    async def idle_candidates(
        self,
    ) -> tuple[list[ProvisionedRunner], frozenset[UUID], datetime]:
        async with self.pool.acquire() as conn:
            return await reservations.idle_candidates(conn, self.provisioner.id)

    async def delete_reservations(self, reservation_ids: Collection[UUID]) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            return await reservation_cleanup.delete_reservations(conn, reservation_ids)

    async def create_instances(
        self,
        provider_kind: str | None,
        entries: Sequence[tuple[str | None, UUID | None]],
        bootstrap_ttl: timedelta,
    ) -> Batch:
        async with self._fenced() as conn:
            return await runner_instances.create_batch(
                conn,
                self.provisioner.id,
                provider_kind=provider_kind,
                entries=entries,
                bootstrap_ttl=bootstrap_ttl,
            )

    async def attach_provider(self, runner_instance_id: UUID, provider_runner_id: str) -> bool:
        async with self._fenced() as conn:
            return await runner_instances.attach_provider_runner(
                conn, self.provisioner.id, runner_instance_id, provider_runner_id
            )

    async def assign(self, reservation_id: UUID, runner_instance_ids: Sequence[UUID]) -> Assigned:
        """The assignment, and in the same transaction the lags of the instances it assigned
        (a plain read of the rows the assignment already locked: no lock of its own)."""
        async with self._fenced() as conn:
            ids = await runner_instances.assign(
                conn, self.provisioner.id, reservation_id, runner_instance_ids
            )
            return Assigned(ids, await lifecycle.assignment_lags(conn, ids, this_transaction=True))

    async def instance_counts(self) -> dict[tuple[str, str], int]:
        async with self.pool.acquire() as conn:
            return await lifecycle.instance_counts(conn, self.provisioner.id)

    async def report(
        self,
        events: Sequence[RunnerEvent],
        *,
        received_at: datetime,
        reserved_labels: LabelSet,
        activation_timeout: timedelta,
    ) -> ReportOutcome:
        async with self._fenced() as conn:
            return await runner_reports.report(
                conn,
                self.provisioner,
                events,
                received_at=received_at,
                reserved_labels=reserved_labels,
                activation_timeout=activation_timeout,
            )

    async def reconcile(self, observed: Sequence[str], *, grace: timedelta) -> ReconcileOutcome:
        async with self._fenced() as conn:
            return await reconcile.reconcile(
                conn, self.provisioner, observed, grace=grace, include_intended=True
            )

    async def mint(
        self, provider_runner_ids: Sequence[str], reservation_id: UUID | None, ttl: timedelta
    ) -> list[ephemeral.MintedToken]:
        async with self._fenced() as conn:
            return await ephemeral.mint(
                conn,
                provisioner_id=self.provisioner.id,
                workspace_id=self.provisioner.workspace_id,
                provider_runner_ids=provider_runner_ids,
                ttl=ttl,
                reservation_id=reservation_id,
            )


async def open_session(
    pool: Pool, provisioner: Provisioner, session_id: UUID
) -> SessionStore | None:
    """Take the provisioner's session over cluster-wide (`provisioner_sessions.take_over`: a
    new generation, NOTIFYed to every replica); None when its token was revoked meanwhile."""
    async with pool.acquire() as conn:
        generation = await take_over(conn, provisioner.id, session_id)
    return None if generation is None else SessionStore(pool, provisioner, generation)
