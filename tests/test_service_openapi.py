"""The HTTP API against its own OpenAPI schema (issue 29 item 1): schemathesis generates requests from /openapi.json
and runs them against a live `gpucr serve --http` on simcuda with a swap app under it, checking every answer (status
codes, content types, bodies against the schema, no server error, the token enforced)."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="in gpucr's test extra: pip install -e .[test]")
from hypothesis import HealthCheck, settings  # noqa: E402

import test_swap  # noqa: E402
from service_api import Api  # noqa: E402
from test_swap import _until  # noqa: E402

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
EXAMPLES = 25   # per operation: enough to reach every status each operation documents, on a machine of 2 cores


@pytest.fixture
def server_args() -> list[str]:
    return ["--http", "127.0.0.1:0"]


@pytest.fixture
def api(swap_server, swap_app) -> Api:
    """The API of a server with one swap app, resident, which the generated requests may park, resume and change."""
    w = swap_app("gen")
    w.ask("work 1")
    api = Api(swap_server)
    _until("the app is registered", lambda: api.get("/api/v1/apps")["apps"])
    return api


@pytest.fixture
def api_schema(api):
    """The server's own schema, with the running app's name as the example of an app's name: the explicit examples
    then park, resume and change a real app, and its answers are checked too (random names find none)."""
    raw = api.get("/openapi.json")
    for item in raw["paths"].values():
        for p in item.get("parameters", []):
            if p["name"] == "name":
                p["example"] = "gen"
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=api.url)
    schema.config.max_stream_events = 1   # the event stream is endless: its first event is checked
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def test_the_timeline_of_a_real_park_and_resume_follows_the_schema(api, api_schema):
    """The generated requests need not reach /switches after a park: here a park and a resume of the app come first,
    so the timeline answered holds real switches, each field of which the schema must name (two_way once was not)."""
    assert api.post("/api/v1/apps/gen/park").status == 200
    assert api.post("/api/v1/apps/gen/resume").status == 200
    switches = api.get("/api/v1/switches")["switches"]
    assert [s["direction"] for s in switches] == ["park", "resume"], switches
    assert all(s["phases_s"] for s in switches), switches   # where each one's time went
    for path in ("/api/v1/switches", "/api/v1/state"):
        api_schema[path]["GET"].Case().call_and_validate(headers={"Authorization": f"Bearer {api.token}"})


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_follows_the_schema(case, api):
    case.call_and_validate(headers={"Authorization": f"Bearer {api.token}"})
