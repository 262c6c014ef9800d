"""web/queries.py: a query string decoded into its wire Struct, refused as docs/api.md says."""

from __future__ import annotations

import uuid
from urllib.parse import urlencode

import msgspec
import pytest
from starlette.requests import Request

from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput
from controlplane.settings import Settings
from controlplane.web.queries import decode, parameters
from controlplane.wire import queries

SETTINGS = Settings()


def _request(**params: str) -> Request:
    query = urlencode(params).encode()
    return Request(
        {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": query}
    )


def _refusal(kind: type, **params: str) -> InvalidInput:
    with pytest.raises(InvalidInput) as refused:
        decode(_request(**params), kind, SETTINGS)
    return refused.value


def test_absent_parameters_take_their_defaults() -> None:
    assert decode(_request(), queries.EventsQuery, SETTINGS) == queries.EventsQuery()
    page = decode(_request(), queries.PageQuery, SETTINGS)
    assert (page.limit, page.cursor) == (50, None)
    assert decode(_request(), queries.JobRequestQuery, SETTINGS).wait is None


def test_values_decode_to_their_types() -> None:
    workspace = uuid.uuid4()
    found = decode(
        _request(state="stopping", assignment="assigned", workspace_id=str(workspace), limit="7"),
        queries.RunnerInstancesQuery,
        SETTINGS,
    )
    assert found.state is RunnerState.STOPPING
    assert (found.assignment, found.workspace_id, found.limit) == ("assigned", workspace, 7)
    events = decode(_request(wait="2.5", after="1.2"), queries.EventsQuery, SETTINGS)
    assert (events.wait, events.after) == (2.5, "1.2")


def test_unknown_parameters_are_refused_only_where_the_struct_forbids_them() -> None:
    error = _refusal(queries.PageQuery, zzz="1", aaa="2")
    assert (error.message, error.details) == ("unknown query parameter aaa", {"field": "aaa"})
    assert decode(_request(zzz="1"), queries.EventsQuery, SETTINGS) == queries.EventsQuery()


def test_each_kind_is_refused_with_its_message_and_code() -> None:
    cases = [
        (queries.PageQuery, {"limit": "0"}, "query limit must be an integer from 1 to 100"),
        (queries.PageQuery, {"limit": "\u00b2"}, "query limit must be an integer from 1 to 100"),
        (queries.EventsQuery, {"wait": "x"}, "query wait must be a number"),
        (queries.EventsQuery, {"workspace_id": "x"}, "query workspace_id must be a UUID"),
        (queries.RunnerInstancesQuery, {"state": "gone"}, "query state must be one of "
         "starting, running, stopping, stopped, failed, terminated"),
        (queries.RunnerInstancesQuery, {"assignment": ""}, "query assignment must not be empty"),
        (queries.JobPageQuery, {"status": ""}, "query status must be pending, running or ended"),
        (queries.ProvisionerTokenPageQuery, {"active": "yes"},
         "query active must be true or false"),
        (queries.ActiveInstancesQuery, {}, "query workspace_id is required"),
        (queries.AssignmentQuery, {"wait_seconds": "0"},
         f"query wait_seconds must be an integer from 1 to {2**31 - 1}"),
    ]  # fmt: skip
    for kind, params, message in cases:
        error = _refusal(kind, **params)
        assert error.message == message, (kind, params)
        assert error.code == "validation-error"
        assert error.details == {"field": next(iter(params), "workspace_id")}
    for kind, name in ((queries.EventsQuery, "after"), (queries.PageQuery, "cursor")):
        error = _refusal(kind, **{name: ""})
        assert (error.code, error.details) == ("invalid-cursor", {"field": name})


def test_a_maximum_that_is_a_setting_is_the_serving_daemons() -> None:
    runners = msgspec.structs.replace(SETTINGS.runners, long_poll_max_seconds=10)
    tight = msgspec.structs.replace(SETTINGS, runners=runners)
    high = SETTINGS.runners.long_poll_max_seconds
    assert decode(_request(wait=str(high)), queries.EventsQuery, SETTINGS).wait == high
    with pytest.raises(InvalidInput, match="query wait must be between 0 and 10"):
        decode(_request(wait="11"), queries.EventsQuery, tight)
    (wait,) = (p for p in parameters(queries.EventsQuery, tight) if p["name"] == "wait")
    assert wait["schema"]["maximum"] == 10
