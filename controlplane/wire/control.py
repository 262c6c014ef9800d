"""Messages of the provisioner control session (WS /v1/provisioners/session), protocol version 1.

Every frame is one JSON text message, a tagged union on "type". Unknown fields and unknown types
are refused (close 4400). See docs/provisioner-protocol.md for the conversation and close codes.
"""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

import msgspec

PROTOCOL_VERSION = 1

RequestId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")
]


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


# Client -> server


class Hello(Message, tag="hello"):
    protocol_version: int
    request_id: RequestId


class Ping(Message, tag="ping"):
    request_id: RequestId


ClientMessage = Hello | Ping


# Server -> client


class Welcome(Message, tag="welcome"):
    session_id: UUID
    generation: int
    request_id: str
    idle_timeout_seconds: float


class Pong(Message, tag="pong"):
    request_id: str


ServerMessage = Welcome | Pong

_decoder = msgspec.json.Decoder(ClientMessage)
_encoder = msgspec.json.Encoder()


def decode_client(frame: str | bytes) -> ClientMessage:
    """Raises msgspec.DecodeError (a ValidationError is one) for anything but a valid message."""
    return _decoder.decode(frame)


def encode_server(message: ServerMessage) -> str:
    return _encoder.encode(message).decode()
