-- The candidates for a terminate intent (spec 3.6) in one place (issue 13). Allocation rounds
-- (controlplane/store/terminate_intents.py) and provider reports (controlplane/store/
-- runner_reports.py) both asked which of a workspace provisioner's active runners were told to
-- stop; they shared SQL fragments by positional parameter. This function is that question.
--
-- One row per active runner (starting, running, stopping: domain.runner_instances.ACTIVE_STATES)
-- of the provisioner in the workspace that has a provider identity, with:
--   cancelled: the newest lease of its provider identity has a cancellation requested;
--   timed_out: p_activation_timeout is given and it is a demand runner (LaunchKind.DEMAND)
--              without a runner session, created longer ago than the timeout, and none of its
--              reservations (assigned or intended) is a live one of this provisioner in this
--              workspace. domain.runner_instances.activation_timed_out is the same rule.
-- The domain classifies the rows (domain/terminate_intents.py); callers filter them.
--
-- Plain reads: no lock. LANGUAGE sql, STABLE, not STRICT and returning a set, so the planner
-- inlines it into the calling query (as if its text were written there) and keeps its plans.

CREATE FUNCTION cp_terminate_candidates(
    p_workspace uuid,
    p_provisioner uuid,
    p_activation_timeout interval
) RETURNS TABLE (
    id uuid,
    provider_runner_id text,
    reservation_released_at timestamptz,
    cancelled boolean,
    timed_out boolean
)
LANGUAGE sql STABLE AS $$
    SELECT ri.id, ri.provider_runner_id, ri.reservation_released_at,
           COALESCE((SELECT rj.cancellation_requested_at IS NOT NULL FROM running_jobs rj
                      WHERE rj.workspace_id = ri.workspace_id
                        AND rj.provisioner_id = ri.provisioner_id
                        AND rj.provider_runner_id = ri.provider_runner_id
                      ORDER BY rj.started_at DESC, rj.job_execution_id DESC LIMIT 1), false),
           (p_activation_timeout IS NOT NULL AND ri.launch_kind = 'demand'
            AND ri.runner_session_id IS NULL
            AND ri.created_at < now() - p_activation_timeout
            AND NOT EXISTS (SELECT 1 FROM reservations r
                             WHERE r.workspace_id = p_workspace
                               AND r.provisioner_id = p_provisioner
                               AND r.expires_at > now()
                               AND r.id IN (ri.reservation_id, ri.intended_reservation_id)))
      FROM runner_instances ri
     WHERE ri.workspace_id = p_workspace AND ri.provisioner_id = p_provisioner
       AND ri.provider_runner_id IS NOT NULL
       AND ri.state IN ('starting', 'running', 'stopping')
$$;
