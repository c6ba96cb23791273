"""On the H200 (issue 24, item 0): a torch application whose threads watch the GPU every 5 ms
(Event.query, Stream.query, torch.cuda.synchronize, the driver's cuCtxSynchronize, Event.record), while
another thread computes on a tensor of known content, goes through 10 checkpoint/restore cycles through a
gpucr server at each level, alive and byte-identical after each restore. Before the gate held these calls,
the driver's checkpoint failed with CUDA error 304 and the application died (SIGSEGV), 3 of 3. Written in
a session without a GPU (the CPU suite covers the same on simcuda: tests/test_polling.py)."""
from __future__ import annotations

import time

import pytest

from gpucr.workloads.runner import Workload

from conftest import gpu, gpucr_cli

pytestmark = [gpu, pytest.mark.gpu]
CYCLES = 10


def _pollers_moved(app: Workload, since: dict) -> None:
    """Every poller calls again after the restore."""
    deadline = time.time() + 30
    while time.time() < deadline:
        now = app.ask("poll counts")
        assert now["errors"] == [], now
        if all(now["counts"][f] > since[f] for f in since):
            return
        time.sleep(0.05)
    raise AssertionError(f"pollers stalled after the restore: {since} -> {now['counts']}")


@pytest.mark.parametrize("level", ["full", "data"])
def test_threads_polling_the_gpu_live_through_ten_cycles(gpu_server, level):
    with Workload("torch_app", "--gib", "1") as app:
        before = app.ask("digest")
        app.ask("poll start 5")
        for i in range(CYCLES):
            app.ask("loop start")   # adds 1 and takes it away again on data[0]: net zero once stopped
            time.sleep(0.2)
            counts = app.ask("poll counts")["counts"]
            r = gpucr_cli("checkpoint", "--level", level, str(app.pid), timeout=300)
            assert r.returncode == 0, f"cycle {i}: {r.stderr}"
            assert app.proc.poll() is None, f"cycle {i}: the application died ({app.proc.returncode})"
            r = gpucr_cli("restore", str(app.pid), timeout=300)
            assert r.returncode == 0, f"cycle {i}: {r.stderr}"
            _pollers_moved(app, counts)
            loop = app.ask("loop stop")
            assert loop["error"] is None and loop["iterations"] > 0, f"cycle {i}: {loop}"
            after = app.ask("digest")
            assert after["digest"] == before["digest"], f"cycle {i}: bytes differ"
            assert after["ptrs"] == before["ptrs"], f"cycle {i}: addresses moved"
        out = app.ask("poll stop")
        assert out["errors"] == [] and min(out["counts"].values()) > 0, out
    assert gpu_server.requests() >= 2 * CYCLES, "the cycles went through the server"


# their calls drop Python's GIL while they wait (torch.cuda.synchronize, ctypes), or are answered by the agent
# once the checkpoint settled (Event.query and Stream.query, which keep the GIL); an Event.record, which keeps
# the GIL too and must wait for the gate, would hold every Python thread of the process until the restore
NOT_HOLDING_THE_GIL = "event-query,stream-query,synchronize,ctx-synchronize"


def test_a_parked_app_whose_threads_poll_keeps_answering(gpu_server):
    """While parked, an app whose threads poll the GPU still runs its other Python threads (here the one
    answering commands), and its queries are answered; after the restore its data is intact."""
    with Workload("torch_app", "--gib", "1") as app:
        before = app.ask("digest")
        app.ask(f"poll start 5 {NOT_HOLDING_THE_GIL}")
        for i in range(3):
            r = gpucr_cli("checkpoint", str(app.pid), timeout=300)
            assert r.returncode == 0, f"cycle {i}: {r.stderr}"
            first = app.ask("poll counts", timeout=15)   # the main thread gets the GIL while parked
            time.sleep(0.5)
            second = app.ask("poll counts", timeout=15)
            assert second["errors"] == [], second
            for f in ("event-query", "stream-query"):
                assert second["counts"][f] > first["counts"][f], f"cycle {i}: {f} not answered while parked: {second}"
            r = gpucr_cli("restore", str(app.pid), timeout=300)
            assert r.returncode == 0, f"cycle {i}: {r.stderr}"
            assert app.ask("digest") == before, f"cycle {i}: bytes differ"
        out = app.ask("poll stop")
        assert out["errors"] == [], out
