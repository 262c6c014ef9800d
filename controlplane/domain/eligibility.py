"""Installation-scope eligibility (spec 3.5): which workspaces an installation provisioner may
serve. Pure.

An operator chooses it per installation provisioner token: every workspace (the default), only
an allow list, or every workspace but a deny list. An installation provisioner's allocation walk
visits only the workspaces it admits, so it neither grants launches for nor binds idle runners
to any other; a workspace provisioner serves its own workspace and has none.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID


class Mode(enum.StrEnum):
    ALL = "all"
    ALLOW = "allow"
    DENY = "deny"


@dataclass(frozen=True, slots=True)
class Eligibility:
    mode: Mode = Mode.ALL
    workspaces: frozenset[UUID] = frozenset()

    def admits(self, workspace_id: UUID) -> bool:
        if self.mode is Mode.ALLOW:
            return workspace_id in self.workspaces
        if self.mode is Mode.DENY:
            return workspace_id not in self.workspaces
        return True


EVERY_WORKSPACE = Eligibility()


def eligibility_problem(mode: Mode, workspaces: Sequence[UUID], *, limit: int) -> str | None:
    """Why this cannot be a provisioner's eligibility; None when it can. `all` names no
    workspace; a list has no workspace twice and at most `limit` of them (an empty allow list is
    allowed: the provisioner serves nothing until one is added)."""
    if mode is Mode.ALL and workspaces:
        return "mode all takes no workspace_ids"
    if len(set(workspaces)) != len(workspaces):
        return "workspace_ids must not repeat a workspace"
    if len(workspaces) > limit:
        return f"at most {limit} workspace_ids (provisioners.eligibility_max_workspaces)"
    return None
