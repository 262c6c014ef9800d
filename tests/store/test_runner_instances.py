"""Runner instances and their boot path against a real PostgreSQL (spec 4.1-4.7, 4.14)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain import tokens
from controlplane.domain.control_sessions import ControlSession, Enrollment
from controlplane.errors import (
    BootstrapTokenInvalid,
    ControlSessionInvalid,
    ProviderRunnerIdTaken,
    ReservationExpired,
    ReservationNotFound,
    RunnerNotAssignable,
    Unauthorized,
)
from controlplane.store import activations, control_sessions, locks, runner_instances
from controlplane.store.pool import Conn
from tests import provisioning
from tests.factories import holding_lock, wait_until_blocked

TTL = timedelta(minutes=5)


open_control_session = provisioning.open_control_session
make_runner = provisioning.runner


async def _session(conn: Conn, runner_id: UUID, provisioner_id: UUID) -> ControlSession:
    raw = await open_control_session(conn, runner_id, provisioner_id)
    found = await control_sessions.control_session_by_digest(conn, tokens.digest(raw))
    assert found is not None
    return found


async def _enroll(
    conn: Conn, session: ControlSession, labels: tuple[str, ...] = ("linux",)
) -> Enrollment:
    return await control_sessions.enroll(
        conn,
        session,
        labels=labels,
        capabilities=None,
        provider_kind="docker",
        protocol_version="1",
        activation_ttl=TTL,
    )


async def _row(conn: Conn, runner_id: UUID) -> asyncpg.Record:
    row = await conn.fetchrow("SELECT * FROM runner_instances WHERE id = $1", runner_id)
    assert row is not None
    return row


async def _count(conn: Conn, reservation_id: UUID) -> int | None:
    value = await conn.fetchval("SELECT count FROM reservations WHERE id = $1", reservation_id)
    return None if value is None else int(value)


# ------------------------------------------------------------------------------------ batch


async def test_p115_batch_stores_hashed_one_use_bootstrap_tokens(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id, count=2)
    batch = await runner_instances.create_batch(
        conn, p.id, provider_kind="docker", entries=[("small", r), (None, None)], bootstrap_ttl=TTL
    )
    assert [c.request_index for c in batch.instances] == [0, 1]
    assert not batch.reservation_unavailable
    rows = await conn.fetch(
        "SELECT * FROM runner_bootstrap_tokens ORDER BY runner_instance_id",
    )
    by_instance = {row["runner_instance_id"]: row for row in rows}
    for created in batch.instances:
        stored = by_instance[created.runner_instance_id]
        assert stored["token_sha256"] == tokens.digest(created.bootstrap_token)
        assert stored["display_prefix"] == created.bootstrap_token[:12]
        assert created.bootstrap_token.startswith("cp_rbt_")
        assert created.bootstrap_token not in {str(v) for v in stored.values()}
    first = await _row(conn, batch.instances[0].runner_instance_id)
    second = await _row(conn, batch.instances[1].runner_instance_id)
    assert (first["launch_kind"], first["intended_reservation_id"]) == ("demand", r)
    assert (second["launch_kind"], second["intended_reservation_id"]) == ("warm", None)
    assert first["state"] == "starting" and first["workspace_id"] is None
    assert list(first["labels"]) == [] and first["provider_kind"] == "docker"
    exchanged = await control_sessions.exchange_bootstrap(
        conn, batch.instances[0].bootstrap_token, timedelta(hours=1)
    )
    assert exchanged.runner_instance_id == batch.instances[0].runner_instance_id
    with pytest.raises(BootstrapTokenInvalid):
        await control_sessions.exchange_bootstrap(
            conn, batch.instances[0].bootstrap_token, timedelta(hours=1)
        )


async def test_p117_a_second_batch_against_a_consumed_reservation_creates_nothing(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    first = await runner_instances.create_batch(
        conn, p.id, provider_kind=None, entries=[("small", r)], bootstrap_ttl=TTL
    )
    assert len(first.instances) == 1
    second = await runner_instances.create_batch(
        conn, p.id, provider_kind=None, entries=[("small", r)], bootstrap_ttl=TTL
    )
    assert second.instances == ()
    assert second.reservation_unavailable
    assert second.capacity_failures == {"capacity-exhausted": 1}
    assert await conn.fetchval("SELECT count(*) FROM runner_instances") == 1


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("expired", "reservation-expired"),
        ("foreign", "reservation-not-found"),
        ("bound", "reservation-kind-mismatch"),
        ("missing", "reservation-not-found"),
    ],
)
async def test_p118_unusable_reservations_give_an_empty_batch_with_the_reason(
    conn: Conn, workspace: UUID, case: str, reason: str
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    other = await provisioning.provisioner(conn, workspace)
    owner = other.id if case == "foreign" else p.id
    r = await provisioning.reservation(
        conn,
        workspace_id=workspace,
        provisioner_id=owner,
        kind="bound" if case == "bound" else "launch",
        ttl=timedelta(seconds=-1) if case == "expired" else timedelta(seconds=60),
    )
    target = uuid.uuid4() if case == "missing" else r
    batch = await runner_instances.create_batch(
        conn, p.id, provider_kind=None, entries=[("small", target)], bootstrap_ttl=TTL
    )
    assert batch.instances == ()
    assert batch.reservation_unavailable
    assert batch.capacity_failures == {reason: 1}
    assert await conn.fetchval("SELECT count(*) FROM runner_instances") == 0


async def test_p119_a_partial_batch_returns_the_indexes_of_accepted_entries_only(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id, count=2)
    await make_runner(conn, p.id, intended_reservation_id=r)  # one unit already used
    entries: list[tuple[str | None, UUID | None]] = [
        ("small", r),
        ("small", r),
        (None, None),
        ("small", uuid.uuid4()),
    ]
    batch = await runner_instances.create_batch(
        conn, p.id, provider_kind=None, entries=entries, bootstrap_ttl=TTL
    )
    assert [c.request_index for c in batch.instances] == [0, 2]
    assert batch.capacity_failures == {"capacity-exhausted": 1, "reservation-not-found": 1}


# ------------------------------------------------------------------------ provider identity


async def test_p132_provider_identity_attaches_once(conn: Conn, workspace: UUID) -> None:
    p = await provisioning.provisioner(conn, workspace)
    runner = await make_runner(conn, p.id, state="starting", provider_runner_id=None)
    other = await provisioning.provisioner(conn, workspace)
    assert not await runner_instances.attach_provider_runner(conn, other.id, runner, "c-1")
    assert await runner_instances.attach_provider_runner(conn, p.id, runner, "c-1")
    assert not await runner_instances.attach_provider_runner(conn, p.id, runner, "c-1")
    assert not await runner_instances.attach_provider_runner(conn, p.id, runner, "c-2")
    assert (await _row(conn, runner))["provider_runner_id"] == "c-1"
    finished = await make_runner(conn, p.id, state="failed", provider_runner_id=None)
    assert not await runner_instances.attach_provider_runner(conn, p.id, finished, "c-3")


async def test_p132_an_identity_another_instance_holds_is_a_conflict(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    await make_runner(conn, p.id, provider_runner_id="c-1")
    fresh = await make_runner(conn, p.id, state="starting", provider_runner_id=None)
    async with conn.transaction():
        with pytest.raises(ProviderRunnerIdTaken):
            await runner_instances.attach_provider_runner(conn, p.id, fresh, "c-1")
        # The caller's transaction is still usable.
        assert await conn.fetchval("SELECT 1") == 1


# ------------------------------------------------------------------------------- enrollment


async def test_p120_enrollment_promotes_the_intended_reservation(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    # A provider report already carried the id into reservation_id, unassigned.
    runner = await make_runner(
        conn,
        p.id,
        state="starting",
        labels=(),
        intended_reservation_id=r,
        reservation_id=r,
        control_session=None,
    )
    enrolled = await _enroll(conn, await _session(conn, runner, p.id), ("linux", "x64"))
    assert enrolled.activation_token is not None
    assert enrolled.activation_token.startswith("cp_rat_")
    row = await _row(conn, runner)
    assert (row["workspace_id"], row["reservation_id"]) == (workspace, r)
    assert row["intended_reservation_id"] is None and row["assigned_at"] is not None
    assert row["state"] == "running" and list(row["labels"]) == ["linux", "x64"]
    token = await conn.fetchrow("SELECT * FROM runner_activation_tokens")
    assert token is not None
    assert token["token_sha256"] == tokens.digest(enrolled.activation_token)


@pytest.mark.parametrize("case", ["labels-mismatch", "expired", "deleted", "already-assigned"])
async def test_p121_enrollment_succeeds_without_a_token_when_promotion_fails(
    conn: Conn, workspace: UUID, case: str
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(
        conn,
        workspace_id=workspace,
        provisioner_id=p.id,
        labels=("gpu",) if case == "labels-mismatch" else ("linux",),
        ttl=timedelta(seconds=-1) if case == "expired" else timedelta(seconds=60),
    )
    elsewhere = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(
        conn,
        p.id,
        state="starting",
        intended_reservation_id=r,
        reservation_id=elsewhere if case == "already-assigned" else None,
        control_session=None,
    )
    if case == "deleted":
        await conn.execute("DELETE FROM reservations WHERE id = $1", r)
    enrolled = await _enroll(conn, await _session(conn, runner, p.id))
    assert enrolled.activation_token is None
    expected = {
        "labels-mismatch": "labels-mismatch",
        "expired": "reservation-expired",
        "deleted": "reservation-not-found",
        "already-assigned": "already-assigned",
    }[case]
    assert enrolled.promotion_failure == expected
    row = await _row(conn, runner)
    assert row["state"] == "running"
    assert row["intended_reservation_id"] == r and row["assigned_at"] is None
    assert await conn.fetchval("SELECT count(*) FROM runner_activation_tokens") == 0


@pytest.mark.parametrize("state", ["stopped", "failed", "terminated", "stopping"])
async def test_p122_enrollment_of_a_finished_instance_is_refused(
    conn: Conn, workspace: UUID, state: str
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    runner = await make_runner(conn, p.id, state=state, control_session=None)
    session = await _session(conn, runner, p.id)
    with pytest.raises(ControlSessionInvalid) as raised:
        await _enroll(conn, session)
    assert raised.value.code == "runner-control-session-invalid"
    assert (await _row(conn, runner))["state"] == state


async def test_p122_enrollment_of_a_vanished_instance_is_refused(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    runner = await make_runner(conn, p.id, control_session=None)
    session = await _session(conn, runner, p.id)
    await conn.execute("DELETE FROM runner_instances WHERE id = $1", runner)
    with pytest.raises(ControlSessionInvalid):
        await _enroll(conn, session)


async def test_p123_enrollment_keeps_committed_assignment_metadata(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    assigned = await make_runner(
        conn,
        p.id,
        labels=("linux",),
        workspace_id=workspace,
        reservation_id=r,
        assigned=True,
        control_session=None,
    )
    idle = await make_runner(conn, p.id, labels=("old",), control_session=None)
    await _enroll(conn, await _session(conn, assigned, p.id), ("gpu", "linux"))
    await _enroll(conn, await _session(conn, idle, p.id), ("gpu", "linux"))
    kept, updated = await _row(conn, assigned), await _row(conn, idle)
    assert list(kept["labels"]) == ["linux"] and kept["protocol_version"] is None
    assert list(updated["labels"]) == ["gpu", "linux"]
    assert (updated["provider_kind"], updated["protocol_version"]) == ("docker", "1")


async def test_p124_an_existing_runner_session_keeps_the_assignment_without_a_token(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(
        conn,
        p.id,
        intended_reservation_id=r,
        runner_session_id=uuid.uuid4(),
        control_session=None,
    )
    enrolled = await _enroll(conn, await _session(conn, runner, p.id))
    assert enrolled.activation_token is None
    assert enrolled.not_issued == "existing-session"
    row = await _row(conn, runner)
    assert (row["reservation_id"], row["workspace_id"]) == (r, workspace)
    assert row["assigned_at"] is not None


async def test_p125_a_failing_activation_issue_rolls_back_the_promotion(
    conn: Conn, workspace: UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(
        conn, p.id, state="starting", intended_reservation_id=r, control_session=None
    )
    session = await _session(conn, runner, p.id)

    async def failing_issue(
        conn: Conn, runner_instance_id: UUID, ttl: timedelta
    ) -> tuple[str | None, str | None]:
        await conn.execute("SELECT 1/0")  # a real database error inside the savepoint
        raise AssertionError("unreachable")

    monkeypatch.setattr(control_sessions, "issue_locked", failing_issue)
    enrolled = await _enroll(conn, session)
    assert enrolled == Enrollment(None, promotion_failure="unexpected")
    row = await _row(conn, runner)
    assert row["state"] == "running"  # the enrollment itself committed
    assert row["assigned_at"] is None and row["workspace_id"] is None
    assert row["intended_reservation_id"] == r


# ------------------------------------------------------------------------------- assignment


async def test_p126_assignment_writes_the_workspace_reservation_and_time(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id, count=2)
    a = await make_runner(conn, p.id, intended_reservation_id=r)
    b = await make_runner(conn, p.id)
    assert await runner_instances.assign(conn, p.id, r, [b, a]) == [b, a]
    for runner in (a, b):
        row = await _row(conn, runner)
        assert (row["workspace_id"], row["reservation_id"]) == (workspace, r)
        assert row["intended_reservation_id"] is None and row["assigned_at"] is not None


async def test_p126_assignment_rejections(conn: Conn, workspace: UUID) -> None:
    p = await provisioning.provisioner(conn, workspace)
    live = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    expired = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, ttl=timedelta(seconds=-1)
    )
    bound = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, kind="bound"
    )
    gpu = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, labels=("gpu",)
    )
    other = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    ok = await make_runner(conn, p.id)
    ok2 = await make_runner(conn, p.id)
    taken = await make_runner(
        conn, p.id, workspace_id=workspace, reservation_id=other, assigned=True
    )
    unenrolled = await make_runner(conn, p.id, state="starting", control_session=None)
    no_identity = await make_runner(conn, p.id, provider_runner_id=None)
    with pytest.raises(ReservationExpired):
        await runner_instances.assign(conn, p.id, expired, [ok])
    with pytest.raises(ReservationNotFound):
        await runner_instances.assign(conn, p.id, bound, [ok])
    with pytest.raises(ReservationNotFound):
        await runner_instances.assign(conn, uuid.uuid4(), live, [ok])
    cases = [
        (gpu, [ok], "labels-mismatch"),
        (live, [taken], "already-assigned"),
        (live, [ok, ok2], "capacity-exhausted"),
        (live, [unenrolled], "runner-not-running"),
        (live, [no_identity], "provider-identity-missing"),
        (live, [uuid.uuid4()], "runner-not-found"),
    ]
    for reservation_id, runners, reason in cases:
        with pytest.raises(RunnerNotAssignable) as raised:
            await runner_instances.assign(conn, p.id, reservation_id, runners)
        assert raised.value.reason == reason
        assert raised.value.code == "runner-instance-not-assignable"
    assert await conn.fetchval("SELECT count(*) FROM runner_instances WHERE assigned_at IS NOT NULL"
                               ) == 1  # fmt: skip


async def test_p126_a_runner_without_an_open_control_session_is_not_assignable(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    closed = await make_runner(conn, p.id, control_session="closed")
    with pytest.raises(RunnerNotAssignable) as raised:
        await runner_instances.assign(conn, p.id, r, [closed])
    assert raised.value.reason == "control-session-not-active"


async def test_p127_assignment_replays_after_deletion_and_for_a_bound_reservation(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(conn, p.id)
    await runner_instances.assign(conn, p.id, r, [runner])
    await conn.execute("DELETE FROM reservations WHERE id = $1", r)
    assert await runner_instances.assign(conn, p.id, r, [runner]) == [runner]
    bound = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, kind="bound"
    )
    adopted = await make_runner(
        conn, p.id, workspace_id=workspace, reservation_id=bound, assigned=True
    )
    assert await runner_instances.assign(conn, p.id, bound, [adopted]) == [adopted]


async def test_p128_released_or_terminal_runners_do_not_consume_assignment_capacity(
    conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    await make_runner(
        conn, p.id, workspace_id=workspace, reservation_id=r, assigned=True, released=True
    )
    await make_runner(conn, p.id, state="failed", intended_reservation_id=r)
    fresh = await make_runner(conn, p.id)
    assert await runner_instances.assign(conn, p.id, r, [fresh]) == [fresh]


async def test_p53_concurrent_identical_assignments_both_succeed(
    pool: asyncpg.Pool, conn: Conn, observer: asyncpg.Connection, workspace: UUID,
    database_url: str,
) -> None:  # fmt: skip
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id, count=2)
    a = await make_runner(conn, p.id)
    b = await make_runner(conn, p.id)
    results: list[list[UUID]] = []

    async def assign() -> None:
        async with pool.acquire() as own:
            results.append(await runner_instances.assign(own, p.id, r, [a, b]))

    async with (
        anyio.create_task_group() as group,
        holding_lock(database_url, locks.assignment(p.id, r)) as holder,
    ):
        group.start_soon(assign)
        group.start_soon(assign)
        for pid in await _lock_waiters(observer, holder, 2):
            await wait_until_blocked(observer, pid)
        # Leaving releases the lock first: both proceed, one after the other.
    assert results == [[a, b], [a, b]]
    assert await conn.fetchval("SELECT count(*) FROM runner_instances WHERE reservation_id = $1", r
                               ) == 2  # fmt: skip


async def _lock_waiters(
    observer: asyncpg.Connection, holder: asyncpg.Connection, count: int
) -> list[int]:
    """The pids of the `count` backends blocked behind `holder`, once they all are."""
    holder_pid = holder.get_server_pid()
    with anyio.fail_after(10):
        while True:
            pids: list[int] = [
                row["pid"]
                for row in await observer.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    holder_pid,
                )
            ]
            if len(pids) == count:
                return pids
            await anyio.sleep(0.005)


# ------------------------------------------------------------------------------- activation


async def test_s28_issuing_a_token_revokes_the_previous_one(conn: Conn, workspace: UUID) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(conn, p.id, workspace_id=workspace, reservation_id=r, assigned=True)
    first, _ = await activations.issue_activation_token(conn, runner, TTL)
    second, _ = await activations.issue_activation_token(conn, runner, TTL)
    assert first is not None and second is not None
    assert await activations.activation_by_digest(conn, tokens.digest(first)) is None
    assert await activations.activation_by_digest(conn, tokens.digest(second)) is not None


async def test_activation_is_refused_with_its_reason(conn: Conn, workspace: UUID) -> None:
    p = await provisioning.provisioner(conn, workspace)
    unassigned = await make_runner(conn, p.id)
    starting = await make_runner(
        conn, p.id, state="starting", workspace_id=workspace, reservation_id=uuid.uuid4()
    )
    activated = await make_runner(
        conn, p.id, workspace_id=workspace, runner_session_id=uuid.uuid4()
    )
    issue = activations.issue_activation_token
    assert await issue(conn, uuid.uuid4(), TTL) == (None, "runner-not-found")
    assert await issue(conn, unassigned, TTL) == (None, "missing-workspace")
    assert await issue(conn, starting, TTL) == (None, "not-running")
    assert await issue(conn, activated, TTL) == (None, "existing-session")
    assert await conn.fetchval("SELECT count(*) FROM runner_activation_tokens") == 0


# ------------------------------------------------------------------------------ first claim


async def _activated(conn: Conn, workspace: UUID, count: int) -> tuple[UUID, UUID, UUID]:
    """An activated runner of a live reservation of `count`: (reservation, runner, session)."""
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, count=count
    )
    runner = await make_runner(conn, p.id, workspace_id=workspace, reservation_id=r, assigned=True)
    token, _ = await activations.issue_activation_token(conn, runner, TTL)
    assert token is not None
    grant = await activations.activation_by_digest(conn, tokens.digest(token))
    assert grant is not None
    session = await activations.consume_activation(
        conn, grant, labels=("linux",), capabilities=None
    )
    return r, runner, session.id


async def test_p135_the_first_claim_releases_one_unit_and_a_second_does_not(
    conn: Conn, workspace: UUID
) -> None:
    r, runner, session = await _activated(conn, workspace, count=2)
    async with conn.transaction():
        assert await activations.release_on_first_claim(conn, session) == 1
    assert await _count(conn, r) == 1
    row = await _row(conn, runner)
    assert row["first_claimed_at"] is not None and row["reservation_released_at"] is not None
    assert await activations.release_on_first_claim(conn, session) == 0
    assert await _count(conn, r) == 1


async def test_p135_the_last_unit_deletes_the_reservation(conn: Conn, workspace: UUID) -> None:
    r, _runner, session = await _activated(conn, workspace, count=1)
    assert await activations.release_on_first_claim(conn, session) == 1
    assert await _count(conn, r) is None
    assert await activations.release_on_first_claim(conn, uuid.uuid4()) == 0


async def test_j95_one_activation_token_registered_twice_concurrently_makes_one_session(
    pool: asyncpg.Pool, conn: Conn, workspace: UUID
) -> None:
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(conn, workspace_id=workspace, provisioner_id=p.id)
    runner = await make_runner(conn, p.id, workspace_id=workspace, reservation_id=r, assigned=True)
    token, _ = await activations.issue_activation_token(conn, runner, TTL)
    assert token is not None
    grant = await activations.activation_by_digest(conn, tokens.digest(token))
    assert grant is not None
    outcomes: list[str] = []

    async def register() -> None:
        async with pool.acquire() as own:
            try:
                await activations.consume_activation(
                    own, grant, labels=("linux",), capabilities=None
                )
                outcomes.append("ok")
            except Unauthorized:
                outcomes.append("unauthorized")

    async with anyio.create_task_group() as group:
        group.start_soon(register)
        group.start_soon(register)
    assert sorted(outcomes) == ["ok", "unauthorized"]
    sessions = await conn.fetch(
        "SELECT id, registration_token_kind, max_claims FROM runner_sessions"
        " WHERE runner_instance_id = $1",
        runner,
    )
    assert [(s["registration_token_kind"], s["max_claims"]) for s in sessions] == [
        ("activation", 1)
    ]
    consumed = await conn.fetchrow("SELECT * FROM runner_activation_tokens")
    assert consumed is not None
    assert consumed["consumed_at"] is not None
    assert consumed["consumed_session_id"] == sessions[0]["id"]
