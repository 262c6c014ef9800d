-- Completion in one round trip (issue 6: throughput). A runner's complete was a transaction of
-- six statements (BEGIN, the execution lock, the orphan sweep, the lease delete, the tombstone,
-- the event, COMMIT), each a network round trip. This function runs the same statements in the
-- same order, so the lock order documented in controlplane/store/leases.py is unchanged:
--
--   execution lock (blocking) -> pending row (orphan sweep) -> running row (delete) ->
--   tombstone -> events.
--
-- A VOLATILE plpgsql function takes a fresh snapshot for every statement it runs, so the
-- statements after the lock wait see whatever the previous holder of the lock committed, as
-- separate statements of a READ COMMITTED transaction do. The advisory key is computed by the
-- caller (controlplane/store/locks.py owns the key scheme).
--
-- Raises no_data_found (P0002) when the session holds no lease on the execution, so that nothing
-- is written, not even the orphan sweep. Else returns one row: the lease's identity and
-- provisioned link, whether a cancel had been requested, and whether this call ended the
-- execution (false when an orchestrator cancel had already ended it).

CREATE FUNCTION cp_complete(
    p_lock_key bigint,
    p_execution uuid,
    p_session uuid,
    p_outcome text,
    p_exit_code integer
) RETURNS TABLE (
    workspace_id uuid,
    workflow_run_id uuid,
    workflow_run_attempt_id uuid,
    job_id uuid,
    job_execution_id uuid,
    project_id uuid,
    provisioner_id uuid,
    provider_runner_id text,
    cancellation_requested_at timestamptz,
    newly_ended boolean
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    lease record;
    fresh boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);
    DELETE FROM pending_jobs AS p WHERE p.job_execution_id = p_execution;
    DELETE FROM running_jobs AS r
    WHERE r.job_execution_id = p_execution AND r.runner_session_id = p_session
    RETURNING r.workspace_id, r.workflow_run_id, r.workflow_run_attempt_id, r.job_id,
              r.job_execution_id, r.project_id, r.provisioner_id, r.provider_runner_id,
              r.cancellation_requested_at
    INTO lease;
    IF NOT FOUND THEN
        -- Roll the orphan sweep back too: a refused complete changes nothing.
        RAISE EXCEPTION 'the session holds no lease on this execution' USING ERRCODE = 'P0002';
    END IF;
    INSERT INTO ended_executions AS e (job_execution_id, workspace_id, job_id, outcome, ended_by)
    VALUES (p_execution, lease.workspace_id, lease.job_id, p_outcome, 'runner')
    ON CONFLICT (job_execution_id) DO NOTHING;
    fresh := FOUND;
    IF fresh THEN
        INSERT INTO events (event_type, workspace_id, job_execution_id, payload)
        VALUES ('job.completed', lease.workspace_id, p_execution,
                jsonb_build_object(
                    'workflow_run_id', lease.workflow_run_id,
                    'workflow_run_attempt_id', lease.workflow_run_attempt_id,
                    'job_id', lease.job_id,
                    'job_execution_id', p_execution,
                    'outcome', p_outcome,
                    'ended_by', 'runner',
                    'exit_code', p_exit_code));
    END IF;
    RETURN QUERY SELECT lease.workspace_id, lease.workflow_run_id, lease.workflow_run_attempt_id,
                        lease.job_id, lease.job_execution_id, lease.project_id,
                        lease.provisioner_id, lease.provider_runner_id,
                        lease.cancellation_requested_at, fresh;
END
$$;
