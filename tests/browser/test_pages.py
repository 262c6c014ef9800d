"""The operator pages in Chromium against real daemon processes: sign in, a page on replica A
updated live by an enqueue through replica B, cancel from the job page reaching a held heartbeat,
every page passing axe-core without serious or critical violations, no secret in any page, log or
live stream, and everything usable with JavaScript off, CSRF-less posts refused.

Screenshots of each page go to the test's folder, and to the folder UI_SCREENSHOTS_DIR
names when set (`docs/ui/` holds the committed ones)."""

from __future__ import annotations

import base64
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from axe_playwright_python.async_playwright import Axe
from playwright.async_api import Browser, Page, expect

from controlplane.store import credentials
from tests.system.conftest import DaemonProcess, SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system

SECRET_ENV = "hunter2-" + uuid.uuid4().hex
PAGES = {
    "overview": "/ui/",
    "jobs": "/ui/jobs",
    "runners": "/ui/runners",
    "provisioners": "/ui/provisioners",
    "credentials": "/ui/credentials",
}


async def _admin_key(database_url: str) -> str:
    conn = await asyncpg.connect(database_url)
    try:
        _, raw = await credentials.create_api_key(conn, kind="admin", name="operator")
        return raw
    finally:
        await conn.close()


async def _signing_secrets(database_url: str) -> list[str]:
    """Every signing key's secret as it could be written: hex and base64 (both alphabets)."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT secret FROM signing_keys")
    finally:
        await conn.close()
    out = []
    for row in rows:
        secret = bytes(row["secret"])
        out += [
            secret.hex(),
            base64.b64encode(secret).decode().rstrip("="),
            base64.urlsafe_b64encode(secret).decode().rstrip("="),
        ]
    return out


async def sign_in(page: Page, address: str, key: str) -> None:
    await page.goto(f"{address}/ui/")
    await expect(page).to_have_url(f"{address}/ui/sign-in")
    await page.get_by_label("Admin key").fill(key)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page).to_have_url(f"{address}/ui/")
    await expect(page.get_by_role("heading", name="Overview")).to_be_visible()


async def _enqueue(address: str, key: str, *jobs: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=address, timeout=30) as client:
        response = await client.post(
            "/v1/jobs", json={"jobs": list(jobs)}, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code in (200, 201), response.text


def _shots_folder() -> Path | None:
    named = os.environ.get("UI_SCREENSHOTS_DIR")
    return Path(named) if named else None


async def _shoot(page: Page, name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    folder = _shots_folder()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, folder / path.name)


async def _serious_violations(page: Page) -> list[str]:
    results = await Axe().run(page)
    assert results.response["testEngine"]["name"] == "axe-core"  # it ran
    return [
        f"{v['id']}: {v['help']} ({len(v['nodes'])} nodes)"
        for v in results.response["violations"]
        if v.get("impact") in ("serious", "critical")
    ]


async def _live_text(address: str, cookie: str, trigger: Any) -> str:
    """The live stream's bytes up to its first change notice, which `trigger` causes."""
    seen = ""
    async with (
        httpx.AsyncClient(base_url=address, timeout=30, cookies={"cp_ui_session": cookie}) as c,
        c.stream("GET", "/ui/live") as stream,
    ):
        assert stream.status_code == 200
        with anyio.fail_after(10):
            async for chunk in stream.aiter_text():
                seen += chunk
                if chunk.startswith("retry:"):
                    await trigger()
                if "event: change" in seen:
                    return seen
    return seen


async def test_two_replicas_live_updates_cancel_accessibility_and_no_secrets(
    spawn_daemon: SpawnDaemon, database_url: str, browser: Browser, tmp_path: Path
) -> None:
    workspace = uuid.uuid4()
    orchestrator, registration = await orchestrator_and_registration(database_url, workspace)
    admin = await _admin_key(database_url)
    plots = {"CONTROLPLANE_PAGES_PLOT_SAMPLE_SECONDS": "5"}  # for the overview's screenshot
    async with spawn_daemon(**plots) as a, spawn_daemon() as b:
        context = await browser.new_context(viewport={"width": 1280, "height": 800})
        page = await context.new_page()
        pages_html: list[str] = []

        await page.goto(f"{a.address}/ui/sign-in")
        await _shoot(page, "sign-in", tmp_path)
        await sign_in(page, a.address, admin)

        # An enqueue through B shows on A's overview without a reload, within 2 s.
        await expect(page.locator("main[data-live-open=yes]")).to_have_count(1)
        await page.evaluate("window.notReloaded = true")
        label = f"gpu-{uuid.uuid4().hex[:6]}"
        stuck = job_body(workspace, ["linux", label])
        stuck["payload"] = {"script": "true", "env": {"API_TOKEN": SECRET_ENV}}
        await _enqueue(b.address, orchestrator, stuck)
        row = page.locator("tr.stuck", has_text=label)
        await expect(row).to_be_visible(timeout=2000)
        await expect(row).to_contain_text("Stuck: no live runner or connected provisioner offers")
        assert await page.evaluate("window.notReloaded") is True

        # A runner on B holds a heartbeat; cancel from A's job page reaches it.
        async with httpx.AsyncClient(base_url=b.address, timeout=30) as runner:
            session = (
                await runner.post(
                    "/v1/runners/register",
                    json={"labels": ["linux"]},
                    headers={"Authorization": f"Bearer {registration}"},
                )
            ).json()["session_token"]
            job = job_body(workspace, ["linux"])
            await _enqueue(b.address, orchestrator, job)
            claimed = await runner.post(
                "/v1/runners/jobs/request?wait=5", headers={"Authorization": f"Bearer {session}"}
            )
            assert claimed.status_code == 200, claimed.text
            lease = claimed.json()["lease_token"]
            answer: dict[str, Any] = {}

            async def hold() -> None:
                response = await runner.post(
                    f"/v1/runners/jobs/{job['job_execution_id']}/heartbeat?wait=20",
                    json={},
                    headers={"Authorization": f"Bearer {lease}"},
                )
                answer.update(response.json())

            with anyio.fail_after(15):
                async with anyio.create_task_group() as group:
                    group.start_soon(hold)
                    await page.goto(f"{a.address}/ui/jobs/{job['job_execution_id']}")
                    await expect(page.locator("#job-status")).to_have_text("running")
                    await _shoot(page, "job", tmp_path)
                    assert not answer, "the heartbeat answered before the cancel"
                    await page.get_by_role("button", name="Cancel this job").click()
            assert answer["cancel"] is True
            await expect(page.locator("#job-status")).to_have_text("ended")
            await expect(page.locator("main")).to_contain_text("cancelled")
            pages_html.append(await page.content())

        await page.goto(f"{a.address}/ui/")
        with anyio.fail_after(20):  # A samples every 5 s: wait for one with the stuck job
            while not await page.locator("svg.plot polyline").count():
                await anyio.sleep(0.2)
                await page.reload()
        for name, path in PAGES.items():
            await page.goto(f"{a.address}{path}")
            await expect(page.locator("h1")).to_be_visible()
            pages_html.append(await page.content())
            await _shoot(page, name, tmp_path)
            assert await _serious_violations(page) == [], name
        await page.goto(f"{a.address}/ui/jobs/{stuck['job_execution_id']}")
        await expect(page.locator("main")).to_contain_text("API_TOKEN")
        await _shoot(page, "job-stuck", tmp_path)
        assert await _serious_violations(page) == []
        pages_html.append(await page.content())

        phone = await browser.new_context(viewport={"width": 390, "height": 844})
        await phone.add_cookies(
            [
                {"name": c["name"], "value": c["value"], "url": a.address}
                for c in await context.cookies()
            ]
        )
        small = await phone.new_page()
        await small.goto(f"{a.address}/ui/")
        await expect(small.locator("tr.stuck", has_text=label)).to_be_visible()
        await _shoot(small, "overview-phone", tmp_path)
        await phone.close()

        cookie = next(c["value"] for c in await context.cookies() if c["name"] == "cp_ui_session")
        live = await _live_text(
            a.address,
            cookie,
            lambda: _enqueue(b.address, orchestrator, job_body(workspace, ["linux", "arm"])),
        )
        assert "event: change" in live
        await context.close()
    secrets = [admin, orchestrator, registration, session, lease, SECRET_ENV, cookie]
    secrets += await _signing_secrets(database_url)
    logs = {d.log.name: d.log.read_text() for d in (a, b)}
    for secret in secrets:
        for html in pages_html:
            assert secret not in html
        assert secret not in live
        for name, text in logs.items():
            assert secret not in text, name


async def _post_without_csrf(page: Page, url: str) -> int:
    response = await page.request.post(url, form={"reason": "no token"})
    return response.status


async def test_pages_work_without_javascript_and_refuse_forms_without_the_csrf_token(
    spawn_daemon: SpawnDaemon, database_url: str, browser: Browser
) -> None:
    workspace = uuid.uuid4()
    orchestrator, _ = await orchestrator_and_registration(database_url, workspace)
    admin = await _admin_key(database_url)
    async with spawn_daemon() as daemon:
        job = job_body(workspace, ["linux", "nojs"])
        await _enqueue(daemon.address, orchestrator, job)
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await sign_in(page, daemon.address, admin)
        await expect(page.locator("main")).to_contain_text("nojs")
        assert await page.locator("main").get_attribute("data-live") == "on"
        for path in PAGES.values():
            await page.goto(f"{daemon.address}{path}")
            await expect(page.locator("h1")).to_be_visible()
        job_url = f"{daemon.address}/ui/jobs/{job['job_execution_id']}"
        await page.goto(job_url)
        assert await _post_without_csrf(page, f"{job_url}/cancel") == 403
        await expect(page.locator("#job-status")).to_have_text("pending")
        await page.get_by_role("button", name="Cancel this job").click()
        await expect(page.locator("#job-status")).to_have_text("ended")
        await expect(page.locator("main")).to_contain_text("cancelled")
        await _refuse_a_form_from_another_session(daemon, page, admin)
        await context.close()


async def _refuse_a_form_from_another_session(
    daemon: DaemonProcess, page: Page, admin: str
) -> None:
    """A token that is another session's is refused like none."""
    await page.goto(f"{daemon.address}/ui/credentials")
    theirs = await page.locator("input[name=csrf]").first.get_attribute("value")
    assert theirs
    async with httpx.AsyncClient(base_url=daemon.address, timeout=30) as other:
        form = await other.get("/ui/sign-in")
        pair = form.text.split('name="pair" value="', 1)[1].split('"', 1)[0]
        signed = await other.post("/ui/sign-in", data={"pair": pair, "key": admin})
        assert signed.status_code == 303
        refused = await other.post(
            "/ui/credentials", data={"csrf": theirs, "family": "orchestrator", "name": "x"}
        )
        assert refused.status_code == 403
