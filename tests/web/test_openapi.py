"""The served OpenAPI document: equal to the committed docs/openapi.json, complete, and what the
server enforces (tests/system/test_schemathesis.py fuzzes the rest against a daemon process)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from controlplane import errors
from controlplane.web import app as web_app
from controlplane.web import openapi
from controlplane.web.operations import Op
from controlplane.web.operations import operation as declare
from tests.web.conftest import Api

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REGENERATE = "regenerate: python -m controlplane.web.openapi > docs/openapi.json"


async def _served(api: Api) -> dict[str, Any]:
    response = await api.http.get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document: dict[str, Any] = response.json()
    return document


async def test_committed_document_is_the_default_settings_one_and_served_with_own_limits(
    api: Api,
) -> None:
    """docs/openapi.json is the document of the built-in defaults; a daemon serves its own
    limits (this one's long_poll_max_seconds is 10, not the default 50)."""
    assert api.daemon.replica is not None
    routes = web_app.build(api.daemon.replica).routes
    assert openapi.encode(openapi.document(routes)) == COMMITTED.read_bytes(), REGENERATE
    served = await _served(api)
    assert served == openapi.document(routes, api.daemon.replica.settings)
    assert served != openapi.document(routes)
    job_wait = served["paths"]["/v1/runners/jobs/request"]["post"]["parameters"][0]
    assert job_wait["schema"]["maximum"] == 10


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def test_every_reference_resolves_and_every_operation_id_is_unique() -> None:
    document = json.loads(COMMITTED.read_text())
    refs = _refs(document)
    assert "#/components/schemas/HeartbeatResponse" in refs
    for ref in refs:
        assert ref.startswith("#/"), ref
        node: Any = document
        for part in ref[2:].split("/"):
            assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
            node = node[part]
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))


async def test_options_on_every_path_allows_exactly_the_documented_methods(api: Api) -> None:
    document = await _served(api)
    for path, item in document["paths"].items():
        url = path.replace("{job_execution_id}", str(uuid.uuid4())).replace(
            "{id}", str(uuid.uuid4())
        )
        response = await api.http.options(url)
        assert response.status_code == 405, path
        allowed = {method.strip() for method in response.headers["allow"].split(",")}
        assert allowed - {"HEAD"} == {method.upper() for method in item}, path


async def test_limits_in_the_document_are_the_ones_the_server_applies(api: Api) -> None:
    """Spot checks of rules that once lived only in handler code."""
    schemas = (await _served(api))["components"]["schemas"]
    admin = api.auth(api.admin_key)
    # A whole number written as a float is an integer to JSON Schema, and to the server.
    assert schemas["CreateApiKey"]["properties"]["ttl_seconds"]["anyOf"][0]["multipleOf"] == 1
    created = await api.http.post(
        "/v1/admin/api-keys",
        json={"kind": "orchestrator", "name": "f", "ttl_seconds": 60.0},
        headers=admin,
    )
    assert created.status_code == 201, created.text
    # An admin key with a workspace is outside the schema, and refused.
    admin_rule = schemas["CreateApiKey"]["allOf"][0]["anyOf"][1]
    assert admin_rule == {"properties": {"workspace_id": {"type": "null"}}}
    refused = await api.http.post(
        "/v1/admin/api-keys",
        json={"kind": "admin", "name": "a", "workspace_id": str(uuid.uuid4())},
        headers=admin,
    )
    assert refused.status_code == 400
    assert "installation-wide" in refused.json()["error"]["message"]
    # A revoke reason: the published pattern is the server's rule, format characters included.
    pattern = re.compile(schemas["Revoke"]["properties"]["reason"]["anyOf"][0]["pattern"])
    for reason, ok in (("rotated", True), ("  ", False), ("a\u200bb", False), ("\x85", False)):
        assert (pattern.search(reason) is not None) is ok, reason
        answer = await api.http.post(
            f"/v1/admin/api-keys/{created.json()['credential']['id']}/revoke",
            json={"reason": reason},
            headers=admin,
        )
        assert (answer.status_code == 200) is ok, (reason, answer.text)
    # Duplicate tools and a payload that is not an object are outside the schema.
    assert schemas["Harness"]["properties"]["tools"]["uniqueItems"] is True
    assert schemas["EnqueueJob"]["properties"]["payload"]["type"] == "object"
    assert schemas["EnqueueRequest"]["properties"]["jobs"]["maxItems"] == 500


async def test_every_route_is_documented_with_its_methods(api: Api) -> None:
    document = await _served(api)
    assert api.daemon.replica is not None
    routes = web_app.build(api.daemon.replica).routes
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
            url = url.replace("{workspace_id}", str(uuid.uuid4()))
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
    assert checked == 50


async def test_bearer_takes_exactly_one_space_as_documented(api: Api) -> None:
    document = await _served(api)
    assert "`Authorization: Bearer <token>`, exactly one space" in document["info"]["description"]
    for header in (f"Bearer {api.admin_key}", f"bearer {api.admin_key}"):
        response = await api.http.get("/v1/admin/queue", headers={"Authorization": header})
        assert response.status_code == 200, header
    for header in (f"Bearer  {api.admin_key}", f"Bearer   {api.admin_key}"):
        response = await api.http.get("/v1/admin/queue", headers={"Authorization": header})
        assert response.status_code == 401, header
        assert response.json()["error"]["code"] == "unauthorized"


def _server_error_classes() -> list[type[errors.ControlPlaneError]]:
    found: list[type[errors.ControlPlaneError]] = []
    todo: list[type[errors.ControlPlaneError]] = [errors.ControlPlaneError]
    while todo:
        kind = todo.pop()
        todo.extend(kind.__subclasses__())
        if kind.__module__.startswith("controlplane.") and "agent" not in kind.__module__:
            found.append(kind)
    return found


def test_every_error_class_has_its_own_code_and_says_when_it_is_raised() -> None:
    owners: dict[str, type[errors.ControlPlaneError]] = {}
    for kind in _server_error_classes():
        if kind.__module__ == errors.__name__:  # where every error class belongs
            assert errors.when(kind), f"{kind.__qualname__} has no docstring"
        if "code" in vars(kind):
            assert kind.code not in owners, (kind, owners.get(kind.code))
            owners[kind.code] = kind
    catalogue = errors.catalogue()
    assert {code: catalogue[code] for code in owners} == owners
    # The codes the document uses are the classes' own.
    document = json.loads(COMMITTED.read_text())
    for item in document["paths"].values():
        for operation in item.values():
            for status, response in operation["responses"].items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                if not status.startswith(("4", "5")) or "allOf" not in schema:
                    continue  # readyz's own 503 body is no error envelope
                for code in schema["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"]:
                    assert openapi.status(code) == int(status), code
                    assert f"`{code}`: {errors.when(catalogue[code])}" in response["description"]


def test_an_error_class_defined_anywhere_is_catalogued_without_a_table() -> None:
    class ProbeRefused(errors.Conflict):
        """the probe was refused"""

        code = "probe-refused-for-a-test"

    catalogue = errors.catalogue()
    assert catalogue["probe-refused-for-a-test"] is ProbeRefused
    assert errors.when(ProbeRefused) == "the probe was refused"
    assert list(catalogue).index("conflict") < list(catalogue).index("probe-refused-for-a-test")


async def _undeclared(_request: Request) -> Response:
    return Response()


@declare(Op("Declares a code no class owns", errors="no-such-code-anywhere"))
async def _unowned(_request: Request) -> Response:
    return Response()


def test_an_endpoint_must_declare_its_operation_and_only_codes_a_class_owns() -> None:
    with pytest.raises(ValueError, match="GET /undeclared declares no operation"):
        openapi.document([Route("/undeclared", _undeclared, methods=["GET"])])
    with pytest.raises(ValueError, match="no error class owns"):
        openapi.document([Route("/unowned", _unowned, methods=["GET"])])
    routes = web_app.build(None).routes
    assert openapi.encode(openapi.document(routes)) == COMMITTED.read_bytes(), REGENERATE
