-- The life of an execution (issue 14, items 1, 2 and 7): a run timeout, a queue expiry and
-- retries after a lost runner. docs/policies.md ("The life of an execution") has the rules.
--
-- A pending row and its lease carry the same policy columns by name (the claim copies them, a
-- put-back and a retry copy them back: controlplane/store/records.py CARRIED_COLUMNS):
--   timeout_seconds        the run timeout; the lease's deadline is started_at + this, fixed
--                          when the lease starts (no heartbeat moves either). NULL: none.
--   queue_timeout_seconds  how long the execution may wait in the queue; NULL: forever.
--   expires_at             the queue deadline: enqueue (or the retry's put-back) + the above.
--   retries_on_lost        how many times a lease lost with its runner goes back to the queue.
--   attempt                1 for the first lease, n + 1 after n retries.
-- Rows from before this migration get NULLs and 0: no timeout, no expiry, no retry.

ALTER TABLE pending_jobs
    ADD COLUMN timeout_seconds integer CHECK (timeout_seconds > 0),
    ADD COLUMN queue_timeout_seconds integer CHECK (queue_timeout_seconds > 0),
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN retries_on_lost integer NOT NULL DEFAULT 0
        CHECK (retries_on_lost BETWEEN 0 AND 100),
    ADD COLUMN attempt integer NOT NULL DEFAULT 1 CHECK (attempt >= 1);

-- The leader's queue-expiry walk (controlplane/store/deadlines.py), oldest deadline first.
CREATE INDEX pending_jobs_expires_at_idx ON pending_jobs (expires_at, id)
    WHERE expires_at IS NOT NULL;

-- No index on the run deadline: running rows are one per busy runner, and the leader's walk
-- over them is a scan of that table every reaper interval.
ALTER TABLE running_jobs
    ADD COLUMN timeout_seconds integer,
    ADD COLUMN queue_timeout_seconds integer,
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN retries_on_lost integer NOT NULL DEFAULT 0,
    ADD COLUMN attempt integer NOT NULL DEFAULT 1;

-- The attempts that did not end their execution: one row per lease lost with its runner and put
-- back for another attempt. The last attempt's outcome is the tombstone's.
CREATE TABLE execution_attempts (
    job_execution_id uuid NOT NULL,
    attempt integer NOT NULL CHECK (attempt >= 1),
    workspace_id uuid NOT NULL,
    runner_session_id uuid NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL DEFAULT now(),
    outcome text NOT NULL CHECK (outcome IN ('lost')),
    PRIMARY KEY (job_execution_id, attempt)
);
CREATE INDEX execution_attempts_ended_at_idx ON execution_attempts (ended_at);

ALTER TABLE ended_executions DROP CONSTRAINT ended_executions_outcome_check;
ALTER TABLE ended_executions ADD CONSTRAINT ended_executions_outcome_check
    CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired', 'timed_out',
                       'queue_expired'));

-- Still exactly one terminal event per execution, now of five kinds.
DROP INDEX events_one_terminal_per_execution_idx;
CREATE UNIQUE INDEX events_one_terminal_per_execution_idx ON events (job_execution_id)
    WHERE event_type IN ('job.completed', 'job.cancelled', 'job.lease_expired', 'job.timed_out',
                         'job.queue_expired');
