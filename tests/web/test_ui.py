"""The operator pages over real HTTP against an in-process daemon: sign-in and its cookie, the
session kept hashed and ended with its key, CSRF on every form, audit entries, secrets masked,
the one-time link, and the live stream's notice on an enqueue."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import anyio
import asyncpg
import httpx

from controlplane.domain.credentials import Role
from controlplane.store import credentials, ui_sessions
from tests.web.conftest import Api

_HIDDEN = re.compile(r'name="(pair|csrf)" value="([^"]+)"')


def _hidden(html: str, name: str) -> str:
    found: dict[str, str] = dict(_HIDDEN.findall(html))
    return found[name]


@asynccontextmanager
async def browser(api: Api) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.daemon.address, timeout=30) as client:
        yield client


async def sign_in(client: httpx.AsyncClient, key: str) -> httpx.Response:
    form = await client.get("/ui/sign-in")
    assert form.status_code == 200
    return await client.post("/ui/sign-in", data={"pair": _hidden(form.text, "pair"), "key": key})


async def _events(db: asyncpg.Connection, kind: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM events WHERE event_type = $1 ORDER BY seq", kind)


async def test_root_redirects_and_pages_need_a_session_while_the_api_keeps_its_404(
    api: Api,
) -> None:
    async with browser(api) as client:
        root = await client.get("/")
        assert root.status_code == 307 and root.headers["location"] == "/ui/"
        page = await client.get("/ui/")
        assert page.status_code == 303 and page.headers["location"] == "/ui/sign-in"
        missing = await client.get("/v1/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not-found"
        live = await client.get("/ui/live")
        assert live.status_code == 401


async def test_sign_in_sets_a_strict_http_only_cookie_kept_hashed_and_audited(
    api: Api, db: asyncpg.Connection
) -> None:
    async with browser(api) as client:
        response = await sign_in(client, api.admin_key)
        assert response.status_code == 303 and response.headers["location"] == "/ui/"
        cookie = response.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie
        secret = client.cookies["cp_ui_session"]
        stored = await db.fetch("SELECT token_sha256 FROM ui_sessions")
        assert [row["token_sha256"] for row in stored] == [
            hashlib.sha256(secret.encode()).hexdigest()
        ]
        overview = await client.get("/ui/")
        assert overview.status_code == 200 and "Overview" in overview.text
        assert api.admin_key not in overview.text and secret not in overview.text
        assert "default-src 'self'" in overview.headers["content-security-policy"]
    (entry,) = await _events(db, "ui.signed_in")
    assert entry["payload"] and api.admin_key not in entry["payload"]


async def test_a_wrong_key_or_a_sign_in_form_from_elsewhere_is_refused(api: Api) -> None:
    async with browser(api) as client:
        wrong = await sign_in(client, api.orchestrator_key)
        assert wrong.status_code == 401 and "not an admin key" in wrong.text
        form = await client.get("/ui/sign-in")
        no_pair = await client.post("/ui/sign-in", data={"pair": "x", "key": api.admin_key})
        assert no_pair.status_code == 403
        elsewhere = await client.post(
            "/ui/sign-in",
            data={"pair": _hidden(form.text, "pair"), "key": api.admin_key},
            headers={"Origin": "https://evil.example"},
        )
        assert elsewhere.status_code == 403
        assert "cp_ui_session" not in client.cookies


async def test_every_page_renders_and_a_stuck_job_says_why(api: Api) -> None:
    stuck = api.job(["linux", "gpu"], payload={"script": "true", "env": {"TOKEN": "s3cr3t-v4lue"}})
    assert (await api.enqueue(stuck)).status_code in (200, 201)
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        for path in ("/ui/", "/ui/jobs", "/ui/runners", "/ui/provisioners", "/ui/credentials"):
            page = await client.get(path)
            assert page.status_code == 200, (path, page.text)
            assert "s3cr3t-v4lue" not in page.text
        assert api.daemon.replica is not None
        await api.daemon.replica.history.sample()
        overview = await client.get("/ui/")
        assert 'class="stuck"' in overview.text and "gpu" in overview.text
        assert f"<code>{api.workspace}</code></td><td><svg" in overview.text
        assert "Drawn at this replica's latest sample" in overview.text
        job = await client.get(f"/ui/jobs/{stuck['job_execution_id']}")
        assert job.status_code == 200
        assert "Stuck:" in job.text and "TOKEN" in job.text and "s3cr3t-v4lue" not in job.text
        filtered = await client.get("/ui/jobs", params={"labels": "gpu", "status": "pending"})
        assert stuck["job_execution_id"] in filtered.text
        bad = await client.get("/ui/jobs", params={"status": "sideways"})
        assert bad.status_code == 400


async def test_cancel_needs_the_sessions_csrf_token_and_is_audited(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job()
    await api.enqueue(job)
    execution = job["job_execution_id"]
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        page = await client.get(f"/ui/jobs/{execution}")
        csrf = _hidden(page.text, "csrf")
        path = f"/ui/jobs/{execution}/cancel"
        assert (await client.post(path, data={"nothing": ""})).status_code == 403
        assert (await client.post(path, data={"csrf": "0" * 64})).status_code == 403
        other_origin = await client.post(
            path, data={"csrf": csrf}, headers={"Origin": "http://elsewhere.example"}
        )
        assert other_origin.status_code == 403
        as_json = await client.post(path, json={"csrf": csrf})
        assert as_json.status_code == 400
        assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 1
        done = await client.post(path, data={"csrf": csrf})
        assert done.status_code == 303
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 0
    (entry,) = await _events(db, "ui.job_cancelled")
    assert str(entry["job_execution_id"]) == execution


async def test_an_owner_pauses_and_resumes_a_workspace_and_a_runner_from_the_pages(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job()
    await api.enqueue(job)
    session = await api.register(["linux"])
    session_id = await db.fetchval("SELECT id FROM runner_sessions")
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        overview = await client.get("/ui/")
        csrf = _hidden(overview.text, "csrf")
        pause = f"/ui/workspaces/{api.workspace}/pause"
        assert f'action="{pause}"' in overview.text
        assert (await client.post(pause, data={"nothing": ""})).status_code == 403
        assert (await client.post(pause, data={"csrf": csrf})).status_code == 303
        overview = await client.get("/ui/")
        assert "paused: nothing is handed out" in overview.text
        assert f'action="/ui/workspaces/{api.workspace}/resume"' in overview.text
        # The queue itself is paused: the runner's claim finds nothing.
        assert (await api.request_job(session)).status_code == 204
        runners = await client.get("/ui/runners")
        pause_runner = f"/ui/runners/{session_id}/pause"
        assert f'action="{pause_runner}"' in runners.text
        done = await client.post(pause_runner, data={"csrf": csrf, "reason": "new disk"})
        assert done.status_code == 303
        assert "idle, paused" in (await client.get("/ui/runners")).text
        resume = f"/ui/workspaces/{api.workspace}/resume"
        assert (await client.post(resume, data={"csrf": csrf})).status_code == 303
        assert (
            await client.post(f"/ui/runners/{session_id}/resume", data={"csrf": csrf})
        ).status_code == 303
    claimed = await api.request_job(session)
    assert claimed.json()["job_execution_id"] == job["job_execution_id"]
    changes = await db.fetch(
        "SELECT event_type, payload->>'by' AS by, payload->>'reason' AS reason FROM events"
        " WHERE event_type LIKE 'workspace.%' OR event_type LIKE 'runner.%' ORDER BY seq"
    )
    key_id = await db.fetchval("SELECT id::text FROM api_keys WHERE name = 'ops'")
    assert [(c["event_type"], c["by"], c["reason"]) for c in changes] == [
        ("workspace.paused", key_id, None),
        ("runner.paused", key_id, "new disk"),
        ("workspace.resumed", key_id, None),
        ("runner.resumed", key_id, None),
    ]


async def test_revoking_the_admin_key_ends_its_sessions(api: Api, db: asyncpg.Connection) -> None:
    key, raw = await credentials.create_api_key(db, kind="admin", name="short lived")
    async with browser(api) as client:
        await sign_in(client, raw)
        assert (await client.get("/ui/")).status_code == 200
        await credentials.revoke_api_key(db, key.id, reason="test")
        assert (await client.get("/ui/")).status_code == 303


async def test_sign_out_ends_the_session(api: Api) -> None:
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        page = await client.get("/ui/")
        secret = client.cookies["cp_ui_session"]
        out = await client.post("/ui/sign-out", data={"csrf": _hidden(page.text, "csrf")})
        assert out.status_code == 303
        client.cookies.set("cp_ui_session", secret)  # a copied cookie no longer works either
        assert (await client.get("/ui/")).status_code == 303


async def test_a_sign_in_link_works_once(api: Api, db: asyncpg.Connection) -> None:
    key = await credentials.api_key_by_digest(
        db, "admin", hashlib.sha256(api.admin_key.encode()).hexdigest()
    )
    assert key is not None
    link = await ui_sessions.create_link(db, key.id, timedelta(minutes=5))
    async with browser(api) as first:
        opened = await first.get(f"/ui/sign-in/{link}")
        assert opened.status_code == 303
        assert (await first.get("/ui/")).status_code == 200
    async with browser(api) as second:
        again = await second.get(f"/ui/sign-in/{link}")
        assert again.status_code == 401 and "cp_ui_session" not in second.cookies


async def test_credentials_are_created_shown_once_and_revoked(
    api: Api, db: asyncpg.Connection
) -> None:
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        page = await client.get("/ui/credentials")
        csrf = _hidden(page.text, "csrf")
        made = await client.post(
            "/ui/credentials",
            data={"csrf": csrf, "family": "orchestrator", "name": "from the page"},
        )
        assert made.status_code == 201
        token = re.search(r'id="new-token">([^<]+)<', made.text)
        assert token is not None and token.group(1).startswith("cp_oak_")
        listed = await client.get("/ui/credentials")
        assert "from the page" in listed.text and token.group(1) not in listed.text
        row = await db.fetchrow("SELECT id FROM api_keys WHERE name = 'from the page'")
        assert row is not None
        revoked = await client.post(
            f"/ui/credentials/orchestrator/{row['id']}/revoke", data={"csrf": csrf}
        )
        assert revoked.status_code == 303
        assert await db.fetchval("SELECT revoked_at FROM api_keys WHERE id = $1", row["id"])
        bad = await client.post(
            "/ui/credentials", data={"csrf": csrf, "family": "admin", "name": ""}
        )
        assert bad.status_code == 400
    kinds = [row["event_type"] for row in await db.fetch("SELECT event_type FROM events")]
    assert "ui.credential_created" in kinds and "ui.credential_revoked" in kinds


async def test_the_live_stream_says_change_when_a_job_is_enqueued(api: Api) -> None:
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        async with client.stream("GET", "/ui/live") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            with anyio.fail_after(10):
                assert (await anext(lines)).startswith("retry:")
                await api.enqueue(api.job([f"l{uuid.uuid4().hex[:8]}"]))
                while (line := await anext(lines)) != "event: change":
                    assert line in ("", ": keepalive"), line


async def test_an_observer_sees_no_buttons_and_gets_403(api: Api, db: asyncpg.Connection) -> None:
    """An `observer` admin key signs in and reads every page, but no page offers an action and a
    form posted by hand is 403 (roles.may_act is every permission decision of the pages)."""
    _, observer = await credentials.create_api_key(
        db, kind="admin", name="watcher", role=Role.OBSERVER
    )
    job = api.job()
    await api.enqueue(job)
    async with browser(api) as client:
        await sign_in(client, observer)
        page = await client.get(f"/ui/jobs/{job['job_execution_id']}")
        assert "Cancel this job" not in page.text and "read only" in page.text
        assert "/pause" not in (await client.get("/ui/")).text
        assert "/pause" not in (await client.get("/ui/runners")).text
        credentials_page = await client.get("/ui/credentials")
        assert "Revoke" not in credentials_page.text and 'action="/ui/credentials"' not in (
            credentials_page.text
        )
        csrf = _hidden(page.text, "csrf")  # the sign-out form still carries it
        cancel = await client.post(
            f"/ui/jobs/{job['job_execution_id']}/cancel", data={"csrf": csrf}
        )
        assert cancel.status_code == 403
        create = await client.post(
            "/ui/credentials", data={"csrf": csrf, "family": "orchestrator", "name": "no"}
        )
        assert create.status_code == 403
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 1
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE name = 'no'") == 0
