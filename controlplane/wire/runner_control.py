"""The provisioned runner's boot path: bootstrap exchange and its control session."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated
from uuid import UUID

import msgspec

from controlplane.wire.common import Capabilities, Labels, Strict

Token = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ProviderKind = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
ProtocolVersion = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
ProviderRunnerId = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]


class ExchangeRequest(Strict):
    bootstrap_token: Token


class ExchangeResponse(Strict):
    runner_instance_id: UUID
    control_session_token: str
    expires_at: datetime  # fixed at the exchange; never extended


class EnrollmentRequest(Strict):
    labels: Labels
    provider_kind: ProviderKind
    protocol_version: ProtocolVersion
    capabilities: Capabilities | None = None


class ActivationResponse(Strict):
    """An activation token for `/v1/runners/register`, or null: no assignment (yet)."""

    activation_token: str | None


class ProviderRunnerRequest(Strict):
    provider_runner_id: ProviderRunnerId


class ProviderRunnerResponse(Strict):
    attached: bool  # false: the instance already had an identity, or is finished


class ControlHeartbeatResponse(Strict):
    """Named apart from the runner's HeartbeatResponse: OpenAPI components share one namespace."""

    ok: bool
