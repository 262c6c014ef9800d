"""What a signed-in operator may do on the pages: every permission decision goes through here."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from controlplane.domain.credentials import Credential, Role


@dataclass(frozen=True, slots=True)
class Principal:
    """The operator behind a browser session: the session, and the admin key it signed in with."""

    session_id: UUID
    key: Credential
    csrf: str  # the session's form token, put in every form it is shown


def may_act(principal: Principal) -> bool:
    """Whether the operator may change anything (cancel, create, revoke, sign others out): an
    installation admin key of role `owner`. An `observer` key reads every page and acts on none,
    as on the admin API (403 `admin-key-read-only` there, 403 here). The key is re-read on every
    request, so a changed or revoked key holds from the next page."""
    return principal.key.kind == "admin" and principal.key.role is Role.OWNER
