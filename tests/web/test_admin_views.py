"""Admin views: runners seen recently, and active provisioners."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import anyio
import asyncpg

from controlplane.store import provisioners
from tests.web.conftest import Api
from tests.web.control_client import hello, open_session, receive, send


async def test_active_runners_lists_recently_seen_sessions_with_their_leases(
    api: Api, db: asyncpg.Connection
) -> None:
    busy = await api.register(["linux"])
    idle = await api.register(["macos"])
    await api.enqueue(api.job(["linux"]))
    assert (await api.request_job(busy)).status_code == 200
    assert (await api.request_job(idle)).status_code == 204
    # A session not seen for two minutes is not active.
    stale = await api.register(["gpu"])
    await db.execute(
        "UPDATE runner_sessions SET updated_at = now() - interval '2 minutes'"
        " WHERE labels = ARRAY['gpu']"
    )
    del stale
    listed = await api.http.get(
        f"/v1/admin/runners?workspace_id={api.workspace}", headers=api.auth(api.admin_key)
    )
    assert listed.status_code == 200
    items = listed.json()["items"]
    by_labels = {tuple(item["labels"]): item for item in items}
    assert set(by_labels) == {("linux",), ("macos",)}
    assert by_labels[("linux",)]["running"] == 1
    assert by_labels[("macos",)]["running"] == 0
    assert all(item["mode"] == "manual" for item in items)
    other = await api.http.get(
        f"/v1/admin/runners?workspace_id={uuid.uuid4()}", headers=api.auth(api.admin_key)
    )
    assert other.json()["items"] == []
    wider = await api.http.get(
        "/v1/admin/runners?window_seconds=600", headers=api.auth(api.admin_key)
    )
    assert len(wider.json()["items"]) == 3
    for bad in ("window_seconds=0", "window_seconds=x", "workspace_id=nope"):
        refused = await api.http.get(f"/v1/admin/runners?{bad}", headers=api.auth(api.admin_key))
        assert refused.status_code == 400
    assert (await api.http.get("/v1/admin/runners")).status_code == 401


async def test_s58_active_provisioners_are_seen_recently_not_revoked_not_expired(
    api: Api, db: asyncpg.Connection
) -> None:
    tokens = {}
    for name in ("live", "silent", "revoked", "expired", "never"):
        created, raw = await provisioners.create(db, name=name, workspace_id=api.workspace)
        tokens[name] = (created.id, raw)
    for name in ("live", "silent", "revoked", "expired"):
        assert (
            await api.http.get("/v1/provisioners/me", headers=api.auth(tokens[name][1]))
        ).status_code == 200
    await db.execute(
        "UPDATE provisioner_tokens SET last_seen_at = now() - interval '121 seconds' WHERE id = $1",
        tokens["silent"][0],
    )
    await provisioners.revoke(db, tokens["revoked"][0])
    await db.execute(
        "UPDATE provisioner_tokens SET expires_at = now() WHERE id = $1", tokens["expired"][0]
    )
    admin = api.auth(api.admin_key)
    active = await api.http.get("/v1/admin/provisioner-tokens?active=true", headers=admin)
    assert [item["name"] for item in active.json()["items"]] == ["live"]
    everything = await api.http.get("/v1/admin/provisioner-tokens", headers=admin)
    assert len(everything.json()["items"]) == 5
    refused = await api.http.get("/v1/admin/provisioner-tokens?active=yes", headers=admin)
    assert refused.status_code == 400


async def test_a_provisioner_with_a_live_session_stays_active_long_after_it_connected(
    api: Api, db: asyncpg.Connection
) -> None:
    """Its token is stamped when the session opens; the live session keeps it seen after."""
    found, raw = await provisioners.create(db, name="steady", workspace_id=api.workspace)
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    # Two minutes on: the token's stamp is from the connect, the session is still talking.
    await db.execute(
        "UPDATE provisioner_tokens SET last_seen_at = now() - interval '5 minutes' WHERE id = $1",
        found.id,
    )
    await db.execute(
        "UPDATE provisioner_sessions SET last_seen_at = now() - interval '5 minutes'"
        " WHERE provisioner_id = $1",
        found.id,
    )
    await send(ws, {"type": "ping", "request_id": "p1"})
    assert await receive(ws) == {"type": "pong", "request_id": "p1"}
    # The replica stamps its pinged sessions in one batch (provisioners.session_seen_batch_seconds).
    with anyio.fail_after(10):
        while not await db.fetchval(
            "SELECT last_seen_at > now() - interval '1 minute' FROM provisioner_sessions"
            " WHERE provisioner_id = $1",
            found.id,
        ):
            await anyio.sleep(0.05)
    admin = api.auth(api.admin_key)
    active = await api.http.get("/v1/admin/provisioner-tokens?active=true", headers=admin)
    (item,) = active.json()["items"]
    assert item["name"] == "steady"
    seen = datetime.fromisoformat(item["last_seen_at"])
    now = await db.fetchval("SELECT now()")
    assert now - seen < timedelta(minutes=1)
    await ws.close()
    # Once the session is gone its last stamp ages like the token's.
    await db.execute(
        "UPDATE provisioner_sessions SET last_seen_at = now() - interval '5 minutes'"
        " WHERE provisioner_id = $1",
        found.id,
    )
    after = await api.http.get("/v1/admin/provisioner-tokens?active=true", headers=admin)
    assert after.json()["items"] == []
