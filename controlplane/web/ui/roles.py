"""What a signed-in operator may do on the pages: every permission decision goes through here."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from controlplane.domain.credentials import Credential


@dataclass(frozen=True, slots=True)
class Principal:
    """The operator behind a browser session: the session, and the admin key it signed in with."""

    session_id: UUID
    key: Credential
    csrf: str  # the session's form token, put in every form it is shown


def may_act(principal: Principal) -> bool:
    """Whether the operator may change anything (cancel, create, revoke, sign others out). Every
    admin key may today; an admin key's role (`owner` or `observer`, issue 15) is read here, and
    only here, when the keys carry one."""
    return principal.key.kind == "admin"
