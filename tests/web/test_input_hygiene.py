"""The input rules of the edge (docs/api.md, "Input rules") over real HTTP and a real control
session: NUL in any string or object key, nesting deeper than `server.max_json_depth`, times
and integers PostgreSQL cannot take, and empty query values are refused with 400 and a message
naming the field. Nothing is written, and the keep-alive connection survives the refusal; a
control session closes 4400 instead of 1011."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.errors import InvalidInput
from controlplane.store import runner_instances
from controlplane.web import edge
from tests import provisioning
from tests.web.conftest import Api
from tests.web.control_client import closed_with, hello, open_session, send
from tests.web.provisioning_client import workspace_provisioner

NUL = "\u0000"
DEPTH = 64  # server.max_json_depth's default, which the test daemon keeps


async def snapshot(db: asyncpg.Connection) -> dict[str, list[str]]:
    """Every row of every table, as text: equal snapshots mean nothing was written."""
    tables = await db.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    found = {}
    for table in sorted(row["tablename"] for row in tables):
        rows = await db.fetch(f'SELECT to_jsonb(t)::text AS row FROM "{table}" t')  # noqa: S608 -- table names read from pg_tables
        found[table] = sorted(row["row"] for row in rows)
    return found


async def on_kept_connection(api: Api, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """Send one request on a warm keep-alive connection; assert that the next request reuses
    that connection (the server did not drop it); the first answer."""
    connects: list[str] = []

    async def trace(event: str, _info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(event)

    assert (await api.http.get("/healthz")).status_code == 200
    answer = await api.http.request(method, url, **kwargs)
    assert (await api.http.get("/healthz", extensions={"trace": trace})).status_code == 200
    assert connects == [], "the server closed the keep-alive connection after the refusal"
    return answer


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    found: dict[str, Any] = response.json()["error"]
    return found


async def refused_unchanged(
    api: Api, db: asyncpg.Connection, method: str, url: str, **kwargs: Any
) -> dict[str, Any]:
    before = await snapshot(db)
    response = await on_kept_connection(api, method, url, **kwargs)
    assert await snapshot(db) == before
    return error_of(response)


# -- NUL in any string of a body -----------------------------------------------------------


async def _lease(api: Api) -> tuple[str, str]:
    """A running execution's id and its lease token."""
    session = await api.register()
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    claimed = await api.request_job(session)
    assert claimed.status_code == 200, claimed.text
    return job["job_execution_id"], claimed.json()["lease_token"]


async def _bootstrap_token(api: Api, db: asyncpg.Connection) -> str:
    found = await provisioning.provisioner(db, api.workspace)
    batch = await runner_instances.create_batch(
        db, found.id, provider_kind="docker", entries=[("small", None)],
        bootstrap_ttl=timedelta(minutes=5),
    )  # fmt: skip
    return batch.instances[0].bootstrap_token


async def _control_token(api: Api, db: asyncpg.Connection) -> str:
    exchanged = await api.http.post(
        "/v1/runner-enrollment/exchange",
        json={"bootstrap_token": await _bootstrap_token(api, db)},
    )
    assert exchanged.status_code == 200, exchanged.text
    token: str = exchanged.json()["control_session_token"]
    return token


def _tools(*names: str) -> dict[str, Any]:
    return {"harnesses": {"bash": {"tools": list(names)}}}


Request = tuple[str, str, dict[str, Any]]
Build = Callable[[Api, asyncpg.Connection], Awaitable[Request]]


async def _enqueue_value(api: Api, _db: asyncpg.Connection) -> Request:
    job = api.job(payload={"env": {"PATH": "/bin", "FOO": f"a{NUL}b"}})
    body = {"jobs": [api.job(), job]}
    return "POST", "/v1/jobs", {"json": body, "headers": api.auth(api.orchestrator_key)}


async def _enqueue_key(api: Api, _db: asyncpg.Connection) -> Request:
    job = api.job(payload={"env": {f"FOO{NUL}": "b"}})
    body = {"jobs": [job]}
    return "POST", "/v1/jobs", {"json": body, "headers": api.auth(api.orchestrator_key)}


async def _enqueue_odd_key(api: Api, _db: asyncpg.Connection) -> Request:
    job = api.job(payload={"env": {"my key:1": f"a{NUL}"}})
    body = {"jobs": [job]}
    return "POST", "/v1/jobs", {"json": body, "headers": api.auth(api.orchestrator_key)}


async def _register_tool(api: Api, _db: asyncpg.Connection) -> Request:
    body = {"labels": ["linux"], "capabilities": _tools("make", f"g{NUL}cc")}
    headers = api.auth(api.registration_token)
    return "POST", "/v1/runners/register", {"json": body, "headers": headers}


async def _heartbeat_tool(api: Api, _db: asyncpg.Connection) -> Request:
    execution, lease = await _lease(api)
    url = f"/v1/runners/jobs/{execution}/heartbeat"
    return "POST", url, {"json": {"capabilities": _tools(NUL)}, "headers": api.auth(lease)}


async def _exchange_token(api: Api, db: asyncpg.Connection) -> Request:
    token = await _bootstrap_token(api, db)
    url = "/v1/runner-enrollment/exchange"
    return "POST", url, {"json": {"bootstrap_token": token + NUL}}


def _enrollment(**fields: Any) -> Build:
    async def build(api: Api, db: asyncpg.Connection) -> Request:
        control = await _control_token(api, db)
        body = {"labels": ["linux"], "provider_kind": "docker", "protocol_version": "1", **fields}
        url = "/v1/runner-control/enrollment"
        return "POST", url, {"json": body, "headers": api.auth(control)}

    return build


async def _provider_runner(api: Api, db: asyncpg.Connection) -> Request:
    control = await _control_token(api, db)
    body = {"provider_runner_id": f"vm-{NUL}"}
    url = "/v1/runner-control/provider-runner"
    return "POST", url, {"json": body, "headers": api.auth(control)}


NUL_CASES: list[tuple[str, Build, str, str]] = [
    ("enqueue-payload-value", _enqueue_value, "body.jobs[1].payload.env.FOO", "strings"),
    ("enqueue-payload-key", _enqueue_key, "body.jobs[0].payload.env", "object keys"),
    ("enqueue-quoted-key", _enqueue_odd_key, 'body.jobs[0].payload.env["my key:1"]', "strings"),
    ("register-tool", _register_tool, "body.capabilities.harnesses.bash.tools[1]", "strings"),
    ("heartbeat-tool", _heartbeat_tool, "body.capabilities.harnesses.bash.tools[0]", "strings"),
    ("exchange-token", _exchange_token, "body.bootstrap_token", "strings"),
    ("enrollment-kind", _enrollment(provider_kind=f"d{NUL}"), "body.provider_kind", "strings"),
    ("enrollment-version", _enrollment(protocol_version=NUL), "body.protocol_version", "strings"),
    (
        "enrollment-tool",
        _enrollment(capabilities=_tools(NUL)),
        "body.capabilities.harnesses.bash.tools[0]",
        "strings",
    ),
    ("provider-runner", _provider_runner, "body.provider_runner_id", "strings"),
]


@pytest.mark.parametrize(
    ("build", "path", "what"),
    [case[1:] for case in NUL_CASES],
    ids=[case[0] for case in NUL_CASES],
)
async def test_nul_in_any_string_of_a_body_is_400_naming_it_and_writes_nothing(
    api: Api, db: asyncpg.Connection, build: Build, path: str, what: str
) -> None:
    method, url, kwargs = await build(api, db)
    error = await refused_unchanged(api, db, method, url, **kwargs)
    assert error["code"] == "validation-error"
    assert error["message"] == f"{path}: {what} must not contain NUL"
    assert error["details"] == {"field": path}


async def test_an_escaped_backslash_before_u0000_is_text_not_nul(api: Api) -> None:
    """`\\\\u0000` in JSON text is a backslash and "u0000": stored and handed out as sent."""
    payload = {"script": "printf '\\u0000'", "\\u0000": ["\\\\u0000"]}
    job = api.job(payload=payload)
    assert b"\\\\u0000" in json.dumps(payload).encode()
    assert (await api.enqueue(job)).status_code == 200
    claimed = await api.request_job(await api.register())
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["payload"] == payload
    # ...and NUL itself, in the same body, is still found behind it.
    job = api.job(payload={**payload, "x": NUL})
    refused = await api.enqueue(job)
    assert refused.status_code == 400
    assert refused.json()["error"]["details"] == {"field": "body.jobs[0].payload.x"}


# -- nesting ------------------------------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def test_a_payload_nested_10000_deep_is_400_naming_the_limit(
    api: Api, db: asyncpg.Connection
) -> None:
    head = json.dumps({"jobs": [api.job()]})[: -len("}]}")]
    body = f'{head}, "payload": {{"a": {_nested(10_000)}}}}}]}}'
    error = await refused_unchanged(
        api, db, "POST", "/v1/jobs", content=body,
        headers={**api.auth(api.orchestrator_key), "content-type": "application/json"},
    )  # fmt: skip
    assert error["code"] == "validation-error"
    assert error["message"] == f"body nests arrays and objects deeper than {DEPTH} levels"
    assert error["details"] == {"limit": DEPTH}


async def test_nesting_counts_from_the_body_root_and_the_limit_itself_is_accepted(
    api: Api, db: asyncpg.Connection
) -> None:
    # {"jobs": [{"payload": {"a": [...]}}]}: four levels before the array.
    within = json.loads(_nested(DEPTH - 4))
    assert (await api.enqueue(api.job(payload={"a": within}))).status_code == 200
    beyond = json.loads(_nested(DEPTH - 3))
    error = await refused_unchanged(
        api, db, "POST", "/v1/jobs",
        json={"jobs": [api.job(payload={"a": beyond})]}, headers=api.auth(api.orchestrator_key),
    )  # fmt: skip
    assert error["details"] == {"limit": DEPTH}
    # Brackets inside strings are text, not nesting.
    text = {"a": "[" * 1000, "b": '\\"' + "{" * 1000}
    assert (await api.enqueue(api.job(payload=text))).status_code == 200


# -- times and integers out of PostgreSQL's range -----------------------------------------


@pytest.mark.parametrize("queued_at", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-01:00"])
async def test_a_time_with_no_utc_value_is_400_naming_it(
    api: Api, db: asyncpg.Connection, queued_at: str
) -> None:
    error = await refused_unchanged(
        api, db, "POST", "/v1/jobs",
        json={"jobs": [api.job(queued_at=queued_at)]}, headers=api.auth(api.orchestrator_key),
    )  # fmt: skip
    assert error["code"] == "validation-error"
    assert error["details"] == {"field": "body.jobs[0].queued_at"}


BAD_CURSORS = [
    "18446744073709551616.0",  # xid8 is unsigned 64-bit
    "0.9223372036854775808",  # the sequence is bigint
    "99999999999999999999999999.1",
    "",
]


async def test_an_event_cursor_out_of_range_or_empty_is_400_invalid_cursor(
    api: Api, db: asyncpg.Connection
) -> None:
    for after in BAD_CURSORS:
        error = await refused_unchanged(
            api, db, "GET", "/v1/events", params={"after": after},
            headers=api.auth(api.orchestrator_key),
        )  # fmt: skip
        assert error["code"] == "invalid-cursor", after
        assert error["details"] == {"field": "after"}
    # The largest cursor is a valid one (after every event there will ever be).
    largest = await api.http.get(
        "/v1/events", params={"after": "18446744073709551615.9223372036854775807"},
        headers=api.auth(api.orchestrator_key),
    )  # fmt: skip
    assert largest.status_code == 200, largest.text
    assert largest.json()["events"] == []


INTEGERS = [
    ("orchestrator", "/v1/events", "limit"),
    ("admin", "/v1/admin/api-keys", "limit"),
    ("admin", "/v1/admin/runners", "window_seconds"),
    ("none", "/v1/runner-control/assignment", "wait_seconds"),
]


@pytest.mark.parametrize(("who", "path", "name"), INTEGERS)
async def test_an_integer_query_value_is_ascii_digits_in_range(
    api: Api, db: asyncpg.Connection, who: str, path: str, name: str
) -> None:
    headers = {
        "orchestrator": api.auth(api.orchestrator_key),
        "admin": api.auth(api.admin_key),
        "none": {},
    }[who]
    # "²" and "٣" are digits to str.isdigit; int() refuses the first and reads the second as 3.
    for value in ("\u00b2", "\u0663", "--1", "1" * 5000):
        error = await refused_unchanged(api, db, "GET", path, params={name: value}, headers=headers)
        assert error["code"] == "validation-error", value
        assert error["details"] == {"field": name}


async def test_a_paging_cursor_with_no_utc_time_or_deep_json_is_invalid_cursor(
    api: Api, db: asyncpg.Connection
) -> None:
    raw = json.dumps({"created_at": "0001-01-01T00:00:00+14:00", "id": str(uuid.uuid4())})
    deep = _nested(3000)  # the cursor's JSON is parsed by the standard library, recursively
    for text in (raw, deep):
        cursor = base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
        error = await refused_unchanged(
            api, db, "GET", "/v1/admin/api-keys", params={"cursor": cursor},
            headers=api.auth(api.admin_key),
        )  # fmt: skip
        assert error == {
            "code": "invalid-cursor",
            "message": "cursor is not one this server gave",
            "details": {"field": "cursor"},
        }


# Every query parameter of every route, with the code its malformed values get.
QUERIES = [
    ("orchestrator", "/v1/events", "after", "invalid-cursor"),
    ("orchestrator", "/v1/events", "workspace_id", "validation-error"),
    ("orchestrator", "/v1/events", "limit", "validation-error"),
    ("orchestrator", "/v1/events", "wait", "validation-error"),
    ("session", "/v1/runners/jobs/request", "wait", "validation-error"),
    ("none", "/v1/runner-control/assignment", "wait_seconds", "validation-error"),
    ("admin", "/v1/admin/runners", "workspace_id", "validation-error"),
    ("admin", "/v1/admin/runners", "window_seconds", "validation-error"),
    ("admin", "/v1/admin/api-keys", "limit", "validation-error"),
    ("admin", "/v1/admin/api-keys", "cursor", "invalid-cursor"),
    ("admin", "/v1/admin/registration-tokens", "workspace_id", "validation-error"),
    ("admin", "/v1/admin/provisioner-tokens", "active", "validation-error"),
    ("admin", "/v1/admin/runner-instances", "state", "validation-error"),
    ("admin", "/v1/admin/runner-instances", "assignment", "validation-error"),
    ("admin", "/v1/admin/runner-instances", "label", "validation-error"),
    ("admin", "/v1/admin/runner-instances", "provisioner_id", "validation-error"),
    ("admin", "/v1/admin/runner-instances/active", "workspace_id", "validation-error"),
    ("admin", "/v1/admin/reservations", "workspace_id", "validation-error"),
]


async def test_an_empty_query_value_is_400_on_every_route(api: Api) -> None:
    headers = {
        "orchestrator": api.auth(api.orchestrator_key),
        "admin": api.auth(api.admin_key),
        "session": api.auth(await api.register()),
        "none": {},
    }
    answers = {}
    for who, path, name, _code in QUERIES:
        method = "POST" if path == "/v1/runners/jobs/request" else "GET"
        response = await api.http.request(
            method, f"{path}?{name}=", headers=headers[who], timeout=5
        )
        code = response.json().get("error", {}).get("code")
        answers[(path, name)] = (response.status_code, code)
    assert answers == {(path, name): (400, code) for _, path, name, code in QUERIES}


# -- the control session ------------------------------------------------------------------


def _report(**event: Any) -> dict[str, Any]:
    base = {"provider_runner_id": "vm-1", "state": "running", "reported_at": "2026-01-01T00:00:00Z"}
    return {"type": "report", "request_id": "r1", "events": [{**base, **event}]}


FRAMES: list[tuple[str, bool, dict[str, Any] | str, str]] = [
    (
        "report-reason",
        True,
        _report(state="failed", reason=f"disk {NUL} full"),
        "frame.events[0].reason: strings must not contain NUL",
    ),
    (
        "report-label",
        True,
        _report(labels=["linux", f"x{NUL}"]),
        "frame.events[0].labels[1]: strings must not contain NUL",
    ),
    (
        "report-time",
        True,
        _report(reported_at="0001-01-01T00:00:00+01:00"),
        "frame.events[0].reported_at: the time is out of range once converted to UTC",
    ),
    (
        "deep-before-the-tag",
        False,
        '{"x": ' + _nested(5000) + ', "type": "hello", "protocol_version": 1, "request_id": "h"}',
        f"frame nests arrays and objects deeper than {DEPTH} levels",
    ),
]


@pytest.mark.parametrize(
    ("after_hello", "frame", "reason"),
    [case[1:] for case in FRAMES],
    ids=[case[0] for case in FRAMES],
)
async def test_a_frame_breaking_an_input_rule_closes_4400_naming_it(
    api: Api,
    db: asyncpg.Connection,
    after_hello: bool,
    frame: dict[str, Any] | str,
    reason: str,
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    if after_hello:
        await hello(ws)
    before = await snapshot(db)
    if isinstance(frame, str):
        await ws.send(frame)
    else:
        await send(ws, frame)
    code, text = await closed_with(ws)
    assert (code, text) == (4400, reason[:123])
    assert await snapshot(db) == before


# -- the edge itself ----------------------------------------------------------------------


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=30,
)


NUL_TEXT = st.tuples(st.text(max_size=5), st.text(max_size=5)).map(lambda t: t[0] + NUL + t[1])
KEYS = st.text(max_size=6)


def _carrying(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A list or object around `inner` (which holds a NUL), or an object with a NUL key."""
    siblings = st.lists(JSON, max_size=3)
    members = st.dictionaries(KEYS, JSON, max_size=3)
    return (
        st.tuples(siblings, inner, siblings).map(lambda t: [*t[0], t[1], *t[2]])
        | st.tuples(members, KEYS, inner).map(lambda t: {**t[0], t[1]: t[2]})
        | st.tuples(members, NUL_TEXT, JSON).map(lambda t: {**t[0], t[1]: t[2]})
    )


# JSON with at least one NUL somewhere: in a string at any depth, or in an object key.
WITH_NUL = st.recursive(NUL_TEXT, _carrying, max_leaves=8)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WITH_NUL)
def test_property_nul_anywhere_in_any_json_is_refused_by_the_edge(value: Any) -> None:
    text = msgspec.json.encode(value)
    with pytest.raises(InvalidInput) as refused:
        edge.screen(text, DEPTH)
    assert refused.value.message.endswith("must not contain NUL")


@settings(max_examples=300, deadline=None)
@given(JSON, st.integers(1, 12))
def test_property_the_depth_check_is_exact_for_json(value: Any, limit: int) -> None:
    def depth(item: Any) -> int:
        if isinstance(item, list):
            return 1 + max(map(depth, item), default=0)
        if isinstance(item, dict):
            return 1 + max(map(depth, item.values()), default=0)
        return 0

    assert edge.too_deep(msgspec.json.encode(value), limit) == (depth(value) > limit)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(WITH_NUL)
async def test_property_a_payload_with_nul_anywhere_is_400_never_500(api: Api, value: Any) -> None:
    response = await api.enqueue(api.job(payload={"p": value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "validation-error"
    assert error["details"]["field"].startswith("body.jobs[0].payload")


# -- signed tokens ------------------------------------------------------------------------


async def test_a_forged_token_with_deeply_nested_claims_is_401(api: Api) -> None:
    """Claims are parsed only once their signature holds: a forged body is never decoded, so
    nesting in it cannot reach the parser (it was RecursionError, 500)."""
    session = await api.register()
    kid = session.removeprefix("cp_rs_").split(".")[0]
    depth = 1400
    claims = base64.urlsafe_b64encode(_nested(depth).encode()).decode().rstrip("=")
    forged = f"cp_rs_{kid}.{claims}.{'A' * 43}"
    assert len(forged) <= 4096
    response = await on_kept_connection(
        api, "POST", "/v1/runners/jobs/request?wait=0", headers=api.auth(forged)
    )
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "unauthorized"
