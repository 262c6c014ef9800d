-- Provisioner tokens. The token id is the provisioner id used by sessions, leases and (later)
-- runner instances and reservations. Stored only as SHA-256 hex.

CREATE TABLE provisioner_tokens (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    scope text NOT NULL CHECK (scope IN ('workspace', 'installation')),
    workspace_id uuid,
    name text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    display_prefix text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz,
    last_seen_at timestamptz,
    CONSTRAINT provisioner_tokens_scope_ck CHECK (
        (scope = 'workspace') = (workspace_id IS NOT NULL)
    )
);
CREATE INDEX provisioner_tokens_workspace_idx ON provisioner_tokens (workspace_id, created_at DESC);
