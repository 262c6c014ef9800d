"""Each maintenance job's round with a fake store, on trio with a mock clock: batches, counts,
and which failures skip what."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

import pytest
import trio.testing

from controlplane import metrics
from controlplane.actors.maintenance.deadlines import Deadlines
from controlplane.actors.maintenance.provisioning import ProvisioningUpkeep
from controlplane.actors.maintenance.reaper import LeaseReaper
from controlplane.actors.maintenance.retention import Retention
from controlplane.actors.maintenance.sessions import SessionCleanup
from controlplane.domain.jobs import EndedLease, JobIdentity, StaleRule
from controlplane.store.fleet import PhaseCount


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def _lease() -> EndedLease:
    identity = JobIdentity(*(uuid.uuid4() for _ in range(6)))
    return EndedLease(identity, None, None, cancellation_requested=False, newly_ended=True)


class Batches:
    """Answers a statement with the next batch size in `sizes`, then 0; records each limit."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = list(sizes)
        self.limits: list[int] = []

    def next(self, limit: int) -> int:
        self.limits.append(limit)
        return min(self.sizes.pop(0), limit) if self.sizes else 0


# The lease reaper ------------------------------------------------------------------------------


class FakeReaperStore:
    def __init__(self, *sizes: int, released: int = 0) -> None:
        self.batches = Batches(*sizes)
        self.released = released

    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        return [_lease() for _ in range(self.batches.next(limit))], self.released


async def test_the_reaper_repeats_batches_until_one_is_short_and_counts_them() -> None:
    store = FakeReaperStore(10, 10, 3, 10, released=1)
    reaper = LeaseReaper(store, rule=StaleRule(), interval=5, limit=10)
    expired = _sample("controlplane_leases_expired_total")
    released = _sample("controlplane_reservation_units_released_total", source="maintenance")
    assert await reaper.run_once() == 23
    assert store.batches.limits == [10, 10, 10]  # the fourth batch waits for the next round
    assert _sample("controlplane_leases_expired_total") == expired + 23
    assert (
        _sample("controlplane_reservation_units_released_total", source="maintenance")
        == released + 3
    )


async def test_the_reaper_counts_retried_leases_apart_from_expired_ones() -> None:
    class Mixed:
        async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
            retried = EndedLease(
                _lease().identity, None, None, False, newly_ended=False, retried=True
            )
            return [_lease(), retried, retried], 0

    expired = _sample("controlplane_leases_expired_total")
    retried = _sample("controlplane_jobs_retried_total")
    assert await LeaseReaper(Mixed(), rule=StaleRule(), interval=5, limit=10).run_once() == 3
    assert _sample("controlplane_leases_expired_total") == expired + 1
    assert _sample("controlplane_jobs_retried_total") == retried + 2


# The execution deadlines -------------------------------------------------------------------------


class FakeDeadlineStore:
    def __init__(self, timed: tuple[int, ...], expired: tuple[int, ...]) -> None:
        self.timed, self.expired = Batches(*timed), Batches(*expired)
        self.graces: list[timedelta] = []

    async def time_out(self, grace: timedelta, limit: int) -> tuple[list[EndedLease], int]:
        self.graces.append(grace)
        return [_lease() for _ in range(self.timed.next(limit))], 0

    async def expire_queued(self, limit: int) -> int:
        return self.expired.next(limit)


async def test_the_deadlines_round_drains_timeouts_then_queue_expiries_and_counts_them() -> None:
    store = FakeDeadlineStore((10, 4), (10, 10, 0))
    job = Deadlines(store, grace=timedelta(seconds=60), interval=5, limit=10)
    timed = _sample("controlplane_jobs_timed_out_total")
    expired = _sample("controlplane_jobs_queue_expired_total")

    assert await job.run_once() == (14, 20)

    assert store.timed.limits == [10, 10] and store.expired.limits == [10, 10, 10]
    assert store.graces == [timedelta(seconds=60)] * 2
    assert _sample("controlplane_jobs_timed_out_total") == timed + 14
    assert _sample("controlplane_jobs_queue_expired_total") == expired + 20


async def test_an_idle_reaper_round_is_one_statement() -> None:
    store = FakeReaperStore()
    assert await LeaseReaper(store, rule=StaleRule(), interval=5, limit=10).run_once() == 0
    assert store.batches.limits == [10]


# Session cleanup -------------------------------------------------------------------------------


async def test_session_cleanup_asks_for_each_retention_and_its_limit() -> None:
    asked: list[dict[str, Any]] = []

    class Store:
        async def collect_garbage(self, **kwargs: Any) -> int:
            asked.append(kwargs)
            return 4

    cleanup = SessionCleanup(
        Store(),
        interval=300,
        limit=1000,
        manual_retention=timedelta(days=1),
        capped_retention=timedelta(days=7),
    )
    assert await cleanup.run_once() == 4
    assert asked == [
        {
            "manual_retention": timedelta(days=1),
            "capped_retention": timedelta(days=7),
            "limit": 1000,
        }
    ]


# Retention -------------------------------------------------------------------------------------


class FakeRetentionStore:
    def __init__(self, events: Batches, tombstones: Batches) -> None:
        self.events, self.tombstones = events, tombstones
        self.ages: list[tuple[str, timedelta]] = []

    async def prune_events(self, older_than: timedelta, limit: int) -> int:
        self.ages.append(("events", older_than))
        return self.events.next(limit)

    async def prune_tombstones(self, older_than: timedelta, limit: int) -> int:
        self.ages.append(("tombstones", older_than))
        return self.tombstones.next(limit)


async def test_retention_drains_events_then_tombstones_in_batches() -> None:
    store = FakeRetentionStore(Batches(100, 100, 100), Batches(100, 7))
    job = Retention(
        store,
        interval=3600,
        events=timedelta(days=30),
        tombstones=timedelta(days=90),
        batch=100,
    )
    assert await job.run_once() == (300, 107)
    assert store.events.limits == [100] * 4  # a full batch asks again; the empty one ends it
    assert store.tombstones.limits == [100] * 2
    assert {age for kind, age in store.ages if kind == "events"} == {timedelta(days=30)}
    assert {age for kind, age in store.ages if kind == "tombstones"} == {timedelta(days=90)}


# Provisioning upkeep ---------------------------------------------------------------------------


class FakeUpkeepStore:
    def __init__(self) -> None:
        self.reservations = Batches(2)
        self.calls: list[str] = []
        self.broken: set[str] = set()  # the calls that raise
        self.phases = [PhaseCount("idle", "docker", "warm", 3, 12.5)]
        self.enrolled = 2
        self.stale_after = timedelta(0)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.broken:
            raise ConnectionResetError(f"{name} lost its connection")

    async def delete_expired_reservations(self, limit: int) -> int:
        self._call("reservations")
        return self.reservations.next(limit)

    async def reap_stale_runners(self, threshold: timedelta, limit: int) -> tuple[int, int]:
        self._call("runners")
        return (4, 2)

    async def prune_runner_credentials(self, older_than: timedelta, limit: int) -> int:
        self._call("credentials")
        return 5

    async def prune_ephemeral_tokens(self, older_than: timedelta, limit: int) -> int:
        self._call("ephemeral")
        return 6

    async def phase_counts(self) -> list[PhaseCount]:
        self._call("phases")
        return self.phases

    async def enrolled_without_recent_report(self, stale_after: timedelta) -> int:
        self._call("enrolled")
        self.stale_after = stale_after
        return self.enrolled


def _upkeep(store: FakeUpkeepStore) -> ProvisioningUpkeep:
    return ProvisioningUpkeep(
        store, interval=10, stale_threshold=timedelta(seconds=300), reaper_limit=50
    )


def _phase_sample() -> float:
    return _sample(
        "controlplane_runner_instances_by_phase",
        phase="idle",
        provider="docker",
        launch_kind="warm",
    )


async def test_a_provisioning_round_runs_every_part_in_order() -> None:
    store = FakeUpkeepStore()
    reaped = _sample("controlplane_runner_instances_reaped_total")
    assert await _upkeep(store).run_once() == (2, 4, 11)
    assert store.calls == [
        "reservations", "runners", "credentials", "ephemeral", "phases", "enrolled"
    ]  # fmt: skip
    assert _sample("controlplane_runner_instances_reaped_total") == reaped + 4
    assert _phase_sample() == 3
    assert _sample("controlplane_runner_instances_enrolled_without_recent_report") == 2
    assert store.stale_after == timedelta(seconds=300)  # the stale-runner threshold


@pytest.mark.parametrize("broken", ["reservations", "runners", "credentials"])
async def test_j132_ephemeral_token_gc_and_the_gauges_survive_a_failed_upkeep(
    broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the split a failure here skipped the ephemeral tokens for the whole round."""
    store = FakeUpkeepStore()
    store.broken = {broken}
    store.phases = [PhaseCount("idle", "docker", "warm", 8, 1.0)]
    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        expired, reaped, pruned = await _upkeep(store).run_once()
    assert store.calls[-3:] == ["ephemeral", "phases", "enrolled"]
    assert (expired, reaped, pruned) == (0, 0, 6)  # only what the ephemeral GC pruned
    assert _phase_sample() == 8
    failures = [r for r in caplog.records if r.getMessage() == "maintenance.round_failed"]
    assert [r.__dict__["job"] for r in failures] == ["provisioning"]


async def test_a_failed_ephemeral_gc_or_phase_count_leaves_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FakeUpkeepStore()
    store.broken = {"ephemeral", "phases"}
    store.enrolled = 5
    prune_failures = _sample("controlplane_rate_limit_prune_failures_total")
    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        assert await _upkeep(store).run_once() == (2, 4, 5)
    events = [(r.getMessage(), r.__dict__.get("job")) for r in caplog.records]
    assert ("maintenance.round_failed", "ephemeral_gc") in events
    assert ("maintenance.phase_count_failed", None) in events
    # The limiter rows go with their tokens: a failed token GC is a failed limiter prune.
    assert _sample("controlplane_rate_limit_prune_failures_total") == prune_failures + 1
    assert _sample("controlplane_runner_instances_enrolled_without_recent_report") == 5


async def test_a_successful_ephemeral_gc_counts_no_prune_failure() -> None:
    prune_failures = _sample("controlplane_rate_limit_prune_failures_total")
    await _upkeep(FakeUpkeepStore()).run_once()
    assert _sample("controlplane_rate_limit_prune_failures_total") == prune_failures


async def test_s104_a_failing_enrolled_without_report_count_leaves_the_other_gauges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our queue-depth gauges are read by /metrics itself, apart from maintenance; the runner-
    phase gauges are the ones counted beside this one, and they are still refreshed."""
    store = FakeUpkeepStore()
    store.broken = {"enrolled"}
    store.phases = [PhaseCount("idle", "docker", "warm", 7, 1.0)]
    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        assert await _upkeep(store).run_once() == (2, 4, 11)
    assert _phase_sample() == 7
    assert "maintenance.enrolled_count_failed" in [r.getMessage() for r in caplog.records]
