"""`gpucr bench --scenario swap --watch` on simcuda (the simulated driver, a test double): while three token servers
of 0.4 of a simulated card that holds two are parked and resumed on demand, the bench reads the page's data endpoint,
/metrics and the event stream through the serve's HTTP API every second, records them, and at the end sets the
metrics' counters against its own counts. Then the recording is replayed into the page (gpucr.service_http.replay),
which headless Chromium renders from it, as the docs' screenshot of a GPU run is made.

The page test also replays the recording of a GPU run (`scripts/gpu-check swap`, committed under bench/results): the
GPU machine has no browser. GPUCR_REPLAY=FILE replays that file in both instead; GPUCR_SCREENSHOT_DIR=DIR saves the
GPU run's screenshot there (service-page-replay.png, the one in docs/)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_service_page
from conftest import gpucr_cli
from gpucr.bench.swap_watch import read_recording
from gpucr.service_http.replay import frames

browser = test_service_page.browser
until_js, ROW_STATE, BAR_WIDTH = test_service_page._until_js, test_service_page.ROW_STATE, test_service_page.BAR_WIDTH
SERVERS = 3
GPU_RECORDING = Path(__file__).parents[1] / "bench" / "results" / "2026-12-06-h100-swap-watch.jsonl.gz"   # gpu-check swap
SWITCHES = ("const c = document.querySelector(`tr[data-app='${arguments[0]}'] td[data-label=switches]`); "
            "return c && c.textContent === arguments[1]")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One short scenario with --watch (its own runtime dir and simcuda device: module-scoped, it runs before the
    per-test ones are made), its results and recording."""
    base = tmp_path_factory.mktemp("watch")
    for d in ("gpucr", "simcuda"):
        (base / d).mkdir(mode=0o700)
    env = {**os.environ, "GPUCR_RUNTIME_DIR": str(base / "gpucr"), "SIMCUDA_DIR": str(base / "simcuda"),
           "SIMCUDA_TOTAL_MEM": str(400 << 20), "GPUCR_SIMULATE": "1"}
    out = base / "swap.json"
    r = gpucr_cli("bench", "--scenario", "swap", "--simulate", "--servers", str(SERVERS), "--gpu-util", "0.4",
                  "--requests", "6", "--zipf-share", "0.3", "--baseline-switches", "1", "--ways", "one-way",
                  "--time-budget", "120", "--request-timeout", "40", "--watch", "--out", str(out), env=env, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), base / "swap-watch.jsonl.gz", r.stderr


def test_the_metrics_read_through_the_api_match_the_benchs_own_counts(recorded):
    res, rec, stderr = recorded
    w = res["watch"]
    assert w["recording"] == rec.name and not w["errors"], w["errors"]
    got = w["metrics_vs_bench"]
    names = [f"swapbench-{i}" for i in range(SERVERS)]
    assert sorted(got["apps"]) == names
    for name in names:
        row = got["apps"][name]
        assert set(row) == {"parks", "resumes", "bytes_park", "bytes_resume"}, row
        for count in row.values():   # both numbers said, and the same
            assert count["metrics"] == count["bench"] and count["equal"], (name, row)
        assert row["parks"]["bench"] >= 1 and row["resumes"]["bench"] >= 1   # each server parked and resumed
        assert row["bytes_resume"]["bench"] >= row["resumes"]["bench"] * (96 << 20)
    assert got["equal"] and "the metrics' counts EQUAL to the bench's" in stderr
    # the bench's switches under the service: the same number as the metrics' parks and resumes together
    starts = res["start_switches"]
    assert [s["server"] for s in starts] == names and any(s["switched"] for s in starts)   # the third made room
    seen = sum(len(q.get("switched", ())) for q in res["requests"]) + sum(len(s["switched"]) for s in starts)
    assert seen == sum(r["parks"]["metrics"] + r["resumes"]["metrics"] for r in got["apps"].values())

    lines = read_recording(rec)
    by = {v: [x for x in lines if x["via"] == v] for v in ("state", "metrics", "events")}
    assert {v: len(x) for v, x in by.items()} == w["reads"]
    assert len(by["state"]) >= 5 and len(by["metrics"]) >= 5 and len(by["events"]) >= 3, w["reads"]
    for xs in by.values():
        assert [x["t"] for x in xs] == sorted(x["t"] for x in xs)
    # the metrics move as the scenario runs: each app's parks never go down, and go up between reads
    parks = [sum(a.get("parks", 0) for a in x["apps"].values()) for x in by["metrics"]]
    assert parks == sorted(parks) and parks[-1] > parks[0], parks
    assert by["metrics"][-1]["apps"] == {n: {k: c["metrics"] for k, c in got["apps"][n].items()} for n in names}
    assert {a["name"] for x in by["events"] for a in x["state"]["apps"]} == set(names)


@pytest.mark.parametrize("run", ["here", "gpu"])
def test_a_recorded_run_replays_into_the_page_in_headless_chromium(run, request, browser, tmp_path):
    """run: the scenario recorded here on simcuda, or the committed recording of a GPU run (GPU_RECORDING), whose
    screenshot is the docs' (GPUCR_SCREENSHOT_DIR)."""
    rec = Path(os.environ.get("GPUCR_REPLAY") or (GPU_RECORDING if run == "gpu" else request.getfixturevalue("recorded")[1]))
    played = frames(rec)
    last = played[-1]["state"]   # where the replay ends and stays: the last state that shows every app
    span = played[-1]["t"] - played[0]["t"]
    p = subprocess.Popen([sys.executable, "-m", "gpucr.service_http.replay", str(rec), "--speed",
                          str(max(1.0, span / 4))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, p.stderr.read() if p.poll() is not None else "")
        browser.get(url)
        for a in last["apps"]:   # the replay's last state: each app's state, and its switches so far
            until_js(browser, f"the page shows {a['name']} {a['state']}", ROW_STATE, a["name"], a["state"])
            until_js(browser, f"the page shows {a['name']}'s switches", SWITCHES, a["name"],
                     f"{a['switches']['park']} / {a['switches']['resume']}")
        shown = browser.execute_script("return [...document.querySelectorAll('#apps tr[data-app]')]"
                                       ".map((r) => r.dataset.app)")
        assert sorted(shown) == sorted(a["name"] for a in last["apps"])
        for name, held in last["gpus"][0]["apps"].items():   # each app's memory bar, where it holds any
            if held > 0:
                width = browser.execute_script(BAR_WIDTH + "return w", name)
                assert width > 0, name
        assert browser.execute_script("return document.querySelectorAll('#timeline rect').length") >= 1
        assert browser.find_element("id", "conn").text == "live"
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors   # the replay serves the page with its own CSP: nothing refused
        browser.save_screenshot(str(tmp_path / "service-page-replay.png"))
        if os.environ.get("GPUCR_SCREENSHOT_DIR") and run == "gpu":
            shutil.copy(tmp_path / "service-page-replay.png", Path(os.environ["GPUCR_SCREENSHOT_DIR"]))
    finally:
        p.kill()
        p.wait()
