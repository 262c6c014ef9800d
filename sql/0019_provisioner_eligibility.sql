-- Installation-scope eligibility (issue 17, spec 3.5): which workspaces an installation
-- provisioner may serve. No row: every workspace (the default). 'allow': only those listed;
-- 'deny': every workspace but those listed. Only installation-scope tokens have a row (the store
-- refuses the others); the row goes with its token.

CREATE TABLE provisioner_eligibility (
    provisioner_id uuid PRIMARY KEY REFERENCES provisioner_tokens (id) ON DELETE CASCADE,
    mode text NOT NULL CHECK (mode IN ('allow', 'deny')),
    workspace_ids uuid[] NOT NULL CHECK (cardinality(workspace_ids) <= 10000),
    updated_at timestamptz NOT NULL DEFAULT now()
);
