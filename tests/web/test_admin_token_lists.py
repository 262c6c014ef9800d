"""The admin token lists (API keys, registration tokens, provisioner tokens), a page at a time,
over real HTTP: `limit` 1-100, an opaque `cursor` on (created_at, id) descending, `next_cursor`
null on the last page. Admin keys are installation-wide, so the provisioner list holds tokens of
both scopes (the reference's lists installation tokens only, spec S-66)."""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from controlplane.store import credentials, provisioners
from tests.web.conftest import Api

KINDS = ("api-keys", "registration-tokens", "provisioner-tokens")


async def _list(api: Api, kind: str, **query: Any) -> httpx.Response:
    return await api.http.get(f"/v1/admin/{kind}", params=query, headers=api.auth(api.admin_key))


async def _pages(api: Api, kind: str, **query: Any) -> list[list[str]]:
    """Every page, following `next_cursor`, as lists of ids."""
    pages: list[list[str]] = []
    cursor: str | None = None
    while True:
        answer = await _list(api, kind, **query, **({} if cursor is None else {"cursor": cursor}))
        assert answer.status_code == 200, answer.text
        pages.append([item["id"] for item in answer.json()["items"]])
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            return pages


async def _make(api: Api, db: asyncpg.Connection, kind: str, count: int) -> list[UUID]:
    """`count` more tokens of `kind`, oldest first."""
    made = []
    for n in range(count):
        if kind == "api-keys":
            created, _ = await credentials.create_api_key(db, kind="orchestrator", name=f"k{n}")
        elif kind == "registration-tokens":
            created, _ = await credentials.create_manual_token(
                db, workspace_id=api.workspace, name=f"t{n}"
            )
        else:
            found, _ = await provisioners.create(db, name=f"p{n}", workspace_id=None)
            made.append(found.id)
            continue
        made.append(created.id)
    return made


TABLES = {
    "api-keys": "api_keys",
    "registration-tokens": "manual_registration_tokens",
    "provisioner-tokens": "provisioner_tokens",
}


async def _ids_newest_first(db: asyncpg.Connection, kind: str) -> list[str]:
    rows = await db.fetch(f"SELECT id FROM {TABLES[kind]} ORDER BY created_at DESC, id DESC")  # noqa: S608 -- interpolates constants only: TABLES
    return [str(row["id"]) for row in rows]


@pytest.mark.parametrize("kind", KINDS)
async def test_s68_pages_follow_the_cursor_to_a_null_last_page(
    api: Api, db: asyncpg.Connection, kind: str
) -> None:
    made = await _make(api, db, kind, 4)
    # Two rows created at the same instant are told apart by id, each listed exactly once.
    await db.execute(
        f"UPDATE {TABLES[kind]} SET created_at = (SELECT min(created_at) FROM {TABLES[kind]})"  # noqa: S608 -- interpolates constants only: TABLES
        " WHERE id = ANY($1::uuid[])",
        made[1:3],
    )
    expected = await _ids_newest_first(db, kind)
    assert {str(token) for token in made} <= set(expected)  # with the fixture's own
    for limit in (1, 2, 3):
        pages = await _pages(api, kind, limit=limit)
        assert pages == [expected[i : i + limit] for i in range(0, len(expected), limit)], limit
    whole = await _list(api, kind)  # default 50: one page
    assert [item["id"] for item in whole.json()["items"]] == expected
    assert whole.json()["next_cursor"] is None
    exact = await _list(api, kind, limit=len(expected))  # no empty page after a full one
    assert exact.json()["next_cursor"] is None


async def test_s68_the_default_page_is_50_and_the_largest_100(
    api: Api, db: asyncpg.Connection
) -> None:
    await _make(api, db, "provisioner-tokens", 101)
    default = (await _list(api, "provisioner-tokens")).json()
    assert (len(default["items"]), default["next_cursor"] is not None) == (50, True)
    largest = (await _list(api, "provisioner-tokens", limit=100)).json()
    assert len(largest["items"]) == 100
    rest = (await _list(api, "provisioner-tokens", cursor=largest["next_cursor"])).json()
    assert (len(rest["items"]), rest["next_cursor"]) == (1, None)


async def test_s68_filters_page_with_the_cursor(api: Api, db: asyncpg.Connection) -> None:
    other = UUID(int=7)
    mine = await _make(api, db, "registration-tokens", 2)
    await credentials.create_manual_token(db, workspace_id=other, name="elsewhere")
    pages = await _pages(api, "registration-tokens", workspace_id=str(api.workspace), limit=1)
    fixture = await db.fetchval("SELECT id FROM manual_registration_tokens WHERE name = 'runners'")
    assert [page[0] for page in pages] == [str(mine[1]), str(mine[0]), str(fixture)]


async def test_s66_the_active_provisioners_page_without_tokens_or_hashes(
    api: Api, db: asyncpg.Connection
) -> None:
    """Active: seen within 120 s, not revoked, not expired; of either scope (our admin keys
    are installation-wide, where the reference lists installation tokens only)."""
    raws: dict[str, str] = {}
    ids: dict[str, UUID] = {}
    for name, workspace in (("installation", None), ("workspace", api.workspace),
                            ("revoked", None), ("silent", None)):  # fmt: skip
        created, raws[name] = await provisioners.create(db, name=name, workspace_id=workspace)
        ids[name] = created.id
    for name in ("installation", "workspace", "revoked"):
        me = await api.http.get("/v1/provisioners/me", headers=api.auth(raws[name]))
        assert me.status_code == 200
    await provisioners.revoke(db, ids["revoked"])
    pages = await _pages(api, "provisioner-tokens", active="true", limit=1)
    assert pages == [[str(ids["workspace"])], [str(ids["installation"])]]
    listed = await _list(api, "provisioner-tokens", active="true")
    assert {item["scope"] for item in listed.json()["items"]} == {"installation", "workspace"}
    everything = await _list(api, "provisioner-tokens")
    assert len(everything.json()["items"]) == 4
    for raw in raws.values():
        digest = hashlib.sha256(raw.encode()).hexdigest()
        for answer in (listed, everything):
            assert raw not in answer.text and digest not in answer.text
    assert all("token" not in item for item in everything.json()["items"])


@pytest.mark.parametrize("kind", KINDS)
async def test_s67_bad_limits_cursors_and_parameters_are_400(
    api: Api, db: asyncpg.Connection, kind: str
) -> None:
    await _make(api, db, kind, 2)
    for bad in ({"limit": 0}, {"limit": 101}, {"limit": "ten"}, {"limit": -1},
                {"colour": "red"}, {"after": "x"}):  # fmt: skip
        refused = await _list(api, kind, **bad)
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["code"] == "validation-error", bad
    for cursor in ("not-a-cursor", "", "e30", "eyJpZCI6IDF9"):  # e30: {}; then {"id": 1}
        refused = await _list(api, kind, cursor=cursor)
        assert refused.status_code == 400, cursor
        assert refused.json()["error"]["code"] == "invalid-cursor", cursor
    assert (await api.http.get(f"/v1/admin/{kind}", params={"limit": 0})).status_code == 401
