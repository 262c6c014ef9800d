"""`controlplane tokens` for workspace admin keys and admin key roles, as a process."""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest

from tests.system.test_cli import run_cli

pytestmark = pytest.mark.system


async def test_tokens_create_a_workspace_admin_key_and_an_observer(database_url: str) -> None:
    workspace = str(uuid.uuid4())
    created = await run_cli(
        database_url, "tokens", "create", "workspace-admin", "--name", "team", "--workspace",
        workspace, "--role", "observer",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    body = json.loads(created.stdout)
    assert body["token"].startswith("cp_wak_")
    assert body["credential"]["kind"] == "workspace-admin"
    assert body["credential"]["workspace_id"] == workspace
    assert body["credential"]["role"] == "observer"
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT role, token_sha256 FROM api_keys")
        assert row is not None
        assert row["role"] == "observer"
        assert body["token"] not in row["token_sha256"]
    finally:
        await conn.close()
    listed = await run_cli(database_url, "tokens", "list", "workspace-admin")
    assert json.loads(listed.stdout.splitlines()[0])["role"] == "observer"
    owner = await run_cli(database_url, "tokens", "create", "admin", "--name", "ops")
    assert json.loads(owner.stdout)["credential"]["role"] == "owner"


async def test_tokens_refuse_a_workspace_key_without_workspace_and_an_observer_orchestrator(
    database_url: str,
) -> None:
    unscoped = await run_cli(database_url, "tokens", "create", "workspace-admin", "--name", "x")
    assert unscoped.returncode == 2
    assert "--workspace" in unscoped.stderr
    observer = await run_cli(
        database_url, "tokens", "create", "orchestrator", "--name", "x", "--role", "observer"
    )
    assert observer.returncode == 2
    assert "--role" in observer.stderr


async def test_tokens_eligibility_shows_and_sets_an_installation_provisioners(
    database_url: str,
) -> None:
    created = await run_cli(database_url, "tokens", "create", "provisioner", "--name", "fleet")
    token_id = json.loads(created.stdout)["credential"]["id"]
    shown = await run_cli(database_url, "tokens", "eligibility", token_id)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["mode"] == "all"
    workspace = str(uuid.uuid4())
    denied = await run_cli(database_url, "tokens", "eligibility", token_id, "--deny", workspace)
    assert denied.returncode == 0, denied.stderr
    assert json.loads(denied.stdout)["workspace_ids"] == [workspace]
    again = await run_cli(database_url, "tokens", "eligibility", token_id)
    assert json.loads(again.stdout)["mode"] == "deny"
    repeated = await run_cli(
        database_url, "tokens", "eligibility", token_id, "--allow", workspace, workspace
    )
    assert repeated.returncode == 2
    assert "repeat" in repeated.stderr
    reset = await run_cli(database_url, "tokens", "eligibility", token_id, "--all")
    assert json.loads(reset.stdout)["mode"] == "all"
    unknown = await run_cli(database_url, "tokens", "eligibility", str(uuid.uuid4()))
    assert unknown.returncode == 2
