"""Checkpoint/restore of a real process on simcuda: memory given back, bytes and addresses kept."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import gpucr
from gpucr import target as targets
from gpucr.driver import ProcessState, gpu_memory, process_gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20
# every test here goes through one gpucr server reused by the module, as a user's requests do
pytestmark = pytest.mark.usefixtures("reused_server")


def used() -> int:
    return gpu_memory(sim_driver()).used


def _sim_read(name: str, pid: int, kind: type = ctypes.c_size_t) -> int:
    """What simcuda's own call `name` reads of process `pid` (what no real driver tells)."""
    n = kind()
    fn = getattr(sim_driver()._cu, name)
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(kind)]
    assert fn(pid, ctypes.byref(n)) == 0, f"simcuda knows no process {pid}"
    return n.value


def host_pinned(pid: int) -> int:
    """Host memory process `pid` pinned through its driver."""
    return _sim_read("simcudaProcessHostPinned", pid)


def test_the_application_pins_nothing_the_server_pins_its_staging(sim_app, reused_server):
    """Through the server (the default): the server copies, so the application pins no host memory at all, at
    checkpoint, while parked or at restore; the server's pinning of the staging shows in its own process."""
    app = sim_app("--sizes", "32M,4M", "--vmm-mib", "8")
    before = app.ask("digest")
    for _ in range(2):
        ck = gpucr.checkpoint(app.pid, timeout=10)
        assert ck.data_plane == "server", ck
        assert host_pinned(app.pid) == 0, "the application pinned host memory"
        assert host_pinned(reused_server.pid) >= 44 * MiB, "the server pins the staging it copies into"
        gpucr.restore(app.pid, timeout=10)
        assert host_pinned(app.pid) == 0
        assert app.ask("digest") == before


def checkpoint_caller(pid: int) -> int:
    """The process that asked for process `pid`'s last checkpoint or restore."""
    return _sim_read("simcudaCheckpointCaller", pid, ctypes.c_int)


@pytest.mark.in_process   # its own server: it kills that server's helper
def test_the_server_asks_the_driver_from_its_helper_and_without_it_itself(sim_app, server):
    """The server copies while the driver checkpoints and restores, and the driver's calls slow beside copies made by
    the process that asks (driver_helper.py): they come from the server's helper, a child that copies nothing. With
    the helper gone, the server asks itself, and the cycle still runs."""
    app = sim_app("--sizes", "8M", "--vmm-mib", "4")
    before = app.ask("digest")
    kids = [int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
    helpers = [k for k in kids if b"gpucr.driver_helper" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(helpers) == 1, kids
    gpucr.checkpoint(app.pid, timeout=10)
    assert checkpoint_caller(app.pid) == helpers[0]
    gpucr.restore(app.pid, timeout=10)
    assert checkpoint_caller(app.pid) == helpers[0]
    os.kill(helpers[0], signal.SIGKILL)
    time.sleep(0.2)
    gpucr.checkpoint(app.pid, timeout=10)
    assert checkpoint_caller(app.pid) == server.pid
    gpucr.restore(app.pid, timeout=10)
    assert app.ask("digest") == before


@pytest.mark.in_process   # the driver's floor is zero: no server context beside it
def test_full_cycle_gives_back_all_memory_and_restores_every_byte(sim_app):
    idle = used()
    app = sim_app("--sizes", "64M,16M,3M,100K,1000", "--pitch", "--vmm-mib", "32")
    running = used()
    assert running - idle >= 115 * MiB
    before = app.ask("digest")

    ck = gpucr.checkpoint(app.pid, level="full", timeout=10)
    assert ck.state == "checkpointed"
    # everything above 2 MiB moved by gpucr: 64M + 16M + 3M(->4M) + pitched 3072*700 (->4M) + 32M of app VMM
    assert ck.bytes_moved >= (64 + 16 + 4 + 2 + 32) * MiB
    assert used() - idle == 0, "the driver's floor on simcuda is zero"
    st = gpucr.status(app.pid)
    assert st.state == "checkpointed" and st.level == "full"

    rs = gpucr.restore(app.pid, timeout=10)
    assert rs.state == "running"
    after = app.ask("digest")
    assert after["digest"] == before["digest"]
    assert after["ptrs"] == before["ptrs"]
    assert used() == running
    # the application carries on: kernels on the restored memory give the right result
    app.ask("work 5")
    app.ask("work -5")
    assert app.ask("digest")["digest"] == before["digest"]


@pytest.mark.in_process   # measures the card, where the server's context appears at its first copy
def test_data_level_keeps_context_and_skips_driver(sim_app):
    app = sim_app("--sizes", "32M,8M")
    before = app.ask("digest")
    running = used()
    ck = gpucr.checkpoint(app.pid, level="data")
    assert ck.level == "data" and "control_out" not in ck.phases_s
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    # the 40 MiB are given back, the context (64 MiB on simcuda) stays
    assert running - used() >= 40 * MiB
    assert gpucr.status(app.pid).level == "data"
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_ten_cycles_with_work_between(sim_app):
    app = sim_app("--sizes", "16M,4M,100K", "--vmm-mib", "8")
    for i in range(10):
        app.ask(f"work {i + 1}")
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, level="full" if i % 2 == 0 else "data")
        gpucr.restore(app.pid)
        assert app.ask("digest") == before, f"cycle {i}"
    assert gpucr.status(app.pid).generation == 10


def test_checkpoint_mid_loop_of_kernel_launches(sim_app):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    app.ask("loop start")
    time.sleep(0.2)
    for _ in range(3):
        gpucr.checkpoint(app.pid, timeout=10)
        time.sleep(0.1)   # the loop thread is parked at the gate meanwhile
        gpucr.restore(app.pid)
        time.sleep(0.1)
    out = app.ask("loop stop")
    assert out["error"] is None and out["iterations"] > 10
    assert app.ask("digest")["digest"] == before["digest"], "a launch was lost or doubled"


def test_calls_in_flight_past_the_deadline_refuse_and_app_runs_on(sim_app):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    app.ask("spin 3000")      # a kernel (a call in flight) that outlasts the deadline
    time.sleep(0.2)
    with pytest.raises(gpucr.GpucrError, match="in flight|did not finish"):
        gpucr.checkpoint(app.pid, timeout=0.5)
    assert gpucr.status(app.pid).state == "running"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    app.ask("work 1")
    app.ask("work -1")
    assert app.ask("digest")["digest"] == before["digest"]


def test_allocations_after_restore_and_frees_are_tracked(sim_app):
    app = sim_app("--sizes", "8M,4M")
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    app.ask("alloc 6291456")
    app.ask("free 0")
    before = app.ask("digest")
    st = gpucr.status(app.pid)
    assert st.allocations.converted == 2
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


@pytest.mark.in_process   # the agent's own restore, refused for room
def test_restore_refused_without_room_then_succeeds(sim_app, monkeypatch):
    app = sim_app("--sizes", "64M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    # another workload takes nearly all of the simulated 4 GiB card meanwhile
    hog = sim_app("--sizes", "4000M")
    with pytest.raises(gpucr.GpucrError, match="not enough free GPU memory"):
        gpucr.restore(app.pid)
    assert gpucr.status(app.pid).state == "checkpointed"
    assert sim_driver().state(app.pid) == ProcessState.CHECKPOINTED
    hog.close()
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def open_files(pid: int) -> list[str]:
    """What the process's fds point at; an fd closed while they are listed (the agent's connection of the
    status just asked) is left out."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return out


def test_staging_file_backend_and_drop_policy(sim_app, tmp_path):
    sdir = tmp_path / "staging"
    sdir.mkdir()
    env = dict(os.environ, GPUCR_STAGING=f"file:{sdir}")
    app = sim_app("--sizes", "16M,4M", env=env)
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert st.staging_kind == "file" and st.staging_bytes >= 20 * MiB and st.staging_segments >= 1
    # the files are unlinked once open (a killed process leaves nothing behind), yet live in DIR's filesystem
    assert list(sdir.iterdir()) == []
    fds = open_files(app.pid)
    assert any(str(sdir) in f and "(deleted)" in f for f in fds)
    gpucr.restore(app.pid, drop_staging=True)
    assert app.ask("digest") == before
    st = gpucr.status(app.pid)
    assert st.staging_bytes == 0
    fds = open_files(app.pid)
    assert not any(str(sdir) in f for f in fds)


def test_each_phase_is_reported_by_the_side_that_times_it(sim_app):
    """The agent's phases in its status; the driver's steps and the data plane's copies, which only the
    controller times, in the controller's results (never pushed into the agent to be read back)."""
    app = sim_app("--sizes", "8M")
    ck = gpucr.checkpoint(app.pid)
    rs = gpucr.restore(app.pid)
    cyc = gpucr.status(app.pid).last_cycle
    for k in ("gate", "sync", "release"):
        assert getattr(cyc, f"{k}_s") >= 0
    assert ck.phases_s["staging"] > 0 and not hasattr(cyc, "staging_s"), "the plane makes staging: the controller times it"
    assert not [f for f in vars(cyc) if f.startswith(("driver_", "control_", "copy", "data_"))], \
        "the agent times only its own phases"
    assert cyc.bytes_out >= 8 * MiB
    assert ck.phases_s["driver_lock"] > 0 and ck.phases_s["control_out"] > 0
    assert rs.phases_s["control_in"] > 0 and rs.phases_s["driver_unlock"] > 0
    with targets.resolve(app.pid).connect() as agent, pytest.raises(gpucr.GpucrError, match="unknown request verb"):
        agent.call("note", driver_lock_us=5)


def test_threads_allocating_and_launching_through_checkpoints(sim_app):
    app = sim_app("--sizes", "8M,16M")
    before = app.ask("digest")
    app.ask("churn start 3")      # three threads allocate, fill, check and free converted memory
    app.ask("loop start")         # and one launches kernels
    time.sleep(0.2)
    for i in range(8):
        gpucr.checkpoint(app.pid, level="full" if i % 2 else "data", timeout=10)
        time.sleep(0.05)
        gpucr.restore(app.pid, timeout=10)
        time.sleep(0.05)
    loop = app.ask("loop stop")
    churn = app.ask("churn stop")
    assert loop["error"] is None and churn["errors"] == [] and churn["cycles"] > 10
    assert app.ask("digest")["digest"] == before["digest"]
    st = gpucr.status(app.pid)
    assert st.allocations.converted == 2, "every churned allocation was freed and forgotten"


# ---- with no server: the same mover as the server's, in the CLI process (issue 25) ----

def _cli_json(*args: str, env: dict[str, str] | None = None) -> dict:
    r = gpucr_cli(*args, "--no-server", "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.in_process   # no server: the CLI's own mover
def test_no_server_cycles_go_through_the_clis_own_mover(sim_app):
    """`gpucr checkpoint/restore --no-server`: the agent hands its memory over and the CLI process copies it,
    through its own pinned ring, into the agent's staging and back; every byte back at the same addresses,
    the memory off the GPU while checkpointed, and nothing pinned in the application, cycle after cycle."""
    app = sim_app("--sizes", "32M,4M,6M", "--vmm-mib", "8")
    before = app.ask("digest")
    for i in range(2):
        ck = _cli_json("checkpoint", str(app.pid))["processes"][0]
        assert ck["data_plane"] == "cli" and ck["bytes_moved"] == 50 * MiB, ck
        assert "handover" in ck["phases_s"] and ck["phases_s"]["data_out"] > 0, ck["phases_s"]
        assert process_gpu_memory(sim_driver(), app.pid, 0) == 0, "its memory left the GPU with the fds"
        assert host_pinned(app.pid) == 0, "the CLI's ring is pinned in the CLI, nothing in the application"
        rs = _cli_json("restore", str(app.pid))["processes"][0]
        assert rs["data_plane"] == "cli" and rs["bytes_moved"] == 50 * MiB and "adopt" in rs["phases_s"], rs
        assert app.ask("digest") == before, f"cycle {i}: bytes or addresses differ"
        app.ask("work 1")   # the next computation runs on the memory the CLI made and filled
        before = app.ask("digest")


@pytest.mark.in_process   # the mover runs in this process, whose pageable copies simcuda counts
def test_the_clis_ring_makes_no_pageable_copy(sim_app, monkeypatch):
    """The API with no server runs the same mover here; its copies go through a ring of pinned 1 MiB slots (ring.SLOTS),
    each reused many times in both directions, with odd sizes: no asynchronous copy is pageable, nothing but
    the ring is pinned (the staging is not), every byte is back, and once done this process holds nothing on
    the GPU and no thread of the ring."""
    from gpucr.dataplane import mover as mv
    from gpucr.driver import sim_pageable_async_copies
    from gpucr.vmm import Vmm
    monkeypatch.setenv("GPUCR_NO_SERVER", "1")
    monkeypatch.setattr(mv, "CHUNK", 1 * MiB)
    pins: list[int] = []
    real_pin = Vmm.pin
    monkeypatch.setattr(Vmm, "pin", lambda self, addr, size: (pins.append(size), real_pin(self, addr, size))[1])
    app = sim_app("--sizes", "9M,3M,5000,7340033", "--vmm-mib", "4")
    before = app.ask("digest")
    drv = sim_driver()
    copies = sim_pageable_async_copies(drv)
    # rings of other tests' movers that ran in this worker before are not this request's
    earlier = {t for t in threading.enumerate() if t.name.startswith("gpucr-ring")}
    ck = gpucr.checkpoint(app.pid)
    rs = gpucr.restore(app.pid)
    assert ck.data_plane == rs.data_plane == "cli" and ck.bytes_moved == rs.bytes_moved > 20 * MiB, (ck, rs)
    assert sim_pageable_async_copies(drv) == copies
    # nothing but the ring's slots, each at most once per request: a slot is pinned at its thread's first piece, and
    # a thread the others left no piece to pins nothing (7 of 8 seen under load)
    from gpucr.dataplane.ring import SLOTS
    assert set(pins) == {1 * MiB} and 2 <= len(pins) <= 2 * SLOTS, pins
    assert app.ask("digest") == before
    assert process_gpu_memory(drv, os.getpid(), 0) == 0, "the CLI's context and memory are given back"
    assert not [t for t in threading.enumerate() if t.name.startswith("gpucr-ring") and t not in earlier]
