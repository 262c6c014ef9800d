"""Read-only queue views (J-84 .. J-87)."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from controlplane.domain.jobs import ClaimedJob, Outcome, SessionClaims
from controlplane.store import claiming, leases, queries, queue
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job


async def claimed_job(conn: Conn, session: SessionClaims) -> ClaimedJob:
    await queue.enqueue(conn, [new_job(session.workspace_id)])
    job = await claiming.claim(conn, session)
    assert job is not None
    return job


async def test_j84_queue_depth_counts_are_non_negative(conn: Conn, workspace: UUID) -> None:
    assert await queries.depth(conn) == queries.QueueDepth(pending=0, running=0)

    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    await leases.complete(
        conn, job.identity.job_execution_id, session.runner_session_id, Outcome.SUCCEEDED
    )

    depth = await queries.depth(conn)
    assert depth.pending >= 0
    assert depth.running >= 0
    assert depth == queries.QueueDepth(pending=0, running=0)


async def test_j85_two_enqueues_and_a_claim_add_one_pending_and_one_running(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace)])
    await claimed_job(conn, session)
    baseline = await queries.depth(conn)

    await queue.enqueue(conn, [new_job(workspace), new_job(workspace)])
    assert await claiming.claim(conn, session) is not None

    after = await queries.depth(conn)
    assert after.pending == baseline.pending + 1
    assert after.running == baseline.running + 1


async def test_j86_workspace_counts_follow_input_order_and_count_cancelled_leases(
    conn: Conn,
) -> None:
    # Chosen so that sorting the ids would give C, B, A, not the requested order.
    a = UUID("f0000000-0000-4000-8000-00000000000a")
    b = UUID("80000000-0000-4000-8000-00000000000b")
    c = UUID("00000000-0000-4000-8000-00000000000c")
    session = await manual_session(conn, a)
    cancelled = await claimed_job(conn, session)
    await leases.reconcile(conn, cancelled.identity.job_execution_id, Outcome.CANCELLED)
    await claimed_job(conn, session)
    await queue.enqueue(conn, [new_job(a), new_job(a), new_job(a, ["macos"]), new_job(c)])

    counts = await queries.workspace_counts(conn, [a, b, c])

    assert [(w.workspace_id, w.queued, w.running) for w in counts] == [
        (a, 3, 2),
        (b, 0, 0),
        (c, 1, 0),
    ]
    # Per label set, most queued first; the cancelled lease still counts as running.
    assert [(g.labels, g.queued, g.running) for g in counts[0].labels] == [
        (("linux",), 2, 2),
        (("macos",), 1, 0),
    ]
    assert counts[1].labels == ()


async def test_j87_active_leases_use_a_60s_window_newest_heartbeat_first(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    seconds_ago = {10: await claimed_job(conn, session), 61: await claimed_job(conn, session)}
    seconds_ago[40] = await claimed_job(conn, session)
    seconds_ago[5] = await claimed_job(conn, session)
    for seconds, job in seconds_ago.items():
        await conn.execute(
            """
            UPDATE running_jobs SET started_at = now() - interval '5 minutes',
                first_heartbeat_at = now() - interval '4 minutes',
                last_heartbeat_at = now() - make_interval(secs => $2)
            WHERE job_execution_id = $1
            """,
            job.identity.job_execution_id,
            float(seconds),
        )
    elsewhere = await manual_session(conn, UUID("11111111-1111-4111-8111-111111111111"))
    await claimed_job(conn, elsewhere)  # fresh, but in another workspace

    active = await queries.active_leases(conn, workspace, timedelta(seconds=60))

    assert [lease.identity for lease in active] == [
        seconds_ago[5].identity,
        seconds_ago[10].identity,
        seconds_ago[40].identity,
    ]
    assert all(lease.runner_session_id == session.runner_session_id for lease in active)
    assert [lease.last_heartbeat_at for lease in active] == sorted(
        (lease.last_heartbeat_at for lease in active), reverse=True
    )


async def test_a_freshly_claimed_lease_is_active(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)

    active = await queries.active_leases(conn, workspace, timedelta(seconds=60))

    assert [lease.identity for lease in active] == [job.identity]
    assert active[0].cancellation_requested is False
