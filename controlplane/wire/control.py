"""Messages of the provisioner control session (WS /v1/provisioners/session), protocol version 1.

Every frame is one JSON text message, a tagged union on "type". Unknown fields and unknown types
are refused (close 4400). See docs/provisioner-protocol.md for the conversation and close codes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

import msgspec

from controlplane.wire.common import Labels

PROTOCOL_VERSION = 1

RequestId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")
]


MAX_TEMPLATES = 1000
MAX_RESERVATIONS = 1000
MAX_INSTANCES_PER_BATCH = 500
MAX_ASSIGNED = 1000
MAX_REPORT_EVENTS = 1000
MAX_OBSERVED = 5000

Count = Annotated[int, msgspec.Meta(ge=0, le=100_000)]
TemplateKey = Annotated[
    str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")
]
ProviderRunnerId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")
]
ProviderKind = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")
]
RunnerState = Literal["starting", "running", "stopping", "stopped", "failed", "terminated"]


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


class Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TemplateAd(Part):
    template_key: TemplateKey
    labels: Labels
    available_slots: Count
    starting: Count = 0
    running: Count = 0
    idle_target: Count = 0  # keep this many idle runners of the template ready (warm pool)


class InstanceRequest(Part):
    template_key: TemplateKey | None = None
    reservation_id: UUID | None = None


class ReportEvent(Part):
    provider_runner_id: ProviderRunnerId
    state: RunnerState
    reported_at: datetime
    reservation_id: UUID | None = None
    template_key: TemplateKey | None = None
    labels: Annotated[list[str], msgspec.Meta(max_length=20)] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=1000)] | None = None
    runner_session_id: UUID | None = None
    provider_kind: ProviderKind | None = None
    runner_instance_id: UUID | None = None  # accepted, ignored: the provider id is the key


# Client -> server


class Hello(Message, tag="hello"):
    protocol_version: int
    request_id: RequestId


class Ping(Message, tag="ping"):
    request_id: RequestId


class Advertise(Message, tag="advertise"):
    """What the provisioner can launch now; replaces its previous advertisement. An empty
    `templates` withdraws it. Answered by `advertised`, then a `demand` push."""

    request_id: RequestId
    templates: Annotated[list[TemplateAd], msgspec.Meta(max_length=MAX_TEMPLATES)]
    max_reservations: Annotated[int, msgspec.Meta(ge=0, le=MAX_RESERVATIONS)]
    reservation_ttl_seconds: Annotated[int, msgspec.Meta(ge=1, le=86_400)] | None = None


class CreateInstances(Message, tag="create_instances"):
    request_id: RequestId
    instances: Annotated[
        list[InstanceRequest], msgspec.Meta(min_length=1, max_length=MAX_INSTANCES_PER_BATCH)
    ]
    provider_kind: ProviderKind | None = None


class AttachProvider(Message, tag="attach_provider"):
    request_id: RequestId
    runner_instance_id: UUID
    provider_runner_id: ProviderRunnerId


class Assign(Message, tag="assign"):
    request_id: RequestId
    reservation_id: UUID
    runner_instance_ids: Annotated[list[UUID], msgspec.Meta(min_length=1, max_length=MAX_ASSIGNED)]


class Report(Message, tag="report"):
    request_id: RequestId
    events: Annotated[list[ReportEvent], msgspec.Meta(min_length=1, max_length=MAX_REPORT_EVENTS)]


class Reconcile(Message, tag="reconcile"):
    request_id: RequestId
    observed_provider_runner_ids: Annotated[
        list[ProviderRunnerId], msgspec.Meta(max_length=MAX_OBSERVED)
    ]


MAX_EPHEMERAL_TOKENS = 500


class MintEphemeral(Message, tag="mint_ephemeral"):
    """One-use ephemeral registration tokens (`cp_ert_`), one per provider runner id, all or
    none. With `reservation_id`, for that live launch reservation's workspace (an installation
    provisioner must name one); without, for the workspace provisioner's own workspace."""

    request_id: RequestId
    provider_runner_ids: Annotated[
        list[ProviderRunnerId], msgspec.Meta(min_length=1, max_length=MAX_EPHEMERAL_TOKENS)
    ]
    reservation_id: UUID | None = None


ClientMessage = (
    Hello
    | Ping
    | Advertise
    | CreateInstances
    | AttachProvider
    | Assign
    | Report
    | Reconcile
    | MintEphemeral
)


# Server -> client


class Grant(Part):
    """A launch reservation: launch `count` runners able to serve `labels` for `workspace_id`
    before `expires_at`, creating their instances with this `reservation_id`."""

    reservation_id: UUID
    workspace_id: UUID
    labels: list[str]
    count: int
    expires_at: datetime


class DemandStat(Part):
    workspace_id: UUID
    labels: list[str]
    queued: int
    reserved: int  # advisory: live reserved units after this round
    oldest_queued_at: datetime


class WarmLaunch(Part):
    template_key: str
    labels: list[str]
    count: int


class Welcome(Message, tag="welcome"):
    session_id: UUID
    generation: int
    request_id: str
    idle_timeout_seconds: float
    # The provisioner's live launch reservations with units still to launch: after a
    # reconnect, its grants continue.
    outstanding: list[Grant] = msgspec.field(default_factory=list)


class Pong(Message, tag="pong"):
    request_id: str


class Advertised(Message, tag="advertised"):
    request_id: str
    templates: int


class Demand(Message, tag="demand"):
    """Pushed after an advertisement and whenever the allocation changes what this provisioner
    should do: new grants, new warm launches, terminate intents, or new demand figures."""

    seq: int
    stats: list[DemandStat]
    grants: list[Grant]
    warm: list[WarmLaunch]
    newly_reserved: int
    terminate_provider_runner_ids: list[str]


class CreatedInstance(Part):
    runner_instance_id: UUID
    bootstrap_token: str
    request_index: int


class InstancesCreated(Message, tag="instances_created"):
    request_id: str
    runner_instances: list[CreatedInstance]
    reservation_unavailable: bool


class Attached(Message, tag="attached"):
    request_id: str
    attached: bool


class Assigned(Message, tag="assigned"):
    request_id: str
    runner_instance_ids: list[UUID]


class Reported(Message, tag="reported"):
    request_id: str
    accepted: int
    reservations_released: int


class BoundJob(Part):
    job_id: UUID
    workflow_run_attempt_id: UUID
    last_heartbeat_at: datetime
    cancellation_requested_at: datetime | None


class ReconciledRunner(Part):
    provider_runner_id: str
    state: str | None
    intended_reservation_id: UUID | None
    reservation_id: UUID | None
    runner_session_id: UUID | None
    bound_job: BoundJob | None
    desired_intent: Literal["keep", "terminate"]


class Reconciled(Message, tag="reconciled"):
    request_id: str
    runners: list[ReconciledRunner]
    terminated_absent_provider_runner_ids: list[str]


class MintedToken(Part):
    provider_runner_id: str
    token: str  # raw, sent once
    expires_at: datetime


class EphemeralMinted(Message, tag="ephemeral_minted"):
    request_id: str
    tokens: list[MintedToken]  # in request order


class Error(Message, tag="error"):
    """The request was refused and changed nothing; the session stays open."""

    request_id: str
    code: str
    message: str


ServerMessage = (
    Welcome
    | Pong
    | Advertised
    | Demand
    | InstancesCreated
    | Attached
    | Assigned
    | Reported
    | Reconciled
    | Error
    | EphemeralMinted
)

_decoder = msgspec.json.Decoder(ClientMessage)
_encoder = msgspec.json.Encoder()


def decode_client(frame: str | bytes) -> ClientMessage:
    """Raises msgspec.DecodeError (a ValidationError is one) for anything but a valid message."""
    return _decoder.decode(frame)


def encode_server(message: ServerMessage) -> str:
    return _encoder.encode(message).decode()
