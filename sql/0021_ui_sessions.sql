-- Operator pages (issue 15): browser sessions signed in with an admin key, and the one-time
-- sign-in links `controlplane dev` prints. Both keep only the SHA-256 hex of their secret; both
-- hang off the admin key, so revoking or expiring the key ends them (the lookup joins the key
-- and applies its rules), and deleting it deletes them.

CREATE TABLE ui_sessions (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    api_key_id uuid NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    signed_out_at timestamptz
);
CREATE INDEX ui_sessions_api_key_idx ON ui_sessions (api_key_id);
CREATE INDEX ui_sessions_expires_idx ON ui_sessions (expires_at);

CREATE TABLE ui_sign_in_links (
    id uuid PRIMARY KEY DEFAULT uuidv7(),
    api_key_id uuid NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    token_sha256 text NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    used_at timestamptz
);
