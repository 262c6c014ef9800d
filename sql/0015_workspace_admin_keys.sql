-- Workspace admin keys and admin key roles (issue 17).
--
-- A workspace admin key (kind 'workspace-admin', `cp_wak_`) manages one workspace's manual
-- registration and provisioner tokens and views its runners and provisioners; it always names
-- its workspace. An admin key of either kind has a role: 'owner' may do everything its routes
-- allow, 'observer' only reads (GET). Orchestrator keys have no role beyond the default.

ALTER TABLE api_keys DROP CONSTRAINT api_keys_kind_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_kind_check
    CHECK (kind IN ('orchestrator', 'admin', 'workspace-admin'));
ALTER TABLE api_keys ADD CONSTRAINT api_keys_workspace_admin_scoped_ck
    CHECK (kind <> 'workspace-admin' OR workspace_id IS NOT NULL);

ALTER TABLE api_keys ADD COLUMN role text NOT NULL DEFAULT 'owner'
    CHECK (role IN ('owner', 'observer'));
ALTER TABLE api_keys ADD CONSTRAINT api_keys_orchestrator_role_ck
    CHECK (kind <> 'orchestrator' OR role = 'owner');
