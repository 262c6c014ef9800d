-- The provisioner control session's fencing row: one per provisioner (= provisioner token id).
-- Every accepted hello bumps `generation` in one statement and NOTIFYs cp_provisioner_takeover
-- with "<provisioner_id>:<generation>"; the session holding the current generation is the only
-- live one, cluster-wide. Any later write on behalf of a session must check its generation in
-- the same statement (WHERE provisioner_id = $1 AND generation = $2).

CREATE TABLE provisioner_sessions (
    provisioner_id uuid PRIMARY KEY REFERENCES provisioner_tokens (id) ON DELETE CASCADE,
    generation bigint NOT NULL CHECK (generation > 0),
    session_id uuid NOT NULL,
    connected_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
