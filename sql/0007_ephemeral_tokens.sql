-- Ephemeral registration tokens (spec provisioning 1.9, 4.15): one-use credentials a provisioner
-- mints for a provider runner over its control session; POST /v1/runners/register trades one for
-- a one-claim `ephemeral` runner session. Statements, locks and rules:
-- controlplane/store/ephemeral.py.
--
-- workspace_id and provider_runner_id are NOT NULL (the reference's migration leaves them
-- nullable by mistake; its app always writes both). No foreign key to reservations (a reservation
-- row is deleted when used up or expired) nor to runner_sessions (sessions are collected on their
-- own clock). "One active (unconsumed, unexpired) token per (workspace, provisioner, provider
-- runner)" depends on the clock, so no index can hold it: minting holds an advisory lock instead.

CREATE TABLE ephemeral_registration_tokens (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid NOT NULL,
    provisioner_id uuid NOT NULL REFERENCES provisioner_tokens (id),
    reservation_id uuid,
    provider_runner_id text NOT NULL CHECK (length(provider_runner_id) BETWEEN 1 AND 255),
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    expires_at timestamptz NOT NULL,
    consumed_at timestamptz,
    consumed_session_id uuid,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ephemeral_registration_tokens_consumed_ck
        CHECK (consumed_session_id IS NULL OR consumed_at IS NOT NULL)
);
-- batch mint: tokens already minted for a reservation
CREATE INDEX ephemeral_registration_tokens_reservation_idx
    ON ephemeral_registration_tokens (reservation_id) WHERE reservation_id IS NOT NULL;
-- mint (active token of a provider runner) and reports (its latest consumed session)
CREATE INDEX ephemeral_registration_tokens_runner_idx
    ON ephemeral_registration_tokens
       (workspace_id, provisioner_id, provider_runner_id, consumed_at, expires_at);
-- garbage collection: consumed or expired, oldest first
CREATE INDEX ephemeral_registration_tokens_gc_idx
    ON ephemeral_registration_tokens ((coalesce(consumed_at, expires_at)), id);

-- The registration rate limiter: one row per token that was presented, a fixed window starting
-- at the first attempt of the window, and the attempts counted in it (refused ones included).
-- It lives in PostgreSQL so that every replica counts against the same window, and it goes away
-- with its token (ON DELETE CASCADE), so it needs no pruning of its own.
CREATE TABLE ephemeral_registration_attempts (
    token_id uuid PRIMARY KEY REFERENCES ephemeral_registration_tokens (id) ON DELETE CASCADE,
    window_start timestamptz NOT NULL,
    attempts integer NOT NULL CHECK (attempts > 0)
);
