-- Provisioning: reservations of demand, runner instances and the credentials of their boot path,
-- and the templates provisioners advertise. Lock order and the statements: docs/concurrency.md
-- and the docstrings of controlplane/store/{reservations,demand,runner_instances}.py.
--
-- No foreign key from a runner instance to a reservation: an assignment outlives its reservation
-- row (a deleted or expired reservation leaves a dangling id on an activated runner).

CREATE TABLE reservations (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid NOT NULL,
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    required_labels text[] NOT NULL CHECK (cardinality(required_labels) BETWEEN 1 AND 20),
    count integer NOT NULL CONSTRAINT reservations_count_positive_ck CHECK (count > 0),
    kind text NOT NULL DEFAULT 'launch' CHECK (kind IN ('bound', 'launch')),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX reservations_workspace_expires_idx ON reservations (workspace_id, expires_at);
CREATE INDEX reservations_expires_idx ON reservations (expires_at);
CREATE INDEX reservations_provisioner_idx ON reservations (provisioner_id, expires_at);

CREATE TABLE runner_instances (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid,
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    provider_runner_id text CHECK (length(provider_runner_id) BETWEEN 1 AND 255),
    intended_reservation_id uuid,
    reservation_id uuid,
    launch_kind text NOT NULL DEFAULT 'manual' CHECK (launch_kind IN ('demand', 'warm', 'manual')),
    assigned_at timestamptz,
    template_key text CHECK (length(template_key) BETWEEN 1 AND 255),
    labels text[] NOT NULL DEFAULT '{}',
    state text NOT NULL
        CHECK (state IN ('starting', 'running', 'stopping', 'stopped', 'failed', 'terminated')),
    reason text CHECK (length(reason) <= 1000),
    runner_session_id uuid,
    first_claimed_at timestamptz,
    provider_kind text CHECK (length(provider_kind) BETWEEN 1 AND 64),
    protocol_version text CHECK (length(protocol_version) BETWEEN 1 AND 64),
    capabilities jsonb,
    reported_at timestamptz NOT NULL,
    started_at timestamptz,
    stopping_at timestamptz,
    stopped_at timestamptz,
    failed_at timestamptz,
    terminated_at timestamptz,
    reservation_released_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX runner_instances_provider_runner_uq
    ON runner_instances (provisioner_id, provider_runner_id)
    WHERE provider_runner_id IS NOT NULL;
CREATE INDEX runner_instances_state_updated_idx
    ON runner_instances (state, updated_at, reported_at);
CREATE INDEX runner_instances_intended_idx
    ON runner_instances (provisioner_id, intended_reservation_id)
    WHERE intended_reservation_id IS NOT NULL AND reservation_released_at IS NULL;
CREATE INDEX runner_instances_intended_any_idx
    ON runner_instances (intended_reservation_id) WHERE intended_reservation_id IS NOT NULL;
CREATE INDEX runner_instances_reservation_idx
    ON runner_instances (provisioner_id, reservation_id) WHERE reservation_id IS NOT NULL;
CREATE INDEX runner_instances_active_template_idx
    ON runner_instances (provisioner_id, state, template_key)
    WHERE state IN ('starting', 'running') AND template_key IS NOT NULL;
CREATE INDEX runner_instances_workspace_idx
    ON runner_instances (workspace_id, provisioner_id) WHERE workspace_id IS NOT NULL;
CREATE INDEX runner_instances_session_idx
    ON runner_instances (runner_session_id) WHERE runner_session_id IS NOT NULL;

-- One-use credential a freshly launched machine trades for a control session.
CREATE TABLE runner_bootstrap_tokens (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    runner_instance_id uuid NOT NULL REFERENCES runner_instances (id) ON DELETE CASCADE,
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    expires_at timestamptz NOT NULL,
    consumed_at timestamptz,
    revoked_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX runner_bootstrap_tokens_instance_idx ON runner_bootstrap_tokens (runner_instance_id);
CREATE INDEX runner_bootstrap_tokens_provisioner_idx ON runner_bootstrap_tokens (provisioner_id);

-- The pre-workspace credential of a booted runner: enroll, attach, heartbeat, wait for work.
-- Its expiry is fixed when it is created and never extended.
CREATE TABLE runner_control_sessions (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    runner_instance_id uuid NOT NULL REFERENCES runner_instances (id) ON DELETE CASCADE,
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    expires_at timestamptz NOT NULL,
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    closed_at timestamptz,
    close_reason text CHECK (close_reason IN ('activated', 'provisioner-revoked')),
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX runner_control_sessions_open_uq
    ON runner_control_sessions (runner_instance_id) WHERE closed_at IS NULL;
CREATE INDEX runner_control_sessions_provisioner_idx
    ON runner_control_sessions (provisioner_id) WHERE closed_at IS NULL;

-- One-use credential an assigned runner trades for a one-claim workspace runner session.
CREATE TABLE runner_activation_tokens (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    runner_instance_id uuid NOT NULL REFERENCES runner_instances (id) ON DELETE CASCADE,
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    expires_at timestamptz NOT NULL,
    consumed_at timestamptz,
    revoked_at timestamptz,
    consumed_session_id uuid,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX runner_activation_tokens_instance_idx ON runner_activation_tokens (runner_instance_id);

-- The templates a provisioner advertised on its control session, replaced whole on every
-- advertisement. workspace_id is the provisioner's workspace (NULL for installation scope).
-- Installation allocation reads the workspace provisioners' rows to leave them their demand.
CREATE TABLE provisioner_templates (
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    template_key text NOT NULL CHECK (length(template_key) BETWEEN 1 AND 255),
    workspace_id uuid,
    labels text[] NOT NULL CHECK (cardinality(labels) BETWEEN 1 AND 20),
    available_slots integer NOT NULL CHECK (available_slots BETWEEN 0 AND 100000),
    starting integer NOT NULL CHECK (starting BETWEEN 0 AND 100000),
    running integer NOT NULL CHECK (running BETWEEN 0 AND 100000),
    idle_target integer NOT NULL DEFAULT 0 CHECK (idle_target BETWEEN 0 AND 100000),
    advertised_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provisioner_id, template_key)
);
CREATE INDEX provisioner_templates_workspace_idx
    ON provisioner_templates (workspace_id, advertised_at) WHERE workspace_id IS NOT NULL;

-- runner reports: terminal release refuses a runner with an uncancelled lease, and the stale
-- runner reaper skips one with any lease or a recently active runner session. Both look the
-- lease or session up by (provisioner, provider runner id) alone, whatever its workspace.
CREATE INDEX running_jobs_provisioner_runner_idx
    ON running_jobs (provisioner_id, provider_runner_id) WHERE provisioner_id IS NOT NULL;
CREATE INDEX runner_sessions_provisioner_runner_idx
    ON runner_sessions (provisioner_id, provider_runner_id, updated_at)
    WHERE provisioner_id IS NOT NULL;

-- demand store: reservation cleanup finds the runners assigned to the reservations it deletes
-- whatever their provisioner (runner_instances_reservation_idx leads with provisioner_id).
CREATE INDEX runner_instances_reservation_any_idx
    ON runner_instances (reservation_id) WHERE reservation_id IS NOT NULL;
