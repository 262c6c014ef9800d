"""Admin views of the provisioned fleet: runner instances (listed, active, counted) and live
reservations, over real HTTP. Our admin key is installation-wide and has no roles, so every
provisioner's instances are listed (the reference lists installation provisioners' only) and
there is no role check to refuse (spec S-71 does not apply)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import httpx

from tests import provisioning
from tests.web.conftest import Api

HOUR = timedelta(hours=1)


async def _get(api: Api, path: str, **query: Any) -> httpx.Response:
    return await api.http.get(f"/v1/admin{path}", params=query, headers=api.auth(api.admin_key))


async def _ids(api: Api, **query: Any) -> list[str]:
    response = await _get(api, "/runner-instances", **query)
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["items"]]


async def test_s72_the_label_filter_ignores_case_and_every_scope_is_listed(
    api: Api, db: asyncpg.Connection
) -> None:
    """S-72 lists installation provisioners' instances only; ours lists both scopes."""
    workspace = await provisioning.provisioner(db, api.workspace)
    installation = await provisioning.provisioner(db, None)
    gpu = await provisioning.runner(db, workspace.id, labels=("gpu", "linux"))
    plain = await provisioning.runner(db, installation.id, labels=("linux",))
    assert await _ids(api, label="GPU") == [str(gpu)]
    assert await _ids(api, label="LiNuX") == [str(plain), str(gpu)]  # newest first
    assert await _ids(api, provisioner_id=str(installation.id)) == [str(plain)]
    listed = (await _get(api, "/runner-instances")).json()["items"]
    assert {item["provisioner"]["scope"] for item in listed} == {"workspace", "installation"}
    assert (await _get(api, "/runner-instances", label="has space")).status_code == 400


async def test_runner_instance_rows_carry_their_derived_states(
    api: Api, db: asyncpg.Connection
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    await db.execute("UPDATE provisioner_tokens SET last_seen_at = now() WHERE id = $1", p.id)
    ws = api.workspace
    rows = {
        "pending": await provisioning.runner(db, p.id, state="starting", control_session=None),
        "enrolled": await provisioning.runner(db, p.id),
        "assigned": await provisioning.runner(db, p.id, workspace_id=ws, assigned=True),
        "activated": await provisioning.runner(
            db, p.id, workspace_id=ws, assigned=True, runner_session_id=uuid.uuid4()
        ),
        "completed": await provisioning.runner(db, p.id, workspace_id=ws, state="stopped"),
        "stale": await provisioning.runner(db, p.id, reported_age=HOUR),
    }
    await db.execute(
        "UPDATE runner_instances SET first_claimed_at = now(), stopped_at = now() WHERE id = $1",
        rows["completed"],
    )
    listed = {item["id"]: item for item in (await _get(api, "/runner-instances")).json()["items"]}

    def row(name: str) -> dict[str, Any]:
        found: dict[str, Any] = listed[str(rows[name])]
        return found

    assert row("pending")["lifecycle_state"] == "unassigned"
    assert row("pending")["enrollment_state"] == "pending"
    assert row("enrolled")["enrollment_state"] == "enrolled"
    assert row("assigned")["lifecycle_state"] == "assigned"
    assert row("activated")["lifecycle_state"] == "activated"
    assert row("activated")["enrollment_state"] == "activated"
    assert row("completed")["lifecycle_state"] == "completed"
    assert row("completed")["reconciliation_status"] == "terminal"
    assert row("completed")["closed_at"] is not None
    assert row("enrolled")["reconciliation_status"] == "current"
    assert row("stale")["reconciliation_status"] == "stale"
    never_seen = await provisioning.provisioner(db, api.workspace)
    unknown = await provisioning.runner(db, never_seen.id)
    [item] = (await _get(api, "/runner-instances", provisioner_id=str(never_seen.id))).json()[
        "items"
    ]
    assert (item["id"], item["reconciliation_status"]) == (str(unknown), "unknown")

    assert set(await _ids(api, state="stopped")) == {str(rows["completed"])}
    assigned = {str(rows[n]) for n in ("assigned", "activated", "completed")}
    assert set(await _ids(api, assignment="assigned")) == assigned
    assert set(await _ids(api, workspace_id=str(ws))) == assigned
    assert not set(await _ids(api, assignment="unassigned")) & assigned


async def test_pages_follow_the_cursor_and_bad_queries_are_400(
    api: Api, db: asyncpg.Connection
) -> None:
    p = await provisioning.provisioner(db, None)
    made = [await provisioning.runner(db, p.id, age=timedelta(minutes=n)) for n in range(3)]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        query = {"limit": 1} | ({} if cursor is None else {"cursor": cursor})
        page = (await _get(api, "/runner-instances", **query)).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [str(r) for r in made]  # newest (least backdated) first
    for bad in ({"limit": 0}, {"limit": 101}, {"state": "gone"}, {"assignment": "maybe"},
                {"workspace_id": "nope"}, {"colour": "red"}):  # fmt: skip
        refused = await _get(api, "/runner-instances", **bad)
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["code"] == "validation-error"
    for cursor in ("not-a-cursor", ""):
        refused = await _get(api, "/runner-instances", cursor=cursor)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid-cursor"
    assert (await api.http.get("/v1/admin/runner-instances")).status_code == 401


async def test_p87_the_active_window_uses_server_updated_at(
    api: Api, db: asyncpg.Connection
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    ws = api.workspace
    # Reported an hour ago, but the server touched the row just now: active.
    recent = await provisioning.runner(db, p.id, workspace_id=ws, reported_age=HOUR)
    quiet = await provisioning.runner(db, p.id, workspace_id=ws)
    await db.execute(
        "UPDATE runner_instances SET updated_at = now() - interval '61 seconds',"
        " reported_at = now() WHERE id = $1",
        quiet,
    )  # reported just now, but the row is older than the 60 s window
    await provisioning.runner(db, p.id, workspace_id=ws, state="stopped")
    await provisioning.runner(db, p.id, workspace_id=uuid.uuid4())
    answer = await _get(api, "/runner-instances/active", workspace_id=str(ws))
    assert answer.status_code == 200, answer.text
    assert [item["id"] for item in answer.json()["items"]] == [str(recent)]
    for bad in ({}, {"workspace_id": "x"}, {"workspace_id": str(ws), "window_seconds": 5}):
        assert (await _get(api, "/runner-instances/active", **bad)).status_code == 400, bad


async def test_reservations_and_instance_counts(api: Api, db: asyncpg.Connection) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    for count in (2, 3):
        await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=p.id,
                                       count=count)  # fmt: skip
    expired = await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=p.id)
    await db.execute(
        "UPDATE reservations SET expires_at = now() - interval '1 second' WHERE id = $1", expired
    )
    await provisioning.runner(db, p.id)
    await provisioning.runner(db, p.id, state="failed")
    groups = (await _get(api, "/reservations")).json()["items"]
    assert [(g["workspace_id"], g["labels"], g["kind"], g["reservations"], g["units"])
            for g in groups] == [(str(api.workspace), ["linux"], "launch", 2, 5)]  # fmt: skip
    other = (await _get(api, "/reservations", workspace_id=str(uuid.uuid4()))).json()
    assert other["items"] == []
    counts = (await _get(api, "/runner-instances/counts")).json()
    assert counts == {"states": [{"state": "running", "count": 1}, {"state": "failed", "count": 1}]}
    assert (await _get(api, "/reservations", limit=5)).status_code == 400
    assert (await _get(api, "/runner-instances/counts", x=1)).status_code == 400
