from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from controlplane import metrics
from tests.web.conftest import Api


def _declared() -> set[str]:
    return {family.name for family in metrics.REGISTRY.collect()}


async def _scrape(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await api.http.get("/metrics")
    assert response.status_code == 200
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_every_declared_metric_is_exposed_and_parses(api: Api) -> None:
    response = await api.http.get("/metrics")
    exposed = {family.name for family in text_string_to_metric_families(response.text)}
    assert _declared() <= exposed
    assert all(name.startswith("controlplane_") for name in _declared())


async def test_s101_counters_move_with_their_events(api: Api) -> None:
    before = await _scrape(api)
    session = await api.register()
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    assert (await api.enqueue(job)).status_code == 200  # a duplicate
    taken = await api.request_job(session)
    assert taken.status_code == 200
    assert (await api.request_job(session)).status_code == 204
    done = await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/complete",
        json={"outcome": "failed"},
        headers=api.auth(taken.json()["lease_token"]),
    )
    assert done.status_code == 200
    after = await _scrape(api)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("controlplane_jobs_enqueued_total", result="enqueued") == 1
    assert moved("controlplane_jobs_enqueued_total", result="duplicate") == 1
    assert moved("controlplane_job_claims_total", outcome="claimed") == 1
    assert moved("controlplane_job_claims_total", outcome="empty") == 1
    assert moved("controlplane_jobs_completed_total", outcome="failed") == 1
    assert moved("controlplane_dispatch_seconds_count", outcome="claimed") == 1
    assert after[("controlplane_listener_connected", ())] == 1
