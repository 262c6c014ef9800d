"""Pause and resume through real HTTP against a real daemon (docs/policies.md Q-76..Q-78): the
admin routes, the "paused" answer to a runner's job request, and a resumed workspace's parked
runner getting its job."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import httpx

from controlplane import metrics
from controlplane.app import Daemon
from tests.web.conftest import Api
from tests.web.test_ui import _hidden, browser, sign_in


def _dispatcher(daemon: Daemon) -> Any:
    assert daemon.replica is not None
    return daemon.replica.dispatcher


async def _until(check: Any) -> None:
    """Wait for an in-process condition the daemon reaches on its own (a deadline, no sleep
    standing in for an interleaving)."""
    with anyio.fail_after(10):
        while not check():
            await anyio.sleep(0.01)


async def _admin(api: Api, path: str, body: Any = None) -> httpx.Response:
    return await api.http.post(f"/v1/admin/{path}", json=body, headers=api.auth(api.admin_key))


async def _register(api: Api) -> tuple[str, str]:
    response = await api.http.post(
        "/v1/runners/register",
        json={"labels": ["linux", "x64"]},
        headers=api.auth(api.registration_token),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["session_token"], body["session_id"]


def _paused_answers() -> float:
    return metrics.REGISTRY.get_sample_value("controlplane_paused_answers_total") or 0.0


async def test_q76_a_paused_runners_parked_poll_is_answered_paused_at_once_until_resumed(
    api: Api,
) -> None:
    token, session_id = await _register(api)
    dispatcher = _dispatcher(api.daemon)
    answers: list[httpx.Response] = []
    before = _paused_answers()

    async def poll() -> None:
        answers.append(await api.request_job(token, wait=10))

    async with anyio.create_task_group() as group:
        group.start_soon(poll)
        await _until(lambda: dispatcher.parked == 1)
        paused = await _admin(api, f"runners/{session_id}/pause", {"reason": "new disk"})
        assert paused.status_code == 200, paused.text
        assert paused.json() | {"since": None} == {
            "kind": "runner",
            "id": session_id,
            "workspace_id": str(api.workspace),
            "paused": True,
            "since": None,
            "reason": "new disk",
            "changed": True,
        }
    [parked] = answers
    assert parked.status_code == 204
    assert parked.headers["Controlplane-Paused"] == "runner"
    assert parked.headers["Retry-After"] == "30"  # runners.paused_retry_seconds

    # A later request is answered the same, without parking, even with work queued.
    assert (await api.enqueue(api.job())).status_code == 200
    again = await api.request_job(token, wait=10)
    assert again.status_code == 204 and again.headers["Controlplane-Paused"] == "runner"
    assert _paused_answers() == before + 2

    resumed = await _admin(api, f"runners/{session_id}/resume")
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    await _until(lambda: not dispatcher.paused.holds(uuid.UUID(session_id)))
    got = await api.request_job(token, wait=10)
    assert got.status_code == 200, got.text


async def test_q77_a_paused_workspace_keeps_its_runners_parked_and_serves_them_on_resume(
    api: Api,
) -> None:
    token, _ = await _register(api)
    other_token, _ = await _register(api)
    dispatcher = _dispatcher(api.daemon)
    paused = await _admin(api, f"workspaces/{api.workspace}/pause", {"reason": "freeze"})
    assert paused.status_code == 200 and paused.json()["changed"] is True
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    order: list[str] = []

    async def poll() -> None:
        response = await api.request_job(token, wait=10)
        assert response.status_code == 200, response.text
        assert response.json()["job_execution_id"] == job["job_execution_id"]
        order.append("claimed")

    async with anyio.create_task_group() as group:
        group.start_soon(poll)
        await _until(lambda: dispatcher.parked == 1)
        # The claim path itself refuses: an immediate claim by another runner finds nothing,
        # and is not told "paused" (the workspace, not the runner, is paused).
        immediate = await api.request_job(other_token, wait=0)
        assert immediate.status_code == 204 and "Controlplane-Paused" not in immediate.headers
        order.append("resuming")
        resumed = await _admin(api, f"workspaces/{api.workspace}/resume")
        assert resumed.status_code == 200 and resumed.json()["changed"] is True
    assert order == ["resuming", "claimed"]

    feed = await api.http.get(
        f"/v1/events?workspace_id={api.workspace}", headers=api.auth(api.orchestrator_key)
    )
    audit = [e for e in feed.json()["events"] if e["type"].startswith("workspace.")]
    assert [(e["type"], e["payload"]["by_name"], e["payload"]["reason"]) for e in audit] == [
        ("workspace.paused", "ops", "freeze"),
        ("workspace.resumed", "ops", None),
    ]


async def test_q78_pause_routes_validate_and_404_unknown_ids(api: Api) -> None:
    unknown = uuid.uuid4()
    for path in (f"runners/{unknown}/pause", f"runners/{unknown}/resume"):
        response = await _admin(api, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not-found"
    for path in (f"runner-instances/{unknown}/drain", f"runner-instances/{unknown}/undrain"):
        assert (await _admin(api, path)).status_code == 404
    for body in (
        {"reason": ""},
        {"reason": "   "},
        {"reason": "a\u0000b"},
        {"reason": "x" * 513},
        {"reason": 5},
        {"why": "unknown field"},
    ):
        response = await _admin(api, f"workspaces/{api.workspace}/pause", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["code"] == "validation-error"
    response = await _admin(api, "workspaces/not-a-uuid/pause")
    assert response.status_code == 400
    no_key = await api.http.post(f"/v1/admin/workspaces/{api.workspace}/pause")
    assert no_key.status_code == 401
    # Nothing above paused anything; a workspace never seen may be paused, and a body is
    # optional (none, `{}` or `null`).
    never_seen = uuid.uuid4()
    first = await api.http.post(
        f"/v1/admin/workspaces/{never_seen}/pause", headers=api.auth(api.admin_key)
    )
    assert first.status_code == 200 and first.json()["changed"] is True
    second = await _admin(api, f"workspaces/{never_seen}/pause", {"reason": "x" * 512})
    assert second.status_code == 200 and second.json()["changed"] is False
    assert second.json()["reason"] is None  # the first pause's


async def test_a_runner_resumed_on_this_replica_is_served_here_before_its_notify_is_heard(
    api: Api,
) -> None:
    """Read your own writes: the replica that resumes a runner forgets the pause at once, not
    when its listener hears the NOTIFY. The listener is held deaf to pause changes after the
    pause is heard (its handler looks the dispatcher's method up at each delivery; the routes
    were handed theirs when built), which forces the window the page test once lost under load:
    the resume committed, its NOTIFY not yet heard, the runner's next request on this replica."""
    token, session_id = await _register(api)
    session = uuid.UUID(session_id)
    dispatcher = _dispatcher(api.daemon)
    assert (await _admin(api, f"runners/{session_id}/pause")).status_code == 200
    await _until(lambda: dispatcher.paused.holds(session))
    held: list[tuple[uuid.UUID, uuid.UUID, bool]] = []
    dispatcher.runner_paused = lambda *change: held.append(change)  # the listener's path only
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    resumed = await _admin(api, f"runners/{session_id}/resume")
    assert resumed.status_code == 200 and resumed.json()["changed"] is True
    assert not dispatcher.paused.holds(session)
    got = await api.request_job(token)
    assert got.status_code == 200, got.headers
    assert got.json()["job_execution_id"] == job["job_execution_id"]
    # The page's resume does the same (web/ui/actions.py shares web/pauses.py heard_here).
    assert (await _admin(api, f"runners/{session_id}/pause")).status_code == 200
    dispatcher.paused.note(session, True)  # as if this pause's NOTIFY were heard
    async with browser(api) as client:
        await sign_in(client, api.admin_key)
        csrf = _hidden((await client.get("/ui/runners")).text, "csrf")
        done = await client.post(f"/ui/runners/{session_id}/resume", data={"csrf": csrf})
        assert done.status_code == 303
    assert not dispatcher.paused.holds(session)
    assert held  # the listener did hear the changes; it only could not act on them
