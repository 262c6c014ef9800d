"""Ephemeral registration tokens at the edge: minting over a provisioner's control session
(`mint_ephemeral`, called by web/control_requests.py inside the session's fenced transaction).
A rate-limited registration is answered 429 through web/errors.py's table."""

from __future__ import annotations

import logging
from datetime import timedelta

from controlplane.domain.provisioners import Provisioner
from controlplane.errors import InvalidInput
from controlplane.store import ephemeral
from controlplane.store.pool import Conn
from controlplane.web.services import Services
from controlplane.wire import control as wire

log = logging.getLogger("controlplane.ephemeral")


async def mint_ephemeral(
    conn: Conn, svc: Services, provisioner: Provisioner, message: wire.MintEphemeral
) -> wire.EphemeralMinted:
    """Answer `mint_ephemeral` on `conn`, whose transaction holds the session's fencing row.
    Refusals (nothing minted): `validation-error` (duplicate ids; an installation provisioner
    without `reservation_id`), `reservation-not-found`, `reservation-expired`,
    `reservation-capacity-exhausted`, `ephemeral-token-active`."""
    ids = message.provider_runner_ids
    if len(set(ids)) != len(ids):
        raise InvalidInput("provider_runner_ids must be unique")
    if message.reservation_id is None and provisioner.workspace_id is None:
        raise InvalidInput("an installation provisioner must name the reservation_id")
    minted = await ephemeral.mint(
        conn,
        provisioner_id=provisioner.id,
        workspace_id=provisioner.workspace_id,
        provider_runner_ids=ids,
        ttl=timedelta(seconds=svc.settings.provisioners.ephemeral_token_ttl_seconds),
        reservation_id=message.reservation_id,
    )
    reservation = message.reservation_id
    log.info(
        "ephemeral.minted",
        extra={
            "provisioner_id": str(provisioner.id),
            "reservation_id": None if reservation is None else str(reservation),
            "count": len(minted),
        },
    )
    return wire.EphemeralMinted(
        request_id=message.request_id,
        tokens=[
            wire.MintedToken(
                provider_runner_id=t.provider_runner_id, token=t.token, expires_at=t.expires_at
            )
            for t in minted
        ],
    )
