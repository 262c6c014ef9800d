from __future__ import annotations

import anyio

from controlplane.actors.maintenance import Leadership
from controlplane.store.pool import PoolSettings


async def test_one_leader_at_a_time_and_the_lock_passes_on_when_it_steps_down(
    database_url: str,
) -> None:
    first = Leadership(PoolSettings(url=database_url))
    second = Leadership(PoolSettings(url=database_url))
    try:
        assert await first.try_lead()
        assert not await second.try_lead()
        assert await first.try_lead()  # still leading: the probe keeps it
        assert not await second.try_lead()  # retried on its kept connection
        first.step_down()  # its session ends, which releases the lock
        with anyio.fail_after(10):  # the server ends that session asynchronously
            while not await second.try_lead():
                await anyio.sleep(0.01)
        assert not await first.try_lead()
    finally:
        first.step_down()
        second.step_down()
