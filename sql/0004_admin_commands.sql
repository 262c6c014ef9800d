-- Idempotent admin creates: one row per (actor, Idempotency-Key). Never the raw token: only the
-- SHA-256 of the token the request derived, to check that a replay re-derives the same one.

CREATE TABLE admin_commands (
    actor_id uuid NOT NULL,
    key_sha256 text NOT NULL CHECK (key_sha256 ~ '^[0-9a-f]{64}$'),
    command text NOT NULL,
    request_sha256 text NOT NULL CHECK (request_sha256 ~ '^[0-9a-f]{64}$'),
    target_id uuid NOT NULL,
    token_sha256 text NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (actor_id, key_sha256)
);
