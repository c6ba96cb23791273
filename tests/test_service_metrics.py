"""/metrics of `gpucr serve --http` on simcuda (issue 29 item 2): it parses with prometheus_client's own parser, its
names follow Prometheus's conventions, and its counts move as a scripted swap scenario runs: an idle park, a resume on
demand, a park by hand, a park refused by the host budget, an app that ends (its series go)."""
from __future__ import annotations

import os
import re
import signal

import pytest

import test_swap
from service_api import Api
from test_swap import _state, _until

prometheus = pytest.importorskip("prometheus_client.parser", reason="in gpucr's service extra: pip install -e .[test]")
swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
MiB = 1 << 20


@pytest.fixture
def server_args() -> list[str]:
    return ["--http", "127.0.0.1:0"]


def scrape(api: Api) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of one scrape, read by prometheus_client's parser."""
    text = api.get("/metrics")
    out = {}
    for family in prometheus.text_string_to_metric_families(text):
        assert re.fullmatch(r"gpucr_[a-z_]+", family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    got = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def apps_in(samples: dict) -> set[str]:
    return {dict(ls)["app"] for (_n, ls) in samples if "app" in dict(ls)}


def test_metrics_move_as_a_swap_scenario_runs(swap_server, swap_app):
    api = Api(swap_server)
    a = swap_app("alpha", "--idle-park", "1")
    b = swap_app("beta")
    a.ask("work 1")
    b.ask("work 1")
    # Only beta is waited for: alpha may already be idle-parked (1 s) on a loaded machine, and its park's moved bytes
    # below show it held its memory.
    gpu = api.get("/api/v1/gpus")["gpus"][0]["uuid"]
    _until("both apps are scraped and beta holds its memory", lambda: apps_in(m := scrape(api)) == {"alpha", "beta"}
           and m.get(("gpucr_app_gpu_memory_bytes", frozenset({"app": "beta", "gpu": gpu}.items())), 0) >= 11 * MiB)
    m = scrape(api)
    assert value(m, "gpucr_app_state", app="beta", state="resident") == 1
    assert value(m, "gpucr_app_state", app="beta", state="parked") == 0
    assert value(m, "gpucr_app_gpu_memory_bytes", app="beta", gpu=gpu) >= 11 * MiB
    assert value(m, "gpucr_gpu_memory_total_bytes", gpu=gpu) == 4 << 30
    assert value(m, "gpucr_gpu_memory_used_bytes", gpu=gpu, by="apps") >= 11 * MiB
    assert not [k for k in m if "pid" in dict(k[1])], "apps are labelled by name and GPU, never by pid"

    _until("alpha is idle-parked", lambda: _state(swap_server, "alpha") == "parked")
    m = scrape(api)
    assert value(m, "gpucr_app_switches_total", app="alpha", direction="park") == 1
    assert value(m, "gpucr_app_switch_seconds_count", app="alpha", direction="park") == 1
    assert value(m, "gpucr_app_switch_seconds_bucket", app="alpha", direction="park", le="+Inf") == 1
    assert value(m, "gpucr_app_switch_seconds_sum", app="alpha", direction="park") > 0
    assert value(m, "gpucr_app_moved_bytes_total", app="alpha", direction="park") >= 11 * MiB
    assert value(m, "gpucr_app_last_switch_bytes_per_second", app="alpha", direction="park") > 0
    assert value(m, "gpucr_app_host_memory_bytes", app="alpha") >= 11 * MiB
    assert value(m, "gpucr_app_gpu_memory_bytes", app="alpha", gpu=gpu) == 0
    assert value(m, "gpucr_app_state", app="alpha", state="parked") == 1

    a.ask("work 1", timeout=30)   # demand: resumed
    _until("alpha is resumed", lambda: _state(swap_server, "alpha") == "resident")
    assert api.post("/api/v1/apps/beta/park").status == 200
    m = scrape(api)
    assert value(m, "gpucr_app_switches_total", app="alpha", direction="resume") == 1
    assert value(m, "gpucr_app_moved_bytes_total", app="alpha", direction="resume") >= 11 * MiB
    assert value(m, "gpucr_app_switches_total", app="beta", direction="park") == 1
    assert value(m, "gpucr_app_switches_total", app="beta", direction="resume") == 0
    switches = api.get("/api/v1/switches")["switches"]
    assert [(s["app"], s["direction"]) for s in switches] == [("alpha", "park"), ("alpha", "resume"), ("beta", "park")]
    assert sum(s["bytes_moved"] for s in switches if s["app"] == "alpha") == \
        sum(value(m, "gpucr_app_moved_bytes_total", app="alpha", direction=d) for d in ("park", "resume"))
    assert value(m, "gpucr_server_requests_total") >= 3

    os.kill(b.pid, signal.SIGKILL)
    b.proc.wait()
    _until("the ended app's series are gone", lambda: apps_in(scrape(api)) == {"alpha"})


@pytest.mark.parametrize("server_args", [["--http", "127.0.0.1:0", "--host-budget", "4M"]])
def test_a_park_refused_by_the_host_budget_is_counted_by_reason(swap_server, swap_app):
    api = Api(swap_server)
    swap_app("big", "--idle-park", "1")
    _until("its park is refused by the host budget (12 MiB past 4 MiB)", lambda: (m := scrape(api)) and apps_in(m)
           and value(m, "gpucr_app_refusals_total", app="big", reason="no_host_room") >= 1)
    m = scrape(api)
    assert value(m, "gpucr_host_budget_bytes") == 4 * MiB
    assert value(m, "gpucr_app_refusals_total", app="big", reason="park_failed") == 0
    assert value(m, "gpucr_app_state", app="big", state="resident") == 1
