"""The provisioned (managed) runner's way in: bootstrap token to activation token.

1. `POST /v1/runner-enrollment/exchange` trades the one-use bootstrap token the provisioner gave
   the machine for a control session token. 401: the bootstrap token is spent, expired or
   revoked; another try cannot help.
2. `POST /v1/runner-control/provider-runner` attaches the machine's provider identity, when the
   runner knows it (the provisioner may attach it instead).
3. `POST /v1/runner-control/enrollment` declares the labels. When the instance was created for a
   reservation, the answer already carries an activation token.
4. Otherwise `GET /v1/runner-control/assignment?wait_seconds=30` long-polls until the server binds
   the idle runner to demand, heartbeating the control session between polls.

The activation token then registers a one-claim session (`/v1/runners/register`), after which the
runner behaves like any other until its one job is done.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import httpx

from controlplane.agent import api
from controlplane.retry import Backoff

log = logging.getLogger("controlplane.agent.managed")

PROTOCOL_VERSION = "1"
ASSIGNMENT_WAIT_SECONDS = 30


class BootstrapRefused(Exception):
    """The server refused the bootstrap or control token: the machine cannot join."""


async def _post(
    http: httpx.AsyncClient, path: str, body: dict[str, object] | None, token: str | None
) -> httpx.Response:
    headers = {} if token is None else api.bearer(token)
    return await http.post(path, json=body, headers=headers)


async def _retrying(what: str, call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """Run `call` until it answers anything but a transport error or a 5xx."""
    backoff = Backoff.full_jitter()
    while True:
        try:
            response = await call()
        except httpx.TransportError as error:
            log.warning("managed.retry", extra={"step": what, "error": type(error).__name__})
        else:
            if response.status_code < 500:
                return response
            log.warning("managed.retry", extra={"step": what, "status": response.status_code})
        await anyio.sleep(backoff.next())


async def activate(
    http: httpx.AsyncClient,
    bootstrap_token: str,
    labels: list[str],
    *,
    provider_runner_id: str | None = None,
    provider_kind: str = "local",
) -> str:
    """Run steps 1-4; the activation token."""
    exchanged = await _retrying(
        "exchange",
        lambda: _post(
            http, "/v1/runner-enrollment/exchange", {"bootstrap_token": bootstrap_token}, None
        ),
    )
    if exchanged.status_code != 200:
        raise BootstrapRefused(f"exchange: {api.describe(exchanged)}")
    control = str(exchanged.json()["control_session_token"])
    log.info(
        "managed.exchanged", extra={"runner_instance_id": exchanged.json()["runner_instance_id"]}
    )
    if provider_runner_id:
        attached = await _retrying(
            "attach",
            lambda: _post(
                http,
                "/v1/runner-control/provider-runner",
                {"provider_runner_id": provider_runner_id},
                control,
            ),
        )
        if attached.status_code != 200:
            raise BootstrapRefused(f"attach: {api.describe(attached)}")
    enrolled = await _retrying(
        "enroll",
        lambda: _post(
            http,
            "/v1/runner-control/enrollment",
            {
                "labels": labels,
                "provider_kind": provider_kind,
                "protocol_version": PROTOCOL_VERSION,
            },
            control,
        ),
    )
    if enrolled.status_code != 200:
        raise BootstrapRefused(f"enroll: {api.describe(enrolled)}")
    token = enrolled.json()["activation_token"]
    while token is None:
        polled = await _retrying(
            "assignment",
            lambda: http.get(
                "/v1/runner-control/assignment",
                params={"wait_seconds": ASSIGNMENT_WAIT_SECONDS},
                headers=api.bearer(control),
                timeout=ASSIGNMENT_WAIT_SECONDS + 15,
            ),
        )
        if polled.status_code != 200:
            raise BootstrapRefused(f"assignment: {api.describe(polled)}")
        token = polled.json()["activation_token"]
        if token is None:
            beat = await _retrying(
                "heartbeat", lambda: _post(http, "/v1/runner-control/heartbeat", None, control)
            )
            if beat.status_code != 200:
                raise BootstrapRefused(f"heartbeat: {api.describe(beat)}")
    log.info("managed.activated")
    return str(token)
