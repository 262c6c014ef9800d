"""Wire pieces shared by several routes: labels, capabilities, the error envelope."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from controlplane.domain.labels import MAX_LABEL_LENGTH, MAX_LABELS

Label = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_LABEL_LENGTH, pattern="^[A-Za-z0-9][A-Za-z0-9._-]*$"),
]
Labels = Annotated[list[Label], msgspec.Meta(min_length=1, max_length=MAX_LABELS)]
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
HarnessName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-z0-9][a-z0-9_-]*$")
]
Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f\x7f]*$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Harness(Strict):
    tools: Annotated[list[ToolName], msgspec.Meta(max_length=256)]


class Capabilities(Strict):
    harnesses: Annotated[dict[HarnessName, Harness], msgspec.Meta(max_length=16)]

    def duplicate_tools(self) -> list[str]:
        return [
            f"{name}:{tool}"
            for name, harness in sorted(self.harnesses.items())
            for tool in sorted({t for t in harness.tools if harness.tools.count(t) > 1})
        ]

    def as_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class ErrorBody(Strict):
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorEnvelope(Strict):
    error: ErrorBody
