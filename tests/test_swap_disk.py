"""The swap service's host budget, then disk, and its apps on several GPUs (issue 27 items 5 and 6), on simcuda: a
real `gpucr serve --host-budget` and apps under `gpucr run --swap`, parked past the budget into images on disk and
brought back on demand with their data byte-exact; an app of `--any-gpu` brought back on another GPU with room."""
from __future__ import annotations

import json
import os
import re
import resource
import time
from pathlib import Path

import pytest

from conftest import RunningServer, gpucr_cli
import test_swap
from test_swap import _apps, _state, _until

# test_swap.py's fixtures, with this module's server_args (and server_preexec, where a test gives it)
swap_server, swap_app = test_swap.swap_server, test_swap.swap_app

MiB = 1 << 20
APP_BYTES = 12 * MiB   # what a driver_app of --sizes 8M,3M parks: 8 MiB and 3 MiB in a 2 MiB granule
BUDGET_FOR_ONE = "20M"   # one parked app fits, two do not


@pytest.fixture
def park_dir(tmp_path) -> Path:
    d = tmp_path / "park"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def server_args(park_dir) -> list[str]:
    return ["--host-budget", BUDGET_FOR_ONE, "--park-dir", str(park_dir)]


def _status(pid: int) -> dict:
    r = gpucr_cli("status", "--no-server", "--json", str(pid))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["processes"][0]


def _row(srv: RunningServer, name: str) -> dict:
    return _apps(srv)[name]


def _parked_in_order(srv: RunningServer, swap_app, *names: str) -> dict:
    """Each app started, its digest taken, and parked (idle) before the next starts: the first is the least recently
    used. Returns {name: (workload, digest)}."""
    out = {}
    for name in names:
        w = swap_app(name, "--idle-park", "1")
        out[name] = (w, w.ask("digest")["digest"])
        _until(f"{name} parked", lambda: _state(srv, name) in ("parked", "on disk") and _row(srv, name)["parks"] >= 1)
    return out


def test_past_the_host_budget_the_least_recently_used_goes_to_disk_and_each_comes_back_intact(swap_server, swap_app,
                                                                                               park_dir):
    apps = _parked_in_order(swap_server, swap_app, "a", "b")
    # parking b would pass the budget: a, parked longest ago, went to disk first, and its staging was freed
    assert _state(swap_server, "a") == "on disk" and _state(swap_server, "b") == "parked"
    a, b = _row(swap_server, "a"), _row(swap_server, "b")
    assert a["host_bytes"] == 0 and b["host_bytes"] == APP_BYTES, (a, b)
    image = Path(a["image"])
    assert image.parent == park_dir and sorted(os.listdir(image)) == ["data.bin", "manifest.json"]
    assert os.stat(image).st_mode & 0o777 == 0o700
    st = _status(apps["a"][0].pid)
    assert st["state"] == "checkpointed" and st["staging_bytes"] == 0, st
    assert _status(apps["b"][0].pid)["staging_bytes"] == APP_BYTES
    assert swap_server.info()["swap_host"]["host_bytes"] == APP_BYTES
    out = gpucr_cli("ps").stdout
    assert re.search(rf"a\s+{apps['a'][0].pid}\s+0\s+on disk .*\[{re.escape(str(image))}\]", out), out
    assert "swap host memory: 12 MiB of --host-budget 20 MiB held by parked apps; 1 on disk" in out, out

    apps.update(_parked_in_order(swap_server, swap_app, "c"))
    assert _state(swap_server, "b") == "on disk" and _state(swap_server, "c") == "parked"
    for name in ("a", "b", "c", "a"):   # on demand: from disk (a, b), from host memory (c); each byte-exact
        w, before = apps[name]
        assert w.ask("digest", timeout=60)["digest"] == before, name
    log = swap_server.log.read_text()
    assert re.search(r"moved parked swap app a \(pid \d+\) to disk: \S+ \(12582912 bytes of host memory freed\)", log), log
    assert re.search(r"resuming swap app a \(pid \d+\) on demand: .*, from its image ", log), log
    assert not image.exists(), "the image is removed once its app is back"


def test_a_resumed_app_gives_its_staging_back_under_a_budget(swap_server, swap_app):
    apps = _parked_in_order(swap_server, swap_app, "solo")
    w, before = apps["solo"]
    assert w.ask("digest", timeout=60)["digest"] == before
    _until("resident", lambda: _state(swap_server, "solo") == "resident")
    assert _status(w.pid)["staging_bytes"] == 0 and _row(swap_server, "solo")["host_bytes"] == 0


def test_an_app_killed_on_disk_is_dropped_and_its_image_removed(swap_server, swap_app, park_dir):
    apps = _parked_in_order(swap_server, swap_app, "gone", "kept")
    image = Path(_row(swap_server, "gone")["image"])
    assert image.is_dir()
    w = apps["gone"][0]
    w.proc.kill()
    w.proc.wait()
    _until("dropped, its image removed", lambda: "gone" not in _apps(swap_server) and not image.exists())
    assert os.listdir(park_dir) == [], swap_server.log.read_text()


def _refused_to_disk(srv: RunningServer, swap_app, why: str) -> None:
    """a is parked in host memory; b's park would pass the budget and a cannot go to disk: said in one log line, a stays
    parked in host memory, b stays resident, and a comes back intact."""
    apps = _parked_in_order(srv, swap_app, "a")
    b = swap_app("b", "--idle-park", "1")
    _until("b's park refused", lambda: "not parked: host budget" in _row(srv, "b")["why"])
    time.sleep(1.5)   # b is tried again after another idle period
    assert _state(srv, "a") == "parked" and _state(srv, "b") == "resident"
    st = _status(apps["a"][0].pid)
    assert st["staged"] and st["staging_bytes"] >= APP_BYTES, "a's data is still in host memory"
    lines = [line for line in srv.log.read_text().splitlines() if why in line and " swap app " in line]
    assert len(lines) == 1, srv.log.read_text()   # said once, though b is tried again each idle period
    assert re.search(r"parking swap app b \(pid \d+\) would pass --host-budget 20971520: .*; it stays resident",
                     srv.log.read_text())
    w, before = apps["a"]
    assert w.ask("digest", timeout=60)["digest"] == before
    assert b.ask("digest", timeout=60)["digest"]


@pytest.mark.parametrize("server_args", [["--host-budget", BUDGET_FOR_ONE, "--park-dir", "/nonexistent/gpucr-park"]])
def test_an_absent_park_dir_is_said_and_the_app_stays_parked_in_host_memory(swap_server, swap_app):
    _refused_to_disk(swap_server, swap_app, "the park dir is not usable: /nonexistent/gpucr-park: No such file or "
                                            "directory; make it (mkdir -m 700)")


def test_a_park_dir_others_may_read_is_refused(swap_server, swap_app, park_dir):
    park_dir.chmod(0o755)
    _refused_to_disk(swap_server, swap_app, f"the park dir is not usable: {park_dir} has mode 0755, not 0700")


def _small_files() -> None:
    """The server may write no file past 10 MiB: the image's data (12 MiB) fails as on a full disk (EFBIG, not ENOSPC:
    the same path), while simcuda's memory, which files back, fits (the app's largest allocation is 8 MiB), and the
    server's log stays below that."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (10 * MiB, 10 * MiB))


@pytest.mark.parametrize("server_preexec", [_small_files])
def test_a_disk_that_refuses_the_image_leaves_the_app_parked_in_host_memory(swap_server, swap_app, park_dir,
                                                                           monkeypatch):
    # the server makes the apps' staging, and RLIMIT_FSIZE holds its memfds too: segments of 4 MiB asked for, so the
    # app's 4 + 8 MiB stage in two memfds of 8 MiB (a segment holds at least its largest allocation) while the
    # image's one data file of 12 MiB passes the limit
    monkeypatch.setenv("GPUCR_STAGING_SEGMENT_MIB", "4")
    _refused_to_disk(swap_server, swap_app, "to disk failed, it stays parked in host memory: writing the image to")
    assert os.listdir(park_dir) == [], "a failed write leaves nothing in the park dir"


@pytest.fixture
def two_small_gpus(monkeypatch):
    """Two simulated GPUs of 320 MiB each (simcuda counts 64 MiB for each context: each app's and the server's)."""
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(320 * MiB))


@pytest.mark.parametrize("server_args", [[]])
def test_an_app_of_any_gpu_whose_gpu_is_full_comes_back_on_the_other_one_intact(two_small_gpus, swap_server, swap_app):
    """An app parked on GPU 0, whose GPU 0 a higher-priority app then fills, comes back on GPU 1 (the --map restore):
    same data, same device pointers, its device 0 now the other card."""
    mover = swap_app("mover", "--any-gpu", "--idle-park", "1", sizes="64M")
    u0, u1 = mover.ask("uuids")["uuids"]
    before = mover.ask("buffers")
    digest = mover.ask("digest")["digest"]
    _until("parked", lambda: _state(swap_server, "mover") == "parked")
    boss = swap_app("boss", "--priority", "5", sizes="160M")   # GPU 0: the server's 64 + its 64 + 160 of 320 MiB
    boss.ask("work 1")
    assert mover.ask("digest", timeout=60)["digest"] == digest   # a copy: demand; no room on GPU 0, so on GPU 1
    assert mover.ask("uuids")["uuids"] == [u1, u0], "its device 0 is now GPU 1 (and its device 1 GPU 0)"
    assert mover.ask("buffers") == before, "every buffer at the same address with the same bytes"
    mover.ask("work 3")   # kernels on its buffers, through the same pointers, on the other card
    mover.ask("work -3")
    assert mover.ask("digest")["digest"] == digest
    row = _until("resident on GPU 1", lambda: (r := _row(swap_server, "mover"))["state"] == "resident"
                 and r["held_bytes"].get(u1) and r)
    assert not row["held_bytes"].get(u0), row
    assert {g["uuid"] for g in _status(mover.pid)["gpus"]} == {u1}
    assert _state(swap_server, "boss") == "resident"
    log = swap_server.log.read_text()
    assert f"swap app mover (pid {mover.pid}) comes back on another GPU with room: {u0} -> {u1}" in log, log
