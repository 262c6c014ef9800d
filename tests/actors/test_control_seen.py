"""The replica's batch of pinged control sessions (`actors.control.LastSeen`), with a fake store
on trio's mock clock: no ping, no statement; the sessions pinged since the last batch are stamped
in one call; one found fenced there is superseded (its socket then closes with the fence's code)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import anyio
import pytest
import trio.testing

from controlplane.actors.control import ControlSessions, LastSeen, LocalSession

EVERY = 10.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class FakeSeen:
    def __init__(self) -> None:
        self.batches: list[list[tuple[UUID, int]]] = []
        self.fenced: set[tuple[UUID, int]] = set()  # lost their generation
        self.busy: set[tuple[UUID, int]] = set()  # row locked: skipped by the batch
        self.alone: list[tuple[UUID, int]] = []

    async def stamp(self, sessions: Sequence[tuple[UUID, int]]) -> set[tuple[UUID, int]]:
        self.batches.append(list(sessions))
        return {s for s in sessions if s not in self.fenced and s not in self.busy}

    async def current(self, provisioner_id: UUID, generation: int) -> bool:
        self.alone.append((provisioner_id, generation))
        return (provisioner_id, generation) not in self.fenced


def _local(registry: ControlSessions) -> LocalSession:
    session = LocalSession(uuid.uuid4(), uuid.uuid4(), 1, anyio.CancelScope())
    registry.register(session)
    return session


async def test_pinged_sessions_are_stamped_in_one_batch_and_a_fenced_one_superseded() -> None:
    registry = ControlSessions()
    store = FakeSeen()
    quiet, pinged, busy, lost = (_local(registry) for _ in range(4))
    store.busy.add((busy.provisioner_id, 1))
    store.fenced.add((lost.provisioner_id, 1))
    last_seen = LastSeen(registry, store, every=EVERY)
    async with anyio.create_task_group() as group:
        await group.start(last_seen.run)
        await anyio.sleep(20 * EVERY + 1)
        assert store.batches == []  # nobody pinged: not one statement
        for session in (pinged, busy, lost):
            session.seen = True
        await anyio.sleep(EVERY)
        group.cancel_scope.cancel()
    assert len(store.batches) == 1
    assert {p for p, _ in store.batches[0]} == {
        pinged.provisioner_id,
        busy.provisioner_id,
        lost.provisioner_id,
    }
    # The two left out are fenced alone; only the one that lost its generation is superseded.
    assert sorted(store.alone) == sorted([(busy.provisioner_id, 1), (lost.provisioner_id, 1)])
    assert [s.superseded for s in (quiet, pinged, busy, lost)] == [False, False, False, True]
    assert lost.scope.cancel_called
    assert not any(s.seen for s in (quiet, pinged, busy, lost))
