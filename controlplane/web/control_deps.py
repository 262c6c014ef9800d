"""What a provisioner control session (web/control.py, its requests in web/control_requests.py)
needs from its replica, built once by web/app.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from controlplane.actors.control import ControlSessions
from controlplane.actors.provisioning import DemandBoard
from controlplane.domain.labels import LabelSet
from controlplane.settings import Settings
from controlplane.web.auth import Authenticator


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: Authenticator  # the upgrade request's provisioner token
    reserved_labels: LabelSet
    clock: Callable[[], datetime]  # when a report was received
    control: ControlSessions  # this replica's sessions, for takeover and idle timeouts
    demand: DemandBoard  # wakes the session's provisioner actor
