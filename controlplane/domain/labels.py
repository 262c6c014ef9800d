"""Runner labels: canonical form, the wire grammar, and the subset match rule.

A label set is a sorted tuple of distinct, trimmed, lower-cased, non-empty strings. Matching is
plain containment: a runner can take a job when every label the job requires is one the runner
has. No wildcards, no catalog expansion.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from controlplane.errors import InvalidInput, RunnerLabelsReserved

LabelSet = tuple[str, ...]

MAX_LABEL_LENGTH = 128
MAX_LABELS = 20
_GRAMMAR = re.compile(r"[a-z0-9][a-z0-9._-]*", re.IGNORECASE)


def canonicalise(labels: Iterable[str] | str | None) -> LabelSet:
    """Trim, lower-case, drop empties, deduplicate and sort (by code point)."""
    if labels is None:
        return ()
    if isinstance(labels, str):
        labels = [labels]
    return tuple(sorted({label.strip().lower() for label in labels} - {""}))


def label_error(label: str) -> str | None:
    """Why a raw label breaks the wire grammar, or None when it is valid."""
    if not 1 <= len(label) <= MAX_LABEL_LENGTH:
        return f"a label is 1 to {MAX_LABEL_LENGTH} characters long"
    if _GRAMMAR.fullmatch(label) is None:
        return "a label starts with a letter or digit and holds only letters, digits, '.', '_', '-'"
    return None


def validate(labels: Iterable[str], *, field: str = "labels") -> LabelSet:
    """Check raw wire labels against the grammar (before trimming) and return them canonical."""
    raw = list(labels)
    if not 1 <= len(raw) <= MAX_LABELS:
        raise InvalidInput(f"{field} holds 1 to {MAX_LABELS} labels", field=field, count=len(raw))
    for index, label in enumerate(raw):
        problem = label_error(label)
        if problem is not None:
            raise InvalidInput(f"{field}[{index}]: {problem}", field=field, index=index)
    return canonicalise(raw)


def parse_reserved(value: str) -> LabelSet:
    """Parse a comma-separated reserved-label list; every entry must obey the grammar."""
    entries = [entry.strip() for entry in value.split(",")]
    entries = [entry for entry in entries if entry]
    for entry in entries:
        problem = label_error(entry)
        if problem is not None:
            raise InvalidInput(f"reserved label {entry!r}: {problem}")
    return canonicalise(entries)


def strip_reserved(labels: LabelSet, reserved: LabelSet) -> LabelSet:
    return tuple(label for label in labels if label not in reserved)


def provisioned_labels(
    declared: Iterable[str], provisioner_scope: str | None, reserved: LabelSet
) -> LabelSet:
    """A provisioned runner's labels, as it registers or its provisioner enrolls it: canonical,
    and without the reserved ones unless its provisioner has installation scope. All reserved:
    `RunnerLabelsReserved`."""
    supplied = canonicalise(declared)
    labels = supplied
    if provisioner_scope != "installation":
        labels = strip_reserved(supplied, reserved)
    if not labels:
        raise RunnerLabelsReserved(
            "every supplied label is reserved for installation provisioners",
            labels=list(supplied),
        )
    return labels


def matches(required: LabelSet, runner: LabelSet) -> bool:
    """A runner may take a job when the job's labels are a subset of its own; never when empty."""
    return bool(runner) and set(required) <= set(runner)
