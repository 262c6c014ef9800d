"""Reading /metrics over real HTTP, and how much a sample moved between two reads."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.web.conftest import Api

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(api: Api) -> Samples:
    response = await api.http.get("/metrics")
    assert response.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def mover(before: Samples, after: Samples) -> Callable[..., float]:
    """`moved(name, **labels)`: the sample's change from `before` to `after` (absent is 0)."""

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    return moved
