"""JSON logs: one object per line with a stable event name (the message) and the ids passed in
`extra`. Tokens are never passed to a logger; as a second line of defence any value that looks
like one of our tokens is masked."""

from __future__ import annotations

import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

# Record attributes that are not ours to log: the standard ones, and uvicorn's `color_message`
# (its message again, with terminal colour codes, for its own console formatter).
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}
_TOKEN = re.compile(r"cp_[a-z]{2,3}_[A-Za-z0-9_.\-]{16,}")
_encoder = msgspec.json.Encoder()


def _mask(value: Any) -> Any:
    if isinstance(value, str):
        return _TOKEN.sub(lambda m: m.group(0)[:7] + "…", value)
    return value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": _mask(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                plain = value is None or isinstance(value, int | float | bool)
                entry[key] = value if plain else _mask(str(value))
        if record.exc_info:
            entry["exception"] = _mask(self.formatException(record.exc_info))
        return _encoder.encode(entry).decode()


def configure(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
