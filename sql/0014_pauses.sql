-- Operator pauses and drains (issue 14, docs/policies.md "Pause, resume, drain").
--
-- A row in paused_workspaces or paused_runners is the pause itself: the claim statements
-- (controlplane/store/claiming.py) hand out nothing while one matches, so the database is the
-- one authority every replica reads. Both tables stay tiny (one row per paused thing), and the
-- claim probes them by primary key.

CREATE TABLE paused_workspaces (
    workspace_id uuid PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by uuid NOT NULL,  -- the admin API key that paused it
    reason text CHECK (length(reason) BETWEEN 1 AND 512)
);

-- A runner session's pause goes with the session: session GC deletes both.
CREATE TABLE paused_runners (
    runner_session_id uuid PRIMARY KEY REFERENCES runner_sessions (id) ON DELETE CASCADE,
    workspace_id uuid NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by uuid NOT NULL,
    reason text CHECK (length(reason) BETWEEN 1 AND 512)
);

-- A drained runner instance is never bound to new demand (domain/binding.py, store/demand.py).
ALTER TABLE runner_instances
    ADD COLUMN drained_at timestamptz,
    ADD COLUMN drained_by uuid,
    ADD COLUMN drain_reason text CHECK (length(drain_reason) BETWEEN 1 AND 512);
