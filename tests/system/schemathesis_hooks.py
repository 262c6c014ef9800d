"""Schemathesis hooks for tests/system/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

Strings must not hold NUL (docs/api.md): PostgreSQL cannot store it. `--generation-allow-x00
false` keeps it out of generated strings, but not out of the fixed strings the coverage phase
draws on, so every case is filtered here as well.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _free_of_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        return all(_free_of_nul(key) and _free_of_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return all(_free_of_nul(item) for item in value)
    return True


def _key_without_limit(body: Any) -> bool:
    """An enqueued job with one of concurrency_key and concurrency_limit and not the other. The
    schema says they go together (an `anyOf` on EnqueueJob), but the coverage phase draws
    properties one at a time and breaks it; the route answers 400 concurrency-key-incomplete."""
    jobs = body.get("jobs") if isinstance(body, dict) else None
    return isinstance(jobs, list) and any(
        isinstance(job, dict)
        and (job.get("concurrency_key") is None) != (job.get("concurrency_limit") is None)
        for job in jobs
    )


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    """Every phase's cases pass here, the coverage phase's fixed strings included."""
    parts = (case.path_parameters, case.query, case.headers, case.body)
    return all(_free_of_nul(part) for part in parts) and not _key_without_limit(case.body)
