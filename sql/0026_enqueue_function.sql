-- Enqueue in one round trip (issue 13: the enqueue is inside the clock of every dispatch and
-- demand sample). An enqueue was a transaction of four round trips from the replica: BEGIN, the
-- execution locks, the insert statement, COMMIT. This function runs the same two statements in
-- the same order, in the caller's one-statement transaction, so the lock order documented in
-- controlplane/store/queue.py is unchanged:
--
--   execution locks (blocking, in the order given: ascending keys) -> pending inserts ->
--   (the trigger of sql/0022, sql/0030) cp_workspace_demand keys, shared -> summary rows ->
--   each new concurrency key's row (insert, ON CONFLICT DO NOTHING, key order).
--
-- A VOLATILE plpgsql function takes a fresh snapshot for every statement it runs, so the insert
-- statement, which starts after the last lock was granted, sees whatever the previous holder of
-- a lock committed, as a separate statement of a READ COMMITTED transaction does (sql/0009 says
-- the same of cp_complete). The advisory keys are computed, sorted and de-duplicated by the
-- caller (controlplane/store/locks.py owns the key scheme). NOTIFY is delivered at commit, as
-- before.
--
-- $1 the execution lock keys; $2.. the per-job arrays and the channel, exactly the parameters
-- $1.. of the statement store/queue.py ran before (so the body below is that statement with
-- every parameter number raised by one). Returns one row: the executions inserted, those found
-- running, those found ended, and how many notifications were sent.
CREATE FUNCTION cp_enqueue(
    bigint[], uuid[], uuid[], uuid[], uuid[], uuid[], uuid[], text[], text[], timestamptz[],
    text[], text, integer[], text[], integer[], integer[], integer[], integer[]
) RETURNS TABLE (inserted_ids uuid[], running_ids uuid[], ended_ids uuid[], notified bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- unnest returns the array in order, so the locks are taken in the order given.
    PERFORM pg_advisory_xact_lock(k) FROM unnest($1) AS k;
    RETURN QUERY
    WITH input AS (
        SELECT * FROM unnest($2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $13, $14, $15, $16, $17,
                             $18)
             AS t(ws, run, attempt, job, ex, project, labels, body, queued, wake,
                  priority, ckey, climit, timeout, queue_timeout, retries)
    ), running AS (
        SELECT job_execution_id AS ex FROM running_jobs
        WHERE job_execution_id IN (SELECT ex FROM input)
    ), ended AS (
        SELECT job_execution_id AS ex FROM ended_executions
        WHERE job_execution_id IN (SELECT ex FROM input)
    ), inserted AS (
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id,
            job_id, job_execution_id, project_id, required_labels, payload, created_at,
            priority, concurrency_key, concurrency_limit,
            timeout_seconds, queue_timeout_seconds, expires_at, retries_on_lost)
        SELECT ws, run, attempt, job, ex, project,
               ARRAY(SELECT jsonb_array_elements_text(labels::jsonb)), body::jsonb, queued,
               priority, ckey, climit,
               timeout, queue_timeout, now() + queue_timeout * interval '1 second', retries
        FROM input
        WHERE ex NOT IN (SELECT ex FROM running) AND ex NOT IN (SELECT ex FROM ended)
        ON CONFLICT (job_execution_id) DO NOTHING
        RETURNING job_execution_id
    ), keyed AS (
        -- The count row of each key (store/ordering.py); an existing one is not locked.
        INSERT INTO concurrency_keys (workspace_id, concurrency_key)
        SELECT DISTINCT ws, ckey FROM input WHERE ckey IS NOT NULL
        ORDER BY 1, 2
        ON CONFLICT DO NOTHING
    ), woken AS (
        SELECT count(pg_notify($12, wake)) AS n
        FROM (SELECT DISTINCT input.wake FROM inserted
              JOIN input ON input.ex = inserted.job_execution_id) AS w
    )
    SELECT ARRAY(SELECT job_execution_id FROM inserted),
           ARRAY(SELECT ex FROM running),
           ARRAY(SELECT ex FROM ended),
           (SELECT n FROM woken);
END
$$;
