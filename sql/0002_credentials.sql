-- Credentials: signing keys for session and lease tokens, orchestrator and admin API keys, and
-- manual registration tokens. Opaque tokens are stored only as SHA-256 hex.

CREATE TABLE signing_keys (
    kid text PRIMARY KEY CHECK (kid ~ '^[0-9a-f]{8,32}$'),
    secret bytea NOT NULL CHECK (octet_length(secret) >= 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    retired_at timestamptz
);

-- Orchestrator and admin API keys. workspace_id NULL: every workspace (installation scope).
CREATE TABLE api_keys (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    kind text NOT NULL CHECK (kind IN ('orchestrator', 'admin')),
    name text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    workspace_id uuid,
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz,
    last_used_at timestamptz,
    CONSTRAINT api_keys_admin_installation_ck CHECK (kind <> 'admin' OR workspace_id IS NULL)
);

CREATE TABLE manual_registration_tokens (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    workspace_id uuid NOT NULL,
    name text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz
);
CREATE INDEX manual_registration_tokens_workspace_idx
    ON manual_registration_tokens (workspace_id, created_at DESC);
