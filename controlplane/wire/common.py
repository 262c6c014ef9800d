"""Wire pieces shared by several routes: labels, capabilities, the error envelope, and the
text and number rules that the OpenAPI document publishes as they are enforced."""

from __future__ import annotations

import sys
import unicodedata
from datetime import datetime
from typing import Annotated, Any

import msgspec

from controlplane.domain.labels import MAX_LABEL_LENGTH, MAX_LABELS

LABEL_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
Label = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_LENGTH, pattern=LABEL_PATTERN)
]
Labels = Annotated[list[Label], msgspec.Meta(min_length=1, max_length=MAX_LABELS)]
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
HarnessName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-z0-9][a-z0-9_-]*$")
]
Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f\x7f]*$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")]


# The control (Cc) and format (Cf) characters, as ranges, of the Unicode version Python 3.11
# ships. Scanning the code space for them costs about 110 ms at import, which every CLI command
# paid; another Python's Unicode is scanned (tests/test_wire_text.py checks this table).
KNOWN_CONTROLS = {
    "14.0.0": (
        (0x0, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD),
        (0x70F, 0x70F), (0x890, 0x891), (0x8E2, 0x8E2), (0x180E, 0x180E), (0x200B, 0x200F),
        (0x202A, 0x202E), (0x2060, 0x2064), (0x2066, 0x206F), (0xFEFF, 0xFEFF),
        (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x13438),
        (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
    ),
}  # fmt: skip


def refused_codes() -> list[int]:
    """Every control and format character of this Python's Unicode, by scanning."""
    return [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in ("Cc", "Cf")]


def _refused_characters() -> str:
    """A regex character class body of every control (Cc) and format (Cf) character, as ranges
    (BMP ones escaped, the few astral ones literal: valid in Python and in ECMA-262 with the
    `u` flag that JSON Schema implies)."""
    known = KNOWN_CONTROLS.get(unicodedata.unidata_version)
    found = (
        [code for low, high in known for code in range(low, high + 1)] if known else refused_codes()
    )
    ranges: list[list[int]] = []
    for code in found:
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])

    def one(code: int) -> str:
        return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)

    return "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges)


_REFUSED = _refused_characters()
# Not blank (one character that is not white space) and no control or format character.
PLAIN_TEXT_PATTERN = f"^[^{_REFUSED}]*[^{_REFUSED}\\s][^{_REFUSED}]*$"


def whole(value: float | None) -> int | None:
    """A whole-number field's value as an int (the wire type is a float that is a multiple of
    1, so that 5.0 is accepted like 5, as JSON Schema's `integer` says)."""
    return None if value is None else int(value)


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Harness(Strict):
    # Checked (with the duplicates named) by Capabilities.duplicate_tools() in the routes.
    tools: Annotated[
        list[ToolName], msgspec.Meta(max_length=256, extra_json_schema={"uniqueItems": True})
    ]


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


class EffectiveCapabilities(Strict):
    """A runner session's tool capabilities as they count now: its report, or no harness at all
    when it sent none or the report is older than runners.tool_capabilities_stale_after_seconds
    (`report_fresh` false). `reported_at` is when the stored report was sent, fresh or not."""

    capabilities: Capabilities
    report_fresh: bool
    reported_at: datetime | None


class ErrorBody(Strict):
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorEnvelope(Strict):
    error: ErrorBody
