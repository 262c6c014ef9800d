-- The job-execution queue: sessions, pending rows, leases, tombstones and the event feed.
-- Requires PostgreSQL 18 or later (uuidv7() is built in there).

CREATE TABLE runner_sessions (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid NOT NULL,
    registration_token_id uuid NOT NULL,
    registration_token_kind text NOT NULL
        CHECK (registration_token_kind IN ('manual', 'ephemeral', 'activation')),
    runner_instance_id uuid,
    provisioner_id uuid,
    provider_runner_id text,
    labels text[] NOT NULL,
    tool_capabilities jsonb,
    tool_capabilities_reported_at timestamptz,
    max_claims integer,
    claims_used integer NOT NULL DEFAULT 0,
    revoked_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT runner_sessions_claims_ck CHECK (
        claims_used >= 0 AND (
            (registration_token_kind = 'manual' AND max_claims IS NULL)
            OR (registration_token_kind IN ('ephemeral', 'activation')
                AND max_claims IS NOT NULL AND max_claims > 0 AND claims_used <= max_claims)
        )
    ),
    CONSTRAINT runner_sessions_link_ck CHECK (
        (registration_token_kind = 'manual'
            AND runner_instance_id IS NULL AND provisioner_id IS NULL AND provider_runner_id IS NULL)
        OR (registration_token_kind = 'ephemeral'
            AND runner_instance_id IS NULL AND provisioner_id IS NOT NULL
            AND provider_runner_id IS NOT NULL)
        OR (registration_token_kind = 'activation'
            AND runner_instance_id IS NOT NULL AND provisioner_id IS NOT NULL
            AND provider_runner_id IS NOT NULL)
    ),
    CONSTRAINT runner_sessions_capabilities_ck CHECK (
        (tool_capabilities IS NULL) = (tool_capabilities_reported_at IS NULL)
    )
);
CREATE INDEX runner_sessions_kind_created_id_idx
    ON runner_sessions (registration_token_kind, created_at, id);
CREATE INDEX runner_sessions_provider_runner_updated_idx
    ON runner_sessions (workspace_id, provisioner_id, provider_runner_id, updated_at)
    WHERE provisioner_id IS NOT NULL;

-- The queue. created_at is the orchestrator's queued_at: the FIFO key, with id (uuidv7) as the
-- tiebreaker. A put-back restores both, so the row returns to its original position.
CREATE TABLE pending_jobs (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid NOT NULL,
    workflow_run_id uuid NOT NULL,
    workflow_run_attempt_id uuid NOT NULL,
    job_id uuid NOT NULL,
    job_execution_id uuid NOT NULL CONSTRAINT pending_jobs_job_execution_id_unique UNIQUE,
    project_id uuid NOT NULL,
    required_labels text[] NOT NULL CHECK (cardinality(required_labels) > 0),
    payload jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    enqueued_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX pending_jobs_workspace_created_idx ON pending_jobs (workspace_id, created_at, id);
CREATE INDEX pending_jobs_job_id_idx ON pending_jobs (job_id);

-- Leases. pending_id and queued_at keep the queue position for a put-back.
CREATE TABLE running_jobs (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    pending_id uuid NOT NULL,
    workspace_id uuid NOT NULL,
    workflow_run_id uuid NOT NULL,
    workflow_run_attempt_id uuid NOT NULL,
    job_id uuid NOT NULL,
    job_execution_id uuid NOT NULL CONSTRAINT running_jobs_job_execution_id_unique UNIQUE,
    project_id uuid NOT NULL,
    runner_session_id uuid NOT NULL REFERENCES runner_sessions (id),
    provisioner_id uuid,
    provider_runner_id text,
    required_labels text[] NOT NULL,
    runner_labels text[] NOT NULL,
    payload jsonb NOT NULL,
    queued_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    first_heartbeat_at timestamptz,
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    cancellation_requested_at timestamptz,
    CONSTRAINT running_jobs_link_ck CHECK ((provisioner_id IS NULL) = (provider_runner_id IS NULL))
);
CREATE INDEX running_jobs_no_first_heartbeat_started_idx
    ON running_jobs (started_at) WHERE first_heartbeat_at IS NULL;
CREATE INDEX running_jobs_last_heartbeat_at_idx ON running_jobs (last_heartbeat_at);
CREATE INDEX running_jobs_provider_runner_started_idx
    ON running_jobs (workspace_id, provisioner_id, provider_runner_id, started_at DESC)
    WHERE provisioner_id IS NOT NULL;
CREATE INDEX running_jobs_cancellation_requested_idx
    ON running_jobs (workspace_id, provisioner_id, provider_runner_id)
    WHERE cancellation_requested_at IS NOT NULL;
CREATE INDEX running_jobs_job_id_idx ON running_jobs (job_id);
CREATE INDEX running_jobs_runner_session_id_idx ON running_jobs (runner_session_id);

-- Durable tombstones: one row per ended execution, whatever ended it. Enqueue refuses an
-- execution that has one, so an at-least-once replay can never resurrect it.
CREATE TABLE ended_executions (
    job_execution_id uuid PRIMARY KEY,
    workspace_id uuid,
    job_id uuid,
    outcome text NOT NULL CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired')),
    ended_by text NOT NULL CHECK (ended_by IN ('runner', 'orchestrator', 'reaper')),
    ended_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ended_executions_ended_at_idx ON ended_executions (ended_at);

-- The ordered event feed. A reader sees an event only once every transaction that could still
-- commit an earlier one has finished (xid below the snapshot's xmin), and reads in (xid, seq)
-- order, so a cursor never skips an event that commits late.
CREATE TABLE events (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    event_type text NOT NULL,
    workspace_id uuid,
    job_execution_id uuid,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX events_xid_seq_idx ON events (xid, seq);
CREATE INDEX events_workspace_xid_seq_idx ON events (workspace_id, xid, seq);
-- Exactly one terminal event per execution, enforced by the database.
CREATE UNIQUE INDEX events_one_terminal_per_execution_idx ON events (job_execution_id)
    WHERE event_type IN ('job.completed', 'job.cancelled', 'job.lease_expired');
