"""Reconcile (spec 4.9): terminate the provisioner's active runners it no longer observes,
and describe the ones it does.

Locks follow the global order of `store/reservations.py` (and of `store/runner_release.py`,
whose `lock_linked_runners` and `release_terminal` this module uses): the workspace lock, then
assignment locks and runner rows, then the release's reservation rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from controlplane.domain.provisioners import Provisioner
from controlplane.domain.reports import BoundJob, ObservedRunner, ReconcileOutcome
from controlplane.domain.runner_instances import RunnerState, absent_and_stale
from controlplane.domain.terminate_intents import observed_intent
from controlplane.store.pool import Conn
from controlplane.store.reservations import ACTIVE_SQL, db_now, lock_workspace
from controlplane.store.runner_release import lock_linked_runners, release_terminal


async def reconcile(
    conn: Conn,
    provisioner: Provisioner,
    observed_ids: Sequence[str],
    *,
    grace: timedelta,
    include_intended: bool = False,
) -> ReconcileOutcome:
    """Terminate the provisioner's active runners it no longer observes (once silent for
    `grace`) and describe the observed ones (spec 4.9). An empty observed set only reads.

    Scope: a workspace provisioner sees rows of its workspace, an installation one only
    workspace-neutral rows. Locks: the workspace lock (`workspace ?? provisioner`), then the
    absent candidates' assignment locks and rows (`lock_linked_runners`), then the release's
    reservation rows. A report that made a candidate fresh after it was selected wins: the
    staleness is checked again on the locked row and in the UPDATE (P-51).
    """
    observed = list(dict.fromkeys(observed_ids))
    workspace_id = provisioner.workspace_id
    terminated: list[str] = []
    released = 0
    async with conn.transaction():
        await lock_workspace(conn, workspace_id or provisioner.id)
        if observed:
            now = await db_now(conn)
            candidates = await conn.fetch(
                f"""
                SELECT id FROM runner_instances
                 WHERE provisioner_id = $1 AND workspace_id IS NOT DISTINCT FROM $2
                   AND state IN {ACTIVE_SQL} AND provider_runner_id IS NOT NULL
                   AND provider_runner_id <> ALL($3::text[]) AND reported_at < $4
                """,  # noqa: S608 -- interpolates constants only: ACTIVE_SQL
                provisioner.id,
                workspace_id,
                observed,
                now - grace,
            )
            locked = await lock_linked_runners(conn, [row["id"] for row in candidates])
            absent = [
                r.id
                for r in locked
                if r.workspace_id == workspace_id
                and absent_and_stale(r, set(observed), now=now, grace=grace)
            ]
            if absent:
                rows = await conn.fetch(
                    f"""
                    UPDATE runner_instances
                       SET state = 'terminated', terminated_at = coalesce(terminated_at, now()),
                           updated_at = now()
                     WHERE id = ANY($1::uuid[]) AND state IN {ACTIVE_SQL} AND reported_at < $2
                    RETURNING id, provider_runner_id
                    """,  # noqa: S608 -- interpolates constants only: ACTIVE_SQL
                    absent,
                    now - grace,
                )
                terminated = sorted(row["provider_runner_id"] for row in rows)
                released = await release_terminal(
                    conn,
                    workspace_id=workspace_id,
                    provisioner_id=provisioner.id,
                    runner_instance_ids=[row["id"] for row in rows],
                    require_unlinked_session=False,
                )
        runners = await _observed(conn, provisioner, observed, include_intended=include_intended)
    return ReconcileOutcome(runners, tuple(terminated), released)


async def _observed(
    conn: Conn, provisioner: Provisioner, observed: list[str], *, include_intended: bool
) -> tuple[ObservedRunner, ...]:
    """Steps 3-4 of 4.9: per observed id in request order, its row in scope (unknown ids get
    nulls, so no other scope's rows leak) and, for workspace scope, its newest lease."""
    rows = await conn.fetch(
        """
        SELECT provider_runner_id, state, reservation_id, intended_reservation_id,
               runner_session_id
          FROM runner_instances
         WHERE provisioner_id = $1 AND workspace_id IS NOT DISTINCT FROM $2
           AND provider_runner_id = ANY($3::text[])
        """,
        provisioner.id,
        provisioner.workspace_id,
        observed,
    )
    jobs: dict[str, BoundJob] = {}
    if provisioner.workspace_id is not None:
        for job in await conn.fetch(
            """
            SELECT DISTINCT ON (provider_runner_id) provider_runner_id, job_id, job_execution_id,
                   workflow_run_attempt_id, last_heartbeat_at, cancellation_requested_at
              FROM running_jobs
             WHERE workspace_id = $1 AND provisioner_id = $2
               AND provider_runner_id = ANY($3::text[])
             ORDER BY provider_runner_id, started_at DESC, job_execution_id DESC
            """,
            provisioner.workspace_id,
            provisioner.id,
            observed,
        ):
            jobs[job["provider_runner_id"]] = BoundJob(
                job_id=job["job_id"],
                job_execution_id=job["job_execution_id"],
                workflow_run_attempt_id=job["workflow_run_attempt_id"],
                last_heartbeat_at=job["last_heartbeat_at"],
                cancellation_requested_at=job["cancellation_requested_at"],
            )
    by_id = {row["provider_runner_id"]: row for row in rows}
    answers = []
    for pid in observed:
        row = by_id.get(pid)
        if row is None:
            answers.append(ObservedRunner(pid))
            continue
        state = RunnerState(row["state"])
        bound = jobs.get(pid)
        reason = observed_intent(
            state,
            job_cancelled=bound is not None and bound.cancellation_requested_at is not None,
        )
        answers.append(
            ObservedRunner(
                provider_runner_id=pid,
                state=state,
                reservation_id=row["reservation_id"],
                intended_reservation_id=row["intended_reservation_id"]
                if include_intended
                else None,
                runner_session_id=row["runner_session_id"],
                bound_job=bound,
                desired_intent="keep" if reason is None else "terminate",
                intent_reason=reason,
            )
        )
    return tuple(answers)
