-- A job's result where it was enqueued (issue 12): the runner reports its exit code and a
-- bounded tail of its output with completion, and both are kept with the tombstone (so as long
-- as it is) and carried by the job.completed event. The tail's bound is a setting applied by the
-- server before it gets here (runners.output_tail_bytes); the CHECK is the hard ceiling.
--
-- cp_complete gains the tail; its statements and their order (the lock order documented in
-- controlplane/store/leases.py) are those of 0009.

ALTER TABLE ended_executions
    ADD COLUMN exit_code integer CHECK (exit_code BETWEEN -255 AND 255),
    ADD COLUMN output_tail text CHECK (octet_length(output_tail) <= 1048576);

DROP FUNCTION cp_complete(bigint, uuid, uuid, text, integer);

CREATE FUNCTION cp_complete(
    p_lock_key bigint,
    p_execution uuid,
    p_session uuid,
    p_outcome text,
    p_exit_code integer,
    p_output_tail text
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
    INSERT INTO ended_executions AS e
        (job_execution_id, workspace_id, job_id, outcome, ended_by, exit_code, output_tail)
    VALUES (p_execution, lease.workspace_id, lease.job_id, p_outcome, 'runner', p_exit_code,
            p_output_tail)
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
                    'exit_code', p_exit_code,
                    'output_tail', p_output_tail));
    END IF;
    RETURN QUERY SELECT lease.workspace_id, lease.workflow_run_id, lease.workflow_run_attempt_id,
                        lease.job_id, lease.job_execution_id, lease.project_id,
                        lease.provisioner_id, lease.provider_runner_id,
                        lease.cancellation_requested_at, fresh;
END
$$;
