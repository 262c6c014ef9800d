"""The JSON log lines: one object per line, plain JSON values, no terminal colour codes."""

from __future__ import annotations

import json
import logging

from controlplane.logs import JsonFormatter


def _line(message: str, *args: object, **extra: object) -> dict[str, object]:
    record = logging.LogRecord("test", logging.INFO, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    entry: dict[str, object] = json.loads(JsonFormatter().format(record))
    return entry


def test_none_is_null_and_numbers_stay_numbers() -> None:
    entry = _line("job.done", job_id=None, count=3, ratio=0.5, ok=True)
    assert entry["job_id"] is None
    assert (entry["count"], entry["ratio"], entry["ok"]) == (3, 0.5, True)


def test_uvicorns_coloured_copy_of_the_message_is_dropped() -> None:
    entry = _line(
        "Started server process [%d]",
        7,
        color_message="Started server process [\x1b[36m%d\x1b[0m]",
    )
    assert entry["event"] == "Started server process [7]"
    assert "color_message" not in entry
    assert "\x1b" not in json.dumps(entry)


def test_a_token_in_a_value_is_masked() -> None:
    token = "cp_oak_" + "a" * 40
    entry = _line("x", error=f"refused {token}")
    assert token not in json.dumps(entry)
