"""The served OpenAPI document: equal to the committed docs/openapi.json, and complete."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from starlette.routing import Route, WebSocketRoute

from controlplane.web import app as web_app
from tests.web.conftest import Api

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REGENERATE = "regenerate: python -m controlplane.web.openapi > docs/openapi.json"


async def _served(api: Api) -> dict[str, Any]:
    response = await api.http.get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document: dict[str, Any] = response.json()
    return document


async def test_served_document_is_the_committed_one(api: Api) -> None:
    assert await _served(api) == json.loads(COMMITTED.read_text()), REGENERATE


async def test_every_route_is_documented_with_its_methods(api: Api) -> None:
    document = await _served(api)
    assert api.daemon.services is not None
    routes = web_app.build(api.daemon.services).routes
    expected = set()
    for route in routes:
        if isinstance(route, WebSocketRoute):
            continue  # described in docs/provisioner-protocol.md, not in OpenAPI
        assert isinstance(route, Route)
        assert route.methods is not None
        expected |= {(route.path, method.lower()) for method in route.methods - {"HEAD"}}
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert documented == expected


# Routes that validate their body or query before the token (as the reference's control-plane
# routes do) get a valid one, so that what is checked is the missing token.
VALID_BEFORE_AUTH: dict[str, tuple[str, Any]] = {
    "/v1/runner-control/enrollment": (
        "", {"labels": ["linux"], "provider_kind": "docker", "protocol_version": "1"},
    ),
    "/v1/runner-control/provider-runner": ("", {"provider_runner_id": "c-1"}),
    "/v1/runner-control/assignment": ("?wait_seconds=1", None),
}  # fmt: skip


async def test_routes_with_a_token_refuse_a_missing_one_as_documented(api: Api) -> None:
    document = await _served(api)
    checked = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if "security" not in operation:
                continue
            url = path.replace("{job_execution_id}", str(uuid.uuid4()))
            url = url.replace("{id}", str(uuid.uuid4()))
            query, body = VALID_BEFORE_AUTH.get(path, ("", None))
            response = await api.http.request(method.upper(), url + query, json=body)
            assert response.status_code == 401, (method, path)
            error = response.json()["error"]
            documented = operation["responses"]["401"]["content"]["application/json"]["schema"]
            assert (
                error["code"]
                in documented["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"]
            )
            checked += 1
    assert checked == 32
