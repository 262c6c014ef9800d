"""The tail of a job's output: what the runner keeps of it and the server stores with the outcome.

The orchestrator owns a job's logs; we keep only a bounded tail, so that whoever enqueued a job
can see why it failed without going elsewhere. The bound is in bytes of UTF-8, the cut never
splits a character, and the text can always be stored (PostgreSQL text cannot hold NUL).
"""

from __future__ import annotations

DEFAULT_TAIL_BYTES = 16 * 1024
REPLACEMENT = "\ufffd"


def _starts_mid_character(data: bytes) -> int:
    """How many leading bytes continue a character whose start was cut off (at most 3)."""
    skip = 0
    while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
        skip += 1
    return skip


def tail_of_text(text: str, limit: int) -> str:
    """The last `limit` bytes of `text` in UTF-8, cut on a character boundary, NUL replaced."""
    text = text.replace("\x00", REPLACEMENT)
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    data = data[len(data) - limit :]
    return data[_starts_mid_character(data) :].decode("utf-8", errors="replace")


def tail_of_output(data: bytes, limit: int) -> str:
    """Raw output bytes (any encoding, possibly cut anywhere) as a storable tail of `limit`
    bytes: invalid UTF-8 becomes U+FFFD, which can make the text longer, so it is cut again."""
    if len(data) > limit:
        data = data[len(data) - limit :]
        data = data[_starts_mid_character(data) :]
    return tail_of_text(data.decode("utf-8", errors="replace"), limit)


class OutputTail:
    """The last `limit` bytes of a stream, kept as it is fed: memory stays bounded however much
    a job prints."""

    def __init__(self, limit: int = DEFAULT_TAIL_BYTES) -> None:
        self.limit = limit
        self._kept = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._kept += chunk
        # Keep a few bytes more than the limit so the cut can land on a character boundary.
        excess = len(self._kept) - (self.limit + 4)
        if excess > 0:
            del self._kept[:excess]

    def text(self) -> str:
        return tail_of_output(bytes(self._kept), self.limit)
