"""records.row_mapper: a mapper made once per dataclass reads each field from the column of its
name and passes the converted ones through their function. Pure: a dict stands for the row (an
asyncpg Record is read by the same `row[name]`)."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import uuid4

import pytest

from controlplane.domain.jobs import JobIdentity
from controlplane.domain.runner_instances import LaunchKind, ProvisionedRunner, RunnerState
from controlplane.store.records import identity, row_mapper
from controlplane.store.reservations import runner_from_row


def test_identity_reads_each_field_from_its_column() -> None:
    row = {name: uuid4() for name in JobIdentity.__dataclass_fields__}
    assert identity(row) == JobIdentity(**row)  # type: ignore[arg-type]


def test_a_runner_row_is_read_with_its_conversions() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    row = dict.fromkeys(ProvisionedRunner.__dataclass_fields__)
    row |= {
        "id": uuid4(),
        "provisioner_id": uuid4(),
        "created_at": now,
        "state": "running",
        "labels": ["linux", "x64"],
        "reported_at": now,
        "updated_at": now,
        "launch_kind": "warm",
    }
    runner = runner_from_row(row)  # type: ignore[arg-type]
    assert runner == ProvisionedRunner(
        id=row["id"],  # type: ignore[arg-type]
        provisioner_id=row["provisioner_id"],  # type: ignore[arg-type]
        created_at=now,
        state=RunnerState.RUNNING,
        labels=("linux", "x64"),
        reported_at=now,
        updated_at=now,
        launch_kind=LaunchKind.WARM,
    )
    assert runner_from_row.__name__ == "ProvisionedRunner_from_row"


def test_a_conversion_for_no_field_is_refused() -> None:
    with pytest.raises(TypeError, match="JobIdentity has no field status"):
        row_mapper(JobIdentity, status=str)
