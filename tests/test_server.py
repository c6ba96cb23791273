"""`gpucr serve` (issue 13, step 1): a per-user server that acts as the controller. Real servers, real
sockets, real processes under LD_PRELOAD on simcuda. What each test proves is in its name and docstring."""
from __future__ import annotations

import dataclasses

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

import gpucr
from gpucr import paths
from gpucr import target as targets
from gpucr.driver import ProcessState, gpu_memory, gpu_processes, process_gpu_memory
from gpucr.server import client, daemon, wire
from gpucr.workloads.runner import Workload

from conftest import RunningServer, cycle_concurrently, gpucr_cli, sim_driver
from test_security import users  # noqa: F401 (a second local user, for attacks across users)


SIM_CONTEXT_BYTES = 64 << 20   # what simcuda charges for a context (SIMCUDA_CTX_BYTES' default)


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    errors = [l for l in lines if l.startswith("gpucr: error:")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- requests go through the server ----

def test_cli_and_api_requests_go_through_the_server(server, sim_app):
    """checkpoint, restore, status and ps from the CLI and from `import gpucr` are served by the server
    (its count of requests moves by one each), and the bytes come back at the same addresses."""
    app = sim_app("--sizes", "32M,4M", "--vmm-mib", "8")
    before = app.ask("digest")
    n = server.requests()
    r = gpucr_cli("checkpoint", str(app.pid))
    assert r.returncode == 0, r.stderr
    assert server.requests() == n + 1
    assert gpucr.status(app.pid).state == "checkpointed"
    assert server.requests() == n + 2
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert server.requests() == n + 3
    ck, rs = gpucr.checkpoint(app.pid), gpucr.restore(app.pid)
    assert server.requests() == n + 5
    # the same typed results as in-process (issue 14's schema), read back strictly from the server's JSON
    assert isinstance(ck, gpucr.ProcessCheckpoint) and ck.bytes_moved == rs.bytes_moved >= 44 << 20
    assert isinstance(rs, gpucr.ProcessRestore) and rs.state == "running"
    assert isinstance(gpucr.status(app.pid), gpucr.ProcessStatus)
    out = json.loads(gpucr_cli("status", "--json", str(app.pid)).stdout)
    assert gpucr.from_json(gpucr.StatusResult, out).processes[0].pid == app.pid
    assert app.ask("digest") == before
    ps = gpucr_cli("ps")
    assert ps.returncode == 0 and server.requests() == n + 8
    assert f"server: pid {server.pid} [simcuda]" in ps.stdout
    # the server's own: the context its data plane copied in, shown apart from the processes
    info = server.info()
    assert len(info["contexts"]) == 1 and info["pinned_staging_bytes"] >= 44 << 20, info
    assert (f"GPU memory it holds (apart from the processes): {info['gpu_bytes'] >> 20} MiB on 1 GPU "
            "(its data-plane context on 1;") in ps.stdout, ps.stdout
    assert str(app.pid) in ps.stdout
    # measured per process: the app holds its memory, the server its context (simcuda's: 64 MiB) and
    # nothing of the app's
    assert process_gpu_memory(sim_driver(), app.pid, 0) >= 44 << 20
    assert info["gpu_bytes"] == SIM_CONTEXT_BYTES


def test_no_server_flag_and_setting_act_in_process(server, sim_app):
    """--no-server and GPUCR_NO_SERVER=1 (a checked controller setting) leave the server out."""
    app = sim_app("--sizes", "8M")
    n = server.requests()
    assert gpucr_cli("checkpoint", "--no-server", str(app.pid)).returncode == 0
    assert gpucr_cli("restore", str(app.pid), env={**os.environ, "GPUCR_NO_SERVER": "1"}).returncode == 0
    assert gpucr_cli("status", "--no-server", str(app.pid)).returncode == 0
    assert server.requests() == n
    assert "server: not used (--no-server)" in gpucr_cli("ps", "--no-server").stdout
    one_line_error(gpucr_cli("ps", env={**os.environ, "GPUCR_NO_SERVER": "yes"}), "GPUCR_NO_SERVER=yes is not valid")


def test_processes_cycled_concurrently_through_the_server(server, sim_app):
    """The server serves several controllers at once: six processes, each cycled in its own thread."""
    apps = [sim_app("--sizes", "16M,2M", "--seed", str(i)) for i in range(6)]
    befores = [a.ask("digest") for a in apps]
    n = server.requests()
    assert cycle_concurrently([a.pid for a in apps], 3) == []
    assert server.requests() == n + 6 * 3 * 2
    assert [a.ask("digest") for a in apps] == befores


def test_refusals_come_back_as_the_same_one_line(server, sim_app):
    """What the coordinator refuses in-process is refused in the same words through the server."""
    app = sim_app("--sizes", "8M")
    via = one_line_error(gpucr_cli("restore", str(app.pid)), "is not checkpointed")
    alone = one_line_error(gpucr_cli("restore", "--no-server", str(app.pid)), "is not checkpointed")
    assert via == alone
    assert gpucr_cli("checkpoint", "--level", "data", str(app.pid)).returncode == 0
    one_line_error(gpucr_cli("checkpoint", str(app.pid)), "is already checkpointed")
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    log = server.log.read_text()   # and in the server's log, a line per request with its outcome
    assert re.search(rf"restore of process {app.pid}: refused: .*is not checkpointed.* in \d+\.\d{{3}} s", log), log
    assert re.search(rf"checkpoint of process {app.pid}: refused: .*is already checkpointed", log), log


def test_image_dirs_travel_as_absolute_paths(server, sim_app, tmp_path):
    """An image dir given relative to the client's cwd is written there, not in the server's cwd."""
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "gpucr.cli", "checkpoint", "--image", "img", str(app.pid)], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "img" / "manifest.json").exists()
    assert gpucr_cli("restore", "--image", str(tmp_path / "img"), str(app.pid)).returncode == 0
    assert app.ask("digest") == before


# ---- the server's data plane: it copies the data while the driver takes the control state ----

def test_the_server_copies_the_data_while_the_driver_checkpoints(server, sim_app):
    """Through the server, the agent hands its memory over (released, its fds kept) and the server copies
    it into the process's staging side by side with the driver's checkpoint; at restore the server makes
    and fills new memory while the driver restores, and the agent maps it at the old addresses. Every byte
    back, same addresses, the process holds nothing while checkpointed, and the cycle repeats."""
    app = sim_app("--sizes", "32M,4M,6M", "--vmm-mib", "8")
    before = app.ask("digest")
    for i in range(3):
        ck = gpucr.checkpoint(app.pid)
        assert {"vet", "prepare", "handover", "data_out", "driver_lock", "control_out", "commit", "settle"} <= set(ck.phases_s), ck.phases_s
        assert ck.bytes_moved == 50 << 20, ck
        st = gpucr.status(app.pid)
        assert st.state == "checkpointed" and st.staged and st.checkpoint_phase == "", st
        assert process_gpu_memory(sim_driver(), app.pid, 0) == 0   # its memory left the GPU with the fds
        assert ck.data_plane == "server"
        rs = gpucr.restore(app.pid)
        assert rs.data_plane == "server"
        assert {"vet", "control_in", "data_in", "adopt", "finish", "settle"} <= set(rs.phases_s), rs.phases_s
        for r, key in ((ck, "data_out"), (rs, "data_in")):
            # the server's own thread: staging, making (importing), queueing, draining, exporting; within its copy
            parts = [r.phases_s[f"server_{k}"] for k in ("stage", "make", "queue", "drain", "export")]
            assert all(v >= 0 for v in parts) and sum(parts) <= r.phases_s[key], r.phases_s
        assert ck.phases_s["server_export"] == 0 and rs.phases_s["server_make"] > 0, "out imports, in makes and exports"
        assert rs.bytes_moved == 50 << 20, rs
        assert ck.data_plane == rs.data_plane == "server"
        after = app.ask("digest")
        assert after == before, f"cycle {i}: bytes or addresses differ"
        app.ask("work 1")   # the next computation runs on the adopted memory
        before = app.ask("digest")
    # the adopted memory is the agent's again: exported to a controller, released at the next checkpoint
    st = gpucr.status(app.pid)
    assert st.allocations.not_exportable == 0 and st.coverage.bytes_moved_by_gpucr == 50 << 20


def test_memory_made_with_allocation_flags_goes_through_the_server(server, sim_app):
    """VMM chunks asking for GPUDirect RDMA, as PyTorch's expandable segments do on a GPU that has it (the H200):
    the server takes them too (it makes the new memory with the same flags), instead of leaving the process to
    the agent's slower copy (2x off its bound on the H200, 2026-12-03)."""
    app = sim_app("--sizes", "4M", "--vmm-mib", "16", "--vmm-rdma")
    before = app.ask("digest")
    for _ in range(2):
        ck = gpucr.checkpoint(app.pid)
        assert ck.data_plane == "server" and ck.bytes_moved == 20 << 20, ck
        rs = gpucr.restore(app.pid)
        assert rs.data_plane == "server" and rs.bytes_moved == 20 << 20, rs
        assert app.ask("digest") == before


def test_a_checkpoint_by_either_plane_is_restored_by_the_other(server, sim_app):
    """A `--no-server` checkpoint (the CLI's own mover) is restored through the server, and a checkpoint through
    the server by a `--no-server` restore: every byte back at the same addresses. The server pins no staging it
    did not take itself (docs/security.md): it fills such a process through a ring, as the CLI's mover does."""
    app = sim_app("--sizes", "16M,6M")
    before = app.ask("digest")
    ck = json.loads(gpucr_cli("checkpoint", "--no-server", "--json", str(app.pid)).stdout)["processes"][0]
    assert ck["data_plane"] == "cli", ck
    rs = gpucr.restore(app.pid)
    assert rs.data_plane == "server" and rs.bytes_moved == 22 << 20, rs
    assert app.ask("digest") == before
    assert gpucr.checkpoint(app.pid).data_plane == "server"
    rs = json.loads(gpucr_cli("restore", "--no-server", "--json", str(app.pid)).stdout)["processes"][0]
    assert rs["data_plane"] == "cli" and rs["bytes_moved"] == 22 << 20, rs
    assert app.ask("digest") == before


def test_level_data_goes_through_the_server(server, sim_app):
    """--level data: the same hand-over and adoption, with no driver step; the context stays."""
    app = sim_app("--sizes", "16M,16M")
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid, level="data")
    assert "handover" in ck.phases_s and "control_out" not in ck.phases_s, ck.phases_s
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    rs = gpucr.restore(app.pid)
    assert "adopt" in rs.phases_s and rs.bytes_moved == 32 << 20
    assert app.ask("digest") == before


def test_what_the_server_took_is_kept_past_its_context_and_forgotten_with_its_process(sim_app):
    """A server that gives its context back after each request keeps its record of what it took from each process
    (its next restore fills from it), and lets the record go once that process has ended, as it lets go of staging:
    a long-lived server keeps nothing of the processes it served."""
    from gpucr.dataplane.checked import Taken
    from gpucr.dataplane.mover import Mover, owner
    mover = Mover(sim_driver(), keep_context=False)
    app = sim_app("--sizes", "4M")
    who = owner(app.pid)
    mover._taken[who] = Taken([(0, 4 << 20, 0, 0)])   # as its copy out records it
    mover.settle()   # the context given back, as after each request
    assert who in mover._taken
    mover.forget_ended()
    assert who in mover._taken, "the process runs on: its record stays"
    app.proc.kill()
    app.proc.wait(timeout=30)
    mover.forget_ended()
    assert who not in mover._taken


def test_a_mover_giving_back_its_context_leaves_no_stream_in_it():
    """The CLI's mover may run in a process that holds the context too (an app calling gpucr.checkpoint on another):
    its release does not end that context, so each request's streams were left in it, hundreds over a day (on
    simcuda, past 256 they shared one order and its check refusal stopped)."""
    from gpucr.dataplane.mover import Mover
    from gpucr.driver import DriverError
    from gpucr.vmm import Vmm
    vmm = Vmm(sim_driver())
    held = vmm.retain_context(0)   # the calling app's own hold
    try:
        mover = Mover(sim_driver(), keep_context=False)
        ctx, streams = mover.context(0)
        streams = [*streams, *mover._side[ctx]]
        mover.settle()
        vmm.use(held)
        for s in streams:
            with pytest.raises(DriverError):
                vmm.sync(s)
    finally:
        vmm.release_context(0)


def test_memory_exported_for_other_processes_goes_through_the_server_too(server, sim_app):
    """Memory exported for other processes (the agents relink it) is copied by the server, once, from its
    exporter, and put back by it; the result says which plane moved the data."""
    app = sim_app("--sizes", "16M")
    app.ask("share 8")
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid)
    assert "handover" in ck.phases_s and ck.data_plane == "server", ck
    rs = gpucr.restore(app.pid)
    assert rs.data_plane == "server" and app.ask("digest") == before


def test_server_that_gives_back_its_context_holds_nothing_between_cycles(sim_app):
    """`gpucr serve --give-back-context`: after each checkpoint and restore the server's context is gone
    (nothing of it on the GPU, no staging pinned), and the cycles are still right. The results measure the
    card once it is gone: the checkpoint's GPU use after is the card's idle (it showed the server's context,
    which the H200's GPU tests through a server caught as 530 MiB too little freed)."""
    s = RunningServer(True, "--give-back-context")
    try:
        app = sim_app("--sizes", "16M,4M")
        before = app.ask("digest")
        for _ in range(2):
            ck = gpucr.checkpoint(app.pid)
            assert "handover" in ck.phases_s
            [g] = ck.gpus
            assert g.gpu_used_after_bytes == 0 and g.gpu_used_before_bytes == g.process_before_bytes > 0, g
            info = s.info()
            assert info["contexts"] == [] and info["pinned_staging_bytes"] == 0 and info["gpu_bytes"] == 0, info
            # and the restore is still the server's: it gave its context back, not its record of what it took (the
            # H200's torch and JAX restores went the agent's way, 2.8-3.5 s against 0.3-0.4 s)
            assert gpucr.restore(app.pid).data_plane == "server"
            assert s.info()["gpu_bytes"] == 0
            assert app.ask("digest") == before
    finally:
        s.stop()


def _others_bytes(*pids: int) -> int:
    """GPU 0's memory held by processes other than these, as simcuda counts it per process."""
    drv = sim_driver()
    return sum(process_gpu_memory(drv, p, 0) for p in gpu_processes(drv, 0) if p not in pids)


def test_memory_figures_add_up_through_the_server(server, sim_app):
    """Issue 24, 3.6: the memory the server makes at a restore is the process's once it maps it, though per-process
    counts (simcuda's, NVML's) list it under the server while it holds it and then under nobody. So the figures
    a user reads must add up: before and after a checkpoint and a restore, what the process holds, what the server
    holds itself and what every other process holds make the GPU's used memory, cycle after cycle; the server's
    own memory is named apart, on the CLI's line too."""
    app = sim_app("--sizes", "32M,4M")
    before = app.ask("digest")
    made = 0   # what the server made that the process holds: none before its first restore through it
    for _ in range(2):
        for verb in ("checkpoint", "restore"):
            [g] = getattr(gpucr, verb)(app.pid).gpus
            others = _others_bytes(app.pid, server.pid)
            assert g.process_after_bytes + process_gpu_memory(sim_driver(), server.pid, 0) + others == \
                g.gpu_used_after_bytes, g
            assert g.process_before_bytes + g.server_before_bytes + others == g.gpu_used_before_bytes, g
            assert g.server_after_bytes == server.info()["gpu_bytes"] == SIM_CONTEXT_BYTES, g
            assert g.server_made_before_bytes == made, g
            made = 36 << 20 if verb == "restore" else 0
            assert g.server_made_after_bytes == made, g
    assert gpucr.status(app.pid).gpus[0].process_bytes == g.process_after_bytes   # gpucr status counts it too
    assert app.ask("digest") == before
    gpucr.checkpoint(app.pid)
    r = gpucr_cli("restore", str(app.pid))
    assert r.returncode == 0, r.stderr
    assert re.search(r"this process 0 MiB -> 100 MiB \(36 MiB of it re-made by gpucr\), "
                     r"GPU used 64 MiB -> 164 MiB; gpucr server 64 MiB \(its context\)", r.stdout), r.stdout
    out = json.loads(gpucr_cli("checkpoint", "--json", str(app.pid)).stdout)["processes"][0]["gpus"][0]
    assert (out["process_before_bytes"], out["server_made_before_bytes"], out["server_after_bytes"]) == \
        (100 << 20, 36 << 20, 64 << 20), out


def test_a_context_given_back_is_waited_for_until_nvml_stops_counting_it(monkeypatch):
    """On the H200 NVML still counted the server's context for a moment after cuDevicePrimaryCtxRelease (a
    result measured then reported 0.60 GiB of it): settle waits until the count of the server's own pid drops,
    at most its limit, and not at all where nothing is counted."""
    from types import SimpleNamespace
    from gpucr.dataplane import mover as mv
    counts = iter([648 << 20, 648 << 20, 0])
    asked: list[tuple[int, int, str]] = []

    def counted(drv, pid, dev, uuid):
        asked.append((pid, dev, uuid))
        return next(counts)
    monkeypatch.setattr(mv, "process_gpu_memory", counted)
    real = SimpleNamespace(vmm=SimpleNamespace(drv=SimpleNamespace(simulated=False)))
    mv.Mover._wait_until_released(real, {0: "GPU-a"})
    assert asked == [(os.getpid(), 0, "GPU-a")] * 3
    monkeypatch.setattr(mv, "process_gpu_memory", lambda *a: 1 << 20)
    t0 = time.monotonic()
    mv.Mover._wait_until_released(real, {0: "GPU-a"}, limit_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.0   # bounded: a count that never drops costs the limit, no more
    asked.clear()
    monkeypatch.setattr(mv, "process_gpu_memory", counted)
    mv.Mover._wait_until_released(SimpleNamespace(vmm=SimpleNamespace(drv=SimpleNamespace(simulated=True))), {0: "GPU-a"})
    assert asked == []   # simcuda's count drops with the release


def test_the_data_plane_refuses_a_layout_outside_the_staging(tmp_path):
    """The process is not trusted: a layout that would have the server copy past its staging file, a restore
    of anything but what the server took from it, or a staging fd that is not a plain file of the size said,
    is refused before any copy (and the staging pinned is no more than the GPU memory really imported)."""
    from gpucr.memory import Managed
    from gpucr.dataplane.mover import Mover
    mover = Mover(sim_driver())
    sim_uuid = next(iter(mover.vmm.device_by_uuid()))
    seg = tmp_path / "seg"
    seg.write_bytes(b"\0" * (4 << 20))
    fd = os.open(seg, os.O_RDWR)
    mem = [Managed(0, "converted", 2 << 20, 0, True, False, [], None, "GPU-x", True, True)]
    try:
        for bad in ({"index": 0, "bytes": 2 << 20, "segment": 0, "offset": 3 << 20},
                    {"index": 0, "bytes": 2 << 20, "segment": 1, "offset": 0},
                    {"index": 0, "bytes": -1, "segment": 0, "offset": 0}):
            layout = {"segments": [{"index": 0, "bytes": 4 << 20}], "allocations": [bad]}
            with pytest.raises(gpucr.GpucrError, match="outside its staging"):
                mover.copy_out(1, layout, [fd], mem)
        # at a restore of what the server did not take itself, only what the agent lists as released, of that size
        ok = {"segments": [{"index": 0, "bytes": 4 << 20}],
              "allocations": [{"index": 0, "bytes": 2 << 20, "segment": 0, "offset": 0}]}
        with pytest.raises(gpucr.GpucrError, match="does not list as released memory of that size"):
            mover.fill(4, ok, [fd], [dataclasses.replace(mem[0], released=False)])
        with pytest.raises(gpucr.GpucrError, match="not a file of"):
            mover.pin_ahead(2, {"segments": [{"index": 0, "bytes": 8 << 20}], "allocations": []}, [fd], sim_uuid)
        r, w = os.pipe()
        with pytest.raises(gpucr.GpucrError, match="not a file of"):
            mover.pin_ahead(3, {"segments": [{"index": 0, "bytes": 4096}], "allocations": []}, [r], sim_uuid)
        os.close(r)
        os.close(w)
    finally:
        os.close(fd)
        mover.close()


def test_pinning_ahead_pins_outside_the_data_plane_and_only_what_is_missing(tmp_path, monkeypatch):
    """Pinning ahead never holds the data plane while it pins (under it, pinning 69 GiB again held a process,
    handed over, 10.6 s from its checkpoint on the H200); it pins only what is not pinned yet as far as the
    allocations reach, as a copy would (pinning whole segments again beside the next checkpoints slowed
    their copies 5-8x on the two-H200 host): nothing twice, a segment grown or a new file behind a segment
    anew, a segment gone let go; and it stops while a copy wants the data plane."""
    from gpucr.dataplane.mover import Mover, Stats, owner
    mover = Mover(sim_driver())
    sim_uuid = next(iter(mover.vmm.device_by_uuid()))
    pin = mover.vmm.pin
    held_while_pinning = []
    monkeypatch.setattr(mover.vmm, "pin", lambda addr, size: (held_while_pinning.append(mover._lock.locked()),
                                                              pin(addr, size))[1])
    files = []
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"\0" * (4 << 20))
        files.append(os.open(tmp_path / name, os.O_RDWR))
    # a running process's layout: its segments, sized to its data; no allocations placed yet
    seg = lambda n: {"segments": [{"index": 0, "bytes": n}], "allocations": []}
    try:
        mover._wanted = 1   # a copy waits for the data plane: nothing pinned now
        assert mover.pin_ahead(1, seg(2 << 20), [files[0]], sim_uuid) == 0 and mover.pinned_bytes() == 0
        mover._wanted = 0
        assert mover.pin_ahead(1, seg(2 << 20), [files[0]], sim_uuid) == 2 << 20
        assert mover.pin_ahead(1, seg(2 << 20), [files[0]], sim_uuid) == 0, "pinned already: nothing again"
        assert mover.pin_ahead(1, seg(4 << 20), [files[0]], sim_uuid) == 4 << 20, "grown: pinned as far as it says"
        assert mover.pinned_bytes() == 4 << 20
        assert mover.pin_ahead(1, seg(4 << 20), [files[1]], sim_uuid) == 4 << 20, "another file: pinned"
        assert mover.pinned_bytes() == 4 << 20
        # a copy pinned the segment only as far as its allocations reached, the process stating 4 MiB then
        mover.forget(1)
        mover.held.map(owner(1), {0: 1 << 20}, [files[0]], Stats(), {0: 4 << 20})
        assert mover.pin_ahead(1, seg(4 << 20), [files[0]], sim_uuid) == 0, "what a copy pinned is not pinned again"
        assert mover.pinned_bytes() == 1 << 20
        assert mover.pin_ahead(1, {"segments": [], "allocations": []}, [], sim_uuid) == 0
        assert mover.pinned_bytes() == 0, "a segment the process no longer has is let go"
        assert held_while_pinning == [False, False, False, False], held_while_pinning
    finally:
        for fd in files:
            os.close(fd)
        mover.close()


def test_a_reused_pid_never_meets_the_dead_process_staging(tmp_path):
    """Pid reuse (issue 24): staging the server holds for a process that has ended, whose pid a new process now
    has, is never taken for the new one's (the same file behind it, even): the new one's is mapped and pinned
    anew, and the dead one's is let go once ended processes are looked for, unpinned, nothing stuck."""
    from gpucr.dataplane.mover import Mover, owner
    mover = Mover(sim_driver())
    uuid = next(iter(mover.vmm.device_by_uuid()))
    (tmp_path / "seg").write_bytes(b"\0" * (4 << 20))
    fd = os.open(tmp_path / "seg", os.O_RDWR)
    new = subprocess.Popen(["sleep", "60"])
    seg = {"segments": [{"index": 0, "bytes": 4 << 20}], "allocations": []}
    try:
        pid, start = owner(new.pid)
        assert mover.pin_ahead(pid, seg, [fd], uuid) == 4 << 20
        # as if pinned for a process that had this pid before: same pid, an earlier start
        mover.held.staging[(pid, start - 1)] = mover.held.staging.pop((pid, start))
        assert mover.pin_ahead(pid, seg, [fd], uuid) == 4 << 20, "the dead one's staging was taken for the new one's"
        assert {(h["start_time"], h["pinned_bytes"]) for h in mover.held.holdings()} == {(start - 1, 4 << 20), (start, 4 << 20)}
        mover.forget_ended()
        assert mover.held.holdings() == [{"pid": pid, "start_time": start, "mapped_bytes": 4 << 20,
                                     "pinned_bytes": 4 << 20, "stuck": False}]
    finally:
        new.kill()
        new.wait()
        mover.close()
        os.close(fd)


@contextmanager
def _a_copy_holding_the_data_plane(mover) -> Iterator[None]:
    """A copy out of process 4242 holds `mover`'s data plane (as one that stalls would) until the block ends."""
    import threading
    held, done = threading.Event(), threading.Event()

    def copy() -> None:
        with mover._plane("the copy out of process 4242"):
            held.set()
            done.wait(60)
    copier = threading.Thread(target=copy)
    copier.start()
    try:
        assert held.wait(10)
        yield
    finally:
        done.set()
        copier.join(10)


def test_a_wait_for_the_data_plane_gives_up_at_its_deadline_naming_its_holder():
    """No wait in the server is without end (issue 24): with the data plane held by a copy that stalls, a
    request behind it gives up at the deadline with one line naming what holds it."""
    from gpucr.errors import GpucrError
    from gpucr.dataplane.mover import Mover
    mover = Mover(sim_driver())
    mover.plane_wait_s = 0.3
    try:
        with _a_copy_holding_the_data_plane(mover):
            t0 = time.monotonic()
            with pytest.raises(GpucrError) as exc:
                mover.forget(1)
            assert time.monotonic() - t0 < 0.3 + 1.0
        said = str(exc.value)
        assert "\n" not in said and "stayed busy for 0.3 s, held by the copy out of process 4242" in said, said
    finally:
        mover.close()


def test_staging_let_go_while_a_pin_ahead_stalls_stays_accounted(tmp_path, monkeypatch):
    """A process's staging let go while pinning it ahead stalls in the driver: the wait for that pin ahead
    gives up at its deadline (one deadline for all its segments), and every segment the server cannot unpin
    then is kept among the stuck, shown with what is pinned of it; none is left mapped and pinned unseen."""
    import threading
    from gpucr.dataplane import pinned
    from gpucr.dataplane.mover import Mover, owner
    monkeypatch.setattr(pinned, "PIN_PIECE", 1 << 20)
    mover = Mover(sim_driver())
    mover.plane_wait_s = 1.0
    uuid = next(iter(mover.vmm.device_by_uuid()))
    fds = []
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"\0" * (4 << 20))
        fds.append(os.open(tmp_path / name, os.O_RDWR))
    stalled, go = threading.Event(), threading.Event()
    real_pin = mover.vmm.pin

    def pin(addr: int, size: int) -> None:
        real_pin(addr, size)
        stalled.set()
        assert go.wait(30)
    monkeypatch.setattr(mover.vmm, "pin", pin)
    layout = {"segments": [{"index": 0, "bytes": 4 << 20}, {"index": 1, "bytes": 4 << 20}], "allocations": []}
    ahead = threading.Thread(target=mover.pin_ahead, args=(os.getpid(), layout, fds, uuid))
    try:
        ahead.start()
        assert stalled.wait(10)
        t0 = time.monotonic()
        mover.forget(os.getpid())
        assert time.monotonic() - t0 < 2 * mover.plane_wait_s, "one deadline for the process, not one per segment"
        held = [(h["pid"], h["start_time"], h["mapped_bytes"], h["stuck"]) for h in mover.held.holdings()]
        assert held == [(*owner(os.getpid()), 8 << 20, True)], held
        go.set()   # the stalled piece ends: it stays counted, the pin ahead pins no more of either
        ahead.join(10)
        assert [h["pinned_bytes"] for h in mover.held.holdings()] == [1 << 20] and mover.pinned_bytes() == 1 << 20
    finally:
        go.set()
        ahead.join(10)
        for fd in fds:
            os.close(fd)
        mover.close()


def test_a_look_at_the_server_answers_at_once_while_a_copy_holds_the_data_plane(tmp_path):
    """`hello` (what ps, status and gpucr run ask first, 10 s at most) answers at once while a long copy holds
    the data plane: it lets go of ended processes' staging only when the plane is free. Meanwhile it shows
    the staging of a process that ended as still held (it is), and once the copy is done, none."""
    import threading
    from gpucr.server.daemon import Server
    from gpucr.dataplane.mover import Mover
    srv = Server()
    srv._mover = mover = Mover(sim_driver())
    uuid = next(iter(mover.vmm.device_by_uuid()))
    (tmp_path / "seg").write_bytes(b"\0" * (4 << 20))
    fd = os.open(tmp_path / "seg", os.O_RDWR)
    ended = subprocess.Popen(["sleep", "60"])
    answers: list[dict] = []
    try:
        assert mover.pin_ahead(ended.pid, {"segments": [{"index": 0, "bytes": 4 << 20}], "allocations": []},
                               [fd], uuid) == 4 << 20
        ended.kill()
        ended.wait()
        with _a_copy_holding_the_data_plane(mover):
            look = threading.Thread(target=lambda: answers.append(srv.info()), daemon=True)
            look.start()
            look.join(3.0)
            assert answers, "hello waited for the data plane"
        assert [(h["pid"], h["pinned_bytes"]) for h in answers[0]["staging"]] == [(ended.pid, 4 << 20)]
        assert srv.info()["staging"] == [] and mover.pinned_bytes() == 0
    finally:
        ended.kill()
        os.close(fd)
        mover.close()


def test_the_pin_ahead_loop_outlives_a_failing_round(monkeypatch):
    """F22 for the whole round, not only one process's pin ahead: the data plane's clean-up (its wait for the
    plane may give up) or the giving back of a lent GPU's context failing ends nothing; each reason is logged
    once, and the loop goes on pinning ahead."""
    import threading
    from gpucr.errors import GpucrError
    from gpucr.server import daemon
    from gpucr.dataplane.mover import Mover
    monkeypatch.setattr(daemon, "PIN_AHEAD_EVERY_S", 0.02)
    said: list[str] = []
    monkeypatch.setattr(daemon, "log", said.append)
    srv = daemon.Server()
    srv._mover = mover = Mover(sim_driver())
    calls = {"forget_ended": 0, "let_go_busy_neighbours": 0}

    def failing_3_times(name: str, then):
        def call():
            calls[name] += 1
            if calls[name] <= 3:
                raise GpucrError(f"{name} failed")
            return then()
        return call
    for name in calls:
        monkeypatch.setattr(mover, name, failing_3_times(name, getattr(mover, name)))
    loop = threading.Thread(target=srv.pin_ahead_loop, daemon=True)
    loop.start()
    try:
        wait_for(lambda: calls["let_go_busy_neighbours"] >= 8, 10, "rounds after the failing ones")
        assert loop.is_alive()
        failed = [line for line in said if "pinning ahead failed" in line]
        assert len(failed) == 2 and "forget_ended failed" in failed[0] and "let_go_busy_neighbours failed" in failed[1], said
    finally:
        srv.stopping.set()
        loop.join(10)
        mover.close()


def _exported_memory(vmm, dev: int, uuid: str, sizes: list[int]) -> tuple[list, list[bytes]]:
    """Device memory of `sizes` on simcuda, each filled with its own bytes and exported: [Managed] with our
    fd of each (what the agent hands the server at a checkpoint), and the bytes."""
    import ctypes
    from gpucr.memory import Managed
    memory, data = [], []
    for i, size in enumerate(sizes):
        h = vmm.create(size, dev)
        va = vmm.map(h, size, dev)
        data.append(os.urandom(size))
        ctypes.memmove(va, data[-1], size)   # simcuda's device memory is this process's memory
        memory.append(Managed(i, "converted", size, dev, True, False, [], vmm.export_fd(h), uuid, True, True))
        vmm.unmap(va, size)
        vmm.release(h)   # the fd keeps it
    return memory, data


def _device_bytes(vmm, fd: int, size: int, dev: int) -> bytes:
    import ctypes
    h = vmm.import_fd(fd)
    va = vmm.map(h, size, dev)
    try:
        return ctypes.string_at(va, size)
    finally:
        vmm.unmap(va, size)
        vmm.release(h)


def test_staging_is_pinned_in_pieces_and_no_copy_spans_two(tmp_path, monkeypatch):
    """The server pins staging a piece at a time (dataplane/pinned.py: one registration of a new 4 GiB segment
    beside a checkpoint slowed it by 0.3 s on the H200), as far as the allocations reach; and no copy's host
    range spans two pieces, which the real driver would copy as pageable memory. simcuda counts such copies:
    none, both ways, bytes equal; and with the cuts at piece ends left out, it counts them."""
    from gpucr.driver import sim_pageable_async_copies
    from gpucr.dataplane import move, mover as mv, pinned
    monkeypatch.setattr(pinned, "PIN_PIECE", 3 << 20)
    monkeypatch.setattr(pinned, "file_page", lambda blksize: pinned.PAGE)   # whatever tmp's filesystem says
    monkeypatch.setattr(move, "CHUNK", 2 << 20)
    drv = sim_driver()
    mover = mv.Mover(drv)
    vmm = mover.vmm
    uuid, dev = next(iter(vmm.device_by_uuid().items()))
    ctx = vmm.retain_context(dev)
    vmm.use(ctx)
    pins = []
    real_pin = vmm.pin
    monkeypatch.setattr(vmm, "pin", lambda addr, size: (pins.append(size), real_pin(addr, size))[1])
    sizes, offsets = [4 << 20, 4 << 20], [0, (4 << 20) + 8192]   # the second over two piece ends (6 and 9 MiB)
    memory, data = _exported_memory(vmm, dev, uuid, sizes)
    layout = {"segments": [{"index": 0, "bytes": 12 << 20}],
              "allocations": [{"index": i, "bytes": n, "segment": 0, "offset": o} for i, (n, o) in enumerate(zip(sizes, offsets))]}
    (tmp_path / "seg").write_bytes(b"\0" * (12 << 20))
    seg_fd = os.open(tmp_path / "seg", os.O_RDWR)
    fds: list[int] = []
    try:
        before = sim_pageable_async_copies(drv)
        st = mover.copy_out(1, layout, [seg_fd], memory)
        assert st.bytes == sum(sizes) and sim_pageable_async_copies(drv) == before
        staged = (tmp_path / "seg").read_bytes()
        assert [staged[o:o + n] for n, o in zip(sizes, offsets)] == data
        assert mover.held.staging[mv.owner(1)][0].ends == [3 << 20, 6 << 20, (8 << 20) + 8192], "pinned in pieces, as far as they reach"
        assert pins == [3 << 20, 3 << 20, (2 << 20) + 8192]
        st, fds = mover.fill(1, layout, [seg_fd], memory)
        assert sim_pageable_async_copies(drv) == before and len(pins) == 3, "the fill pins nothing again"
        vmm.use(ctx)
        assert [_device_bytes(vmm, fd, n, dev) for (_i, fd), n in zip(fds, sizes)] == data
        # the check itself: copies cut only at CHUNK, over the pieces' ends, are what simcuda counts
        monkeypatch.setattr(pinned.Segment, "cuts",
                            lambda self, off, size, most: ((off + k, min(most, size - k)) for k in range(0, size, most)))
        mover.copy_out(1, layout, [seg_fd], memory)
        assert sim_pageable_async_copies(drv) > before
    finally:
        for fd in [fd for _i, fd in fds] + [m.fd for m in memory] + [seg_fd]:
            os.close(fd)
        mover.close()
        vmm.release_context(dev)


def test_pieces_start_and_end_on_the_staging_files_own_pages(monkeypatch):
    """On hugetlbfs (st_blksize: the huge page) no piece starts or ends inside a huge page, which two
    registrations would then share; on shared memory a piece ends on a 4 KiB page; a copy asked past what is
    pinned is the server's own mistake, said, not an index error."""
    from gpucr.dataplane import pinned

    class Vmm:
        def __init__(self) -> None:
            self.pins: list[tuple[int, int]] = []

        def pin(self, addr: int, size: int) -> None:
            self.pins.append((addr, size))
    monkeypatch.setattr(pinned, "PIN_PIECE", 3 << 20)
    assert [pinned.file_page(b) for b in (2 << 20, 1 << 30, 4096, 512, 3 << 20, 2 << 30)] == \
        [2 << 20, 1 << 30, 4096, 4096, 4096, 4096]
    huge, vmm = pinned.Segment((0, 1), 1 << 40, 16 << 20, page=2 << 20), Vmm()
    assert pinned.pin(vmm, huge, (5 << 20) + 4096) == 6 << 20
    pinned.pin(vmm, huge, 16 << 20)
    assert [(a - huge.addr, n) for a, n in vmm.pins] == [(0, 4 << 20), (4 << 20, 2 << 20), (6 << 20, 4 << 20),
                                                        (10 << 20, 4 << 20), (14 << 20, 2 << 20)]
    assert all(a % (2 << 20) == 0 and n % (2 << 20) == 0 for a, n in vmm.pins)
    shm, vmm = pinned.Segment((0, 2), 1 << 40, 16 << 20), Vmm()
    assert pinned.pin(vmm, shm, (5 << 20) + 1) == (5 << 20) + 4096 and shm.ends == [3 << 20, (5 << 20) + 4096]
    assert list(shm.cuts(0, 5 << 20, 2 << 20)) == [(0, 2 << 20), (2 << 20, 1 << 20), (3 << 20, 2 << 20)]
    with pytest.raises(gpucr.GpucrError, match="server's own mistake"):
        list(shm.cuts(4 << 20, 2 << 20, 1 << 20))


def test_pinning_ahead_stops_between_pieces_for_a_request_and_goes_on_from_there(tmp_path, monkeypatch):
    """A request that will copy (the daemon enters `wanted` for a whole checkpoint or restore) stops pinning
    ahead at the end of the piece being pinned; what was pinned stays: a copy that needs more pins only the
    rest of what it needs, and the next pin ahead goes on from there, no piece pinned twice."""
    from gpucr.dataplane import pinned
    from gpucr.dataplane.mover import Mover, Stats, owner
    monkeypatch.setattr(pinned, "PIN_PIECE", 1 << 20)
    mover = Mover(sim_driver())
    uuid = next(iter(mover.vmm.device_by_uuid()))
    (tmp_path / "seg").write_bytes(b"\0" * (8 << 20))
    fd = os.open(tmp_path / "seg", os.O_RDWR)
    pinned_at: list[int] = []
    request = mover.wanted()
    real_pin = mover.vmm.pin

    def pin(addr: int, size: int) -> None:
        real_pin(addr, size)
        pinned_at.append(addr)
        if len(pinned_at) == 3:
            request.__enter__()   # a checkpoint arrives while the third piece is pinned
    monkeypatch.setattr(mover.vmm, "pin", pin)
    layout = {"segments": [{"index": 0, "bytes": 8 << 20}], "allocations": []}
    try:
        assert mover.pin_ahead(1, layout, [fd], uuid) == 3 << 20 and mover.pinned_bytes() == 3 << 20
        assert mover.pin_ahead(1, layout, [fd], uuid) == 0, "nothing more while the request is under way"
        # the request's copy needs 5 MiB of the segment: the two pieces missing, no more
        mover.held.map(owner(1), {0: 5 << 20}, [fd], Stats(), {0: 8 << 20})
        assert len(pinned_at) == 5 and mover.pinned_bytes() == 5 << 20
        request.__exit__(None, None, None)
        assert mover.pin_ahead(1, layout, [fd], uuid) == 3 << 20, "the rest, once the request is done"
        assert mover.pin_ahead(1, layout, [fd], uuid) == 0
        base = min(pinned_at)
        assert sorted(a - base for a in pinned_at) == [k << 20 for k in range(8)], "each piece once"
    finally:
        os.close(fd)
        mover.close()


def test_a_copy_that_comes_while_a_segment_is_pinned_ahead_waits_for_that_piece_and_goes_on(tmp_path, monkeypatch):
    """The segment being pinned ahead stays in the cache, marked busy: a copy that needs it (the data plane
    wanted, its lock held) waits for the piece being pinned, then pins only what is still missing; it
    neither maps nor pins the segment a second time, and no piece is pinned twice."""
    import threading
    from gpucr.dataplane import pinned
    from gpucr.dataplane.mover import Mover, Stats, owner
    monkeypatch.setattr(pinned, "PIN_PIECE", 1 << 20)
    monkeypatch.setattr(pinned, "file_page", lambda blksize: pinned.PAGE)
    mover = Mover(sim_driver())
    uuid = next(iter(mover.vmm.device_by_uuid()))
    (tmp_path / "seg").write_bytes(b"\0" * (8 << 20))
    fd = os.open(tmp_path / "seg", os.O_RDWR)
    first_piece, go = threading.Event(), threading.Event()
    pinned_at: list[int] = []
    real_pin = mover.vmm.pin

    def pin(addr: int, size: int) -> None:
        real_pin(addr, size)
        pinned_at.append(addr)
        if len(pinned_at) == 1:
            first_piece.set()
            assert go.wait(10)
    monkeypatch.setattr(mover.vmm, "pin", pin)
    ahead = threading.Thread(target=mover.pin_ahead, args=(1, {"segments": [{"index": 0, "bytes": 8 << 20}],
                                                            "allocations": []}, [fd], uuid))
    seen: dict = {}

    def copy() -> None:
        with mover.wanted(), mover._lock:
            mover.vmm.use(mover.context(mover.vmm.device_by_uuid()[uuid])[0])   # as a copy's staging() does
            seen.update(mover.held.map(owner(1), {0: 5 << 20}, [fd], Stats(), {0: 8 << 20}))
    copier = threading.Thread(target=copy)
    try:
        ahead.start()
        assert first_piece.wait(10)
        seg = mover.held.staging[owner(1)][0]
        assert seg.busy, "in the cache while it is pinned"
        copier.start()
        copier.join(0.3)
        assert copier.is_alive(), "the copy waits for the piece being pinned"
        go.set()
        ahead.join(10)
        copier.join(10)
        assert not ahead.is_alive() and not copier.is_alive()
        assert seen[0] is seg and seg.bytes == 5 << 20 and not seg.busy
        base = min(pinned_at)
        assert sorted(a - base for a in pinned_at) == [k << 20 for k in range(5)], "no piece twice"
    finally:
        go.set()
        os.close(fd)
        mover.close()


def test_a_checkpoint_or_restore_request_wants_the_data_plane_throughout(monkeypatch):
    """From the request's first step (its checks, the handover), not only its copy: pinning ahead yields."""
    from gpucr.server import daemon
    from gpucr.dataplane.mover import Mover
    mover = Mover(sim_driver())
    seen: list[int] = []

    class Serving:
        def data_plane(self) -> Mover:
            return mover

        def let_go(self, pids: list[int]) -> None:
            pass
    monkeypatch.setattr(daemon.coordinator, "checkpoint_many", lambda *a, **k: seen.append(mover._wanted) or [])
    monkeypatch.setattr(daemon.coordinator, "restore_many", lambda *a, **k: seen.append(mover._wanted) or [])
    monkeypatch.setattr(daemon, "to_json", lambda result: result)
    try:
        daemon._checkpoint(Serving(), {"pids": [1], "level": "full", "timeout": 5.0})()
        daemon._restore(Serving(), {"pids": [1], "timeout": 5.0, "drop_staging": False, "force": False})()
        assert seen == [1, 1] and mover._wanted == 0
    finally:
        mover.close()


# ---- routes through an idle NVLink neighbour (issue 13, item 3) ----

@pytest.fixture
def two_gpus(monkeypatch):
    """Two simulated GPUs for the server, the apps and this controller (joined by NVLink unless told)."""
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")


def test_copies_go_through_an_idle_nvlink_neighbour_too(two_gpus, sim_app):
    """With GPU 1 idle and joined to GPU 0 by NVLink, the server moves about half of a GPU-0 process's data
    through GPU 1 (host <-> GPU 1 over its own link, GPU 1 <-> GPU 0 over NVLink), both ways, every byte back;
    the results say how much went through it, and the server holds nothing on GPU 1 but its context after."""
    srv = RunningServer(True)
    try:
        app = sim_app("--sizes", "256M,8M", "--vmm-mib", "64")
        before = app.ask("digest")
        ck = gpucr.checkpoint(app.pid)
        rs = gpucr.restore(app.pid)
        assert app.ask("digest") == before
        gpu1 = app.ask("uuids")["uuids"][1]
        assert set(ck.routes) == {gpu1} and set(rs.routes) == {gpu1}, (ck.routes, rs.routes)
        for r, moved in ((ck.routes, ck.bytes_moved), (rs.routes, rs.bytes_moved)):
            assert 0.3 * moved <= r[gpu1] <= 0.7 * moved, (r, moved)
        # which way set the pace, and what watching GPU 1 cost, within the copy's own time
        for ph, copy in ((ck.phases_s, "data_out"), (rs.phases_s, "data_in")):
            assert 0 <= ph["route_looks"] <= ph["server_route"] and ph["server_straight"] <= ph[copy], ph
            assert ph["server_route"] <= ph[copy], ph
        assert not ck.warnings, ck.warnings
        assert process_gpu_memory(sim_driver(), srv.pid, 1) == SIM_CONTEXT_BYTES, "the lane's slots were freed"
        second = gpucr.checkpoint(app.pid)
        gpucr.restore(app.pid)
        assert app.ask("digest") == before and second.routes == ck.routes
    finally:
        srv.stop()


@pytest.mark.parametrize("why", ["not-joined", "busy", "no-routes"])
def test_no_route_through_a_neighbour_that_is_busy_not_joined_or_refused(two_gpus, sim_app, monkeypatch, why):
    """No route through GPU 1 when NVLink does not join it to GPU 0 (SIMCUDA_NVLINK=none, as NVML would say),
    when another process works on it, or with `gpucr serve --no-routes`: everything goes straight, byte-exact."""
    if why == "not-joined":
        monkeypatch.setenv("SIMCUDA_NVLINK", "none")
    srv = RunningServer(True, *(["--no-routes"] if why == "no-routes" else []))
    try:
        if why == "busy":
            other = sim_app()
            other.ask("device 1 4M")
        app = sim_app("--sizes", "128M")
        before = app.ask("digest")
        ck = gpucr.checkpoint(app.pid)
        rs = gpucr.restore(app.pid)
        assert app.ask("digest") == before
        assert ck.routes == {} and rs.routes == {}, (ck.routes, rs.routes)
        assert ck.bytes_moved >= 128 << 20
        assert srv.info()["routes"] is (why != "no-routes")
    finally:
        srv.stop()


def test_a_route_given_up_mid_copy_when_its_gpu_gets_busy(two_gpus, sim_app, monkeypatch):
    """A process appearing on the neighbour in the middle of a copy (fault injection: it looks busy from its
    third look on): the route is given up at once, the rest goes straight, every byte comes back, and the
    checkpoint says so in a warning; the server gives its context there back within a second or two."""
    monkeypatch.setenv("GPUCR_TEST_ROUTE_BUSY_AFTER", "3")
    srv = RunningServer(True)
    try:
        app = sim_app("--sizes", "512M")
        before = app.ask("digest")
        gpu1 = app.ask("uuids")["uuids"][1]
        ck = gpucr.checkpoint(app.pid)
        assert 0 < ck.routes.get(gpu1, 0) <= 3 * (64 << 20), ck.routes
        assert any("given up mid-copy" in w and gpu1 in w for w in ck.warnings), ck.warnings
        rs = gpucr.restore(app.pid)
        assert rs.routes == {}, "busy from then on: no route"
        assert app.ask("digest") == before
        wait_for(lambda: process_gpu_memory(sim_driver(), srv.pid, 1) == 0, what="the server to leave GPU 1")
        assert "whose link it lent" in srv.log.read_text()
    finally:
        srv.stop()


def test_a_neighbour_that_becomes_a_served_processes_gpu_keeps_its_context(two_gpus, sim_app):
    """GPU 1 lends its link, then a process the server serves works on it: the server's context there is
    now that process's (its copies, and staging pinned there), so it is kept, not given back as a lender's."""
    srv = RunningServer(True)
    try:
        lender = sim_app("--sizes", "256M")
        assert gpucr.checkpoint(lender.pid).routes, "GPU 1 lent its link"
        gpucr.restore(lender.pid)
        user = sim_app("--sizes", "8M")
        user.ask("device 1 64M")
        before = user.ask("digest")
        # until the server serves it, the user is just a process on GPU 1: the pin-ahead loop may rightly give
        # back the lender's context meanwhile; only what it does once the server has served the user counts
        gpucr.checkpoint(user.pid)
        seen = len(srv.log.read_text())
        gpucr.restore(user.pid)
        time.sleep(2.5)   # the pin-ahead loop, which gives back lenders' contexts, runs every second
        assert "whose link it lent" not in srv.log.read_text()[seen:]
        assert process_gpu_memory(sim_driver(), srv.pid, 1) == SIM_CONTEXT_BYTES
        assert user.ask("digest") == before
    finally:
        srv.stop()


@pytest.mark.parametrize("call", ["cuMemAlloc_v2:1", "cuMemcpyAsync:2"])
def test_a_neighbour_that_fails_costs_no_byte(two_gpus, sim_app, monkeypatch, call):
    """The neighbour cannot give memory for its slots (its first cuMemAlloc fails): no route, all straight.
    A copy through it fails mid-way (its second GPU-to-GPU copy, in the routing thread): the checkpoint fails
    in one error, the process runs on with every byte and nothing on GPU 1, and the next checkpoint works."""
    app = sim_app("--sizes", "256M")
    before = app.ask("digest")
    monkeypatch.setenv("SIMCUDA_FAIL_CALL", call)   # the server's, not the app's (started before)
    srv = RunningServer(True)
    try:
        if call.startswith("cuMemAlloc"):
            ck = gpucr.checkpoint(app.pid)
            assert ck.routes == {} and ck.bytes_moved >= 256 << 20, ck
        else:
            with pytest.raises(gpucr.GpucrError, match="copying between GPUs failed"):
                gpucr.checkpoint(app.pid)
            wait_for(lambda: gpucr.status(app.pid).state == "running" and not gpucr.status(app.pid).busy,
                     what="the roll-back")
            assert app.ask("digest") == before
            assert gpu_memory(sim_driver(), 1).used == SIM_CONTEXT_BYTES, "the server's context, no slot"
            ck = gpucr.checkpoint(app.pid)
            assert ck.routes, "the fault fired once: the route works again"
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
    finally:
        srv.stop()


@pytest.mark.parametrize("op,point", [("checkpoint", "during-server-copy"), ("checkpoint", "after-data-out"),
                                      ("restore", "after-driver-restore")])
def test_server_killed_while_copying_through_a_neighbour(two_gpus, sim_app, op, point):
    """A server SIGKILLed while its copies also go through GPU 1 loses nothing either: the process runs on or
    is restorable in-process with every byte, and nothing of the server's stays on GPU 1."""
    srv = RunningServer(True)
    try:
        app = sim_app("--sizes", "256M")
        before = app.ask("digest")
        if op == "restore":
            assert gpucr.checkpoint(app.pid).routes, "the route was taken"
        r = gpucr_cli(op, str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
        one_line_error(r, f"died during '{op}'")
        assert srv.proc.wait(timeout=30) == -signal.SIGKILL
        if point == "during-server-copy":   # the driver had not checkpointed it: the agent rolls back
            wait_for(lambda: gpucr.status(app.pid).state == "running" and not gpucr.status(app.pid).busy,
                     what="the agent's roll-back")
        else:
            r = gpucr_cli("restore", str(app.pid))
            assert r.returncode == 0, r.stderr
        assert gpucr.status(app.pid).state == "running"
        assert app.ask("digest") == before
        assert gpu_memory(sim_driver(), 1).used == 0, "nothing on GPU 1: the app is not there, the server is gone"
    finally:
        srv.stop()


def test_a_restore_finds_the_agents_own_roll_back_done(server, sim_app):
    """The server killed after its copy, before the commit, the driver holding the process: the agent's own
    roll-back (taking its memory back from its fds) fails while the driver holds it, and a restore takes it back
    after the driver's. The roll-back may retry first, late: the restore then finds it done and succeeds."""
    # the agent starts its roll-back 2.5 s late, as on a loaded machine
    app = sim_app("--sizes", "32M,4M", env=dict(os.environ, GPUCR_TEST_ROLLBACK_DELAY_MS="2500"))
    before = app.ask("digest")
    r = gpucr_cli("checkpoint", str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT="after-data-out"))
    one_line_error(r, "died during 'checkpoint'")
    assert server.proc.wait(timeout=30) == -signal.SIGKILL
    r = gpucr_cli("restore", str(app.pid))
    assert r.returncode == 0, r.stderr
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


# ---- the server killed: the app loses nothing, in-process still works ----

@pytest.mark.parametrize("point,after", [
    # the server's data plane: the agent hands over (releases, keeping its fds), then the server copies
    # while the driver locks and checkpoints the process, then the agent lets go of its fds (data out)
    ("after-handover", "running"),             # the agent's lease takes the memory back by itself
    ("during-server-copy", "running"),         # ... with the copy half done: nothing left the GPU
    ("after-driver-lock", "restorable"),       # the driver holds it: a restore finishes the job
    ("after-driver-checkpoint", "restorable"),
    ("after-data-out", "restorable"),          # copied, the driver holds it: a restore brings it back
])
def test_server_killed_during_checkpoint(server, sim_app, point, after):
    """A server SIGKILLed at each phase of a checkpoint: the client says so in one line, the process runs
    on or is restorable in-process with every byte, and can be cycled again."""
    app = sim_app("--sizes", "32M,4M", "--vmm-mib", "8")
    before = app.ask("digest")
    r = gpucr_cli("checkpoint", str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    one_line_error(r, f"the gpucr server (pid {server.pid}) died during 'checkpoint'", f"gpucr restore {app.pid}")
    assert server.proc.wait(timeout=30) == -signal.SIGKILL
    if after == "running":
        wait_for(lambda: gpucr.status(app.pid).state == "running" and not gpucr.status(app.pid).busy,
                 what="the agent's roll-back")
    else:
        assert sim_driver().state(app.pid) != ProcessState.RUNNING
        r = gpucr_cli("restore", str(app.pid))
        assert r.returncode == 0, r.stderr
        assert "gpucr server is not running" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert gpucr.status(app.pid).state == "running"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    assert app.ask("digest") == before
    gpucr.checkpoint(app.pid)   # in-process now, and it still works
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


@pytest.mark.parametrize("point", ["after-driver-restore", "after-driver-unlock"])
def test_server_killed_during_restore(server, sim_app, point):
    """A server SIGKILLed mid restore leaves the process checkpointed; an in-process restore completes it."""
    app = sim_app("--sizes", "32M,4M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    r = gpucr_cli("restore", str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    one_line_error(r, "died during 'restore'")
    server.proc.wait(timeout=30)
    assert gpucr.status(app.pid).state == "checkpointed"
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("digest") == before


def test_server_killed_mid_data_out(server, sim_app):
    """SIGKILL while the server waits for 1.5 GiB to be copied out: the agent rolls back by itself. Level data: no
    driver lock beside the copy (a server killed after the driver locked the process leaves it to 'gpucr recover',
    test_server_killed_during_checkpoint), and killed once the agent has handed its memory over (its staging, made
    by the server first, no longer hides that moment behind 0.1 s of making it in the app)."""
    app = sim_app("--sizes", "1500M")
    before = app.ask("digest")
    p = subprocess.Popen([sys.executable, "-m", "gpucr.cli", "checkpoint", "--level", "data", str(app.pid)],
                         stderr=subprocess.PIPE, text=True)
    with targets.resolve(app.pid).connect() as agent:
        wait_for(lambda: agent.call("status")["phase"] == "handed", what="the handover")
    os.kill(server.pid, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "died during 'checkpoint'" in err, err
    wait_for(lambda: gpucr.status(app.pid).state == "running" and not gpucr.status(app.pid).busy,
             what="the agent's roll-back")
    assert app.ask("digest") == before


def test_a_stopped_server_is_named_at_once(server, sim_app):
    """A server stopped (SIGSTOP) while a client waits cannot answer, nor put its deadlines on the wait:
    the client names it within seconds, one line, and the server serves again once continued."""
    app = sim_app("--sizes", "8M")
    os.kill(server.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = gpucr_cli("status", str(app.pid), timeout=30)
        assert time.monotonic() - t0 < 10
        one_line_error(r, f"process {server.pid} is stopped", f"kill -CONT {server.pid}", "--no-server")
    finally:
        os.kill(server.pid, signal.SIGCONT)
    n = server.requests()
    assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0 and gpucr_cli("restore", str(app.pid)).returncode == 0
    assert server.requests() >= n + 2


def test_a_killed_servers_socket_is_noted_once_then_replaced(server, sim_app):
    """A killed server leaves its socket: the next request notes it in one line, removes the dead socket
    (so the note is not repeated) and acts in-process; a new server takes the name."""
    app = sim_app("--sizes", "8M")
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    assert server.socket.exists()
    r = gpucr_cli("status", str(app.pid))
    assert r.returncode == 0 and r.stderr.count("gpucr: note:") == 1 and "not running" in r.stderr, r.stderr
    assert not server.socket.exists()
    r = gpucr_cli("ps")
    assert r.returncode == 0 and "server: not running" in r.stdout and r.stderr == "", r.stderr
    assert gpucr_cli("status", str(app.pid)).stderr == ""
    again = RunningServer(True)
    try:
        assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0 and again.requests() == 1
        assert gpucr_cli("restore", str(app.pid)).returncode == 0
    finally:
        again.stop()


# ---- F20 (issue 24): a client that goes away, a server out of fds ----

def test_a_request_whose_client_went_away_stops_at_its_next_step(server):
    """The client of a checkpoint is killed while the server waits on the target (its 'status' answer comes
    3 s late): the server does not go on to checkpoint it, but stops before its next step, says why in its
    log, and the process runs on with its data."""
    from test_hostile_answers import Hostile
    app = Hostile("status", HOSTILE_MODE="late", HOSTILE_DELAY_S="3")
    try:
        before = app.digest()
        cli = subprocess.Popen([sys.executable, "-m", "gpucr.cli", "checkpoint", "--level", "data", str(app.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: server.info()["in_flight"] == 1, 10, "the checkpoint to reach the server")
        cli.kill()
        cli.wait()
        said = f"checkpoint of process {app.pid}: "
        wait_for(lambda: said in server.log.read_text(), 20, "the checkpoint to end")
        line = next(l for l in server.log.read_text().splitlines() if said in l)
        assert "refused" in line and "client went away" in line, line
        assert gpucr.status(app.pid).state == "running" and app.digest() == before
    finally:
        app.close()


def _socket_at(fd: int, sock: socket.socket) -> socket.socket:
    """`sock` on fd `fd` too (the open-file limit raised that far if needed), as a server with that many fds
    open holds its connections."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= fd:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 1, hard))
    os.dup2(sock.fileno(), fd)
    return socket.socket(fileno=fd)


def test_a_live_client_on_an_fd_past_1023_is_not_taken_for_gone():
    """A server with over a thousand fds open (a thousand requests, or staging fds) serves connections on fds
    past 1023, where select() cannot look: such a client, still waiting, is not taken for gone; once it
    closes its end, it is."""
    from gpucr import abandon
    server_end, client_end = socket.socketpair()
    conn = _socket_at(1100, server_end)
    server_end.close()
    try:
        with abandon.serving(conn):
            assert not abandon.client_gone(conn) and abandon.why_abandoned() is None
            client_end.close()
            assert abandon.client_gone(conn) and "client went away" in abandon.why_abandoned()
    finally:
        client_end.close()
        conn.close()


SERVER_FDS = 64   # the open-file limit of the server out of fds below


def _fewer_fds() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_FDS, SERVER_FDS))


def test_a_server_out_of_fds_waits_and_serves_again():
    """Connections that take every fd the server may open make its accept fail with EMFILE: it says so once,
    keeps serving what it holds, and serves a later client once those connections have closed."""
    srv = RunningServer(True, preexec_fn=_fewer_fds)
    conns: list[socket.socket] = []
    try:
        for _ in range(SERVER_FDS + 8):   # the last ones wait in the listen backlog
            conns.append(socket.socket(socket.AF_UNIX))
            conns[-1].connect(str(srv.socket))
        wait_for(lambda: "cannot accept connections: Too many open files" in srv.log.read_text(), 10, "EMFILE")
        time.sleep(1.0)
        assert srv.proc.poll() is None, srv.log.read_text()
        for c in conns:
            c.close()
        conns.clear()
        wait_for(lambda: srv.info() is not None, 30, "the server to answer again")
        log = srv.log.read_text()
        assert log.count("cannot accept connections") == 1 and "accepting connections again" in log, log
    finally:
        for c in conns:
            c.close()
        srv.stop()


def test_ps_shows_the_staging_the_server_holds_by_its_owner_and_none_once_it_died(server, sim_app):
    """F21 (issue 24): `gpucr ps` shows what the server holds of each process's staging, by the process's pid;
    once the process has died, none."""
    app = sim_app("--sizes", "8M")
    assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0
    ps = gpucr_cli("ps").stdout
    assert f"holds for process {app.pid}: 8 MiB of staging mapped, 8 MiB pinned" in ps, ps
    app.close()
    ps = gpucr_cli("ps").stdout
    assert "holds no staging of any process" in ps and f"process {app.pid}" not in ps, ps


def test_roots_server_holds_nothing_of_another_users_process_once_it_died(users):
    """F21: root's server is asked to checkpoint another user's processes one after the other (on simcuda the
    import of their memory fails: their simcuda is theirs alone); once each has died, the server holds no
    staging of it, no fd more than after the one before, and `gpucr ps` says it holds nothing."""
    from test_hostile_answers import Hostile, fd_floor
    srv, after = RunningServer(True), []
    try:
        for _ in range(3):   # the first warms the server (its context's fds)
            app = Hostile("memory", users["attacker"])
            try:
                gpucr_cli("checkpoint", "--level", "data", str(app.pid))
            finally:
                app.close()
            ps = gpucr_cli("ps").stdout
            assert "holds no staging of any process" in ps and f"process {app.pid}" not in ps, ps
            assert srv.info()["staging"] == []
            after.append(fd_floor(srv.pid))
        assert after[2] <= after[1], f"the server's fds after each process: {after}"
    finally:
        srv.stop()


# ---- one server, its socket and who may use it ----

def test_a_second_server_exits_and_the_first_keeps_its_socket(server):
    r = gpucr_cli("serve", "--simulate")
    one_line_error(r, "already listens on")
    assert server.info()["pid"] == server.pid


def test_socket_log_and_dir_are_private(server):
    st = os.lstat(server.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert paths.dir_problem(server.socket.parent, os.getuid()) is None


def test_a_client_of_another_uid_is_refused_by_the_server(monkeypatch):
    """Even with the dir and socket opened up by hand, SO_PEERCRED keeps another uid out."""
    d = Path(tempfile.mkdtemp(dir="/tmp"))   # reachable by another user once opened up (pytest's own dirs are not)
    monkeypatch.setenv("GPUCR_RUNTIME_DIR", str(d))
    srv = RunningServer(True)
    try:
        os.chmod(d, 0o711)
        os.chmod(srv.socket, 0o666)
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
                 "s.sendall(b'{\"op\":\"ps\"}\\n'); print(s.recv(4096).decode())")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe,
                            str(srv.socket)], capture_output=True, text=True, timeout=30)
        reply = json.loads(r.stdout)
        assert reply["ok"] is False and "serves uid 0 only, not uid 65534" in reply["error"], r
        assert client.info(True) is None, "a client never uses a server in a dir that is not private"
        os.chmod(d, 0o700)
        assert srv.info()["pid"] == srv.pid
        assert "refused a connection" in srv.log.read_text()
    finally:
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root (unshare makes a pid namespace)")
def test_a_client_in_another_pid_namespace_is_refused(server, sim_app):
    """Pids in a request mean what they mean in the server's namespace only: a client elsewhere is refused,
    and gpucr there acts in-process."""
    probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
             "s.sendall(b'{\"op\":\"ps\"}\\n'); print(s.recv(4096).decode())")
    r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", probe, str(server.socket)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"needs unshare to make a pid namespace here: {r.stderr.strip()}")
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and reply["mismatch"] and "another pid or mount namespace" in reply["error"]
    # gpucr itself there looks for its own namespace's server (F27), finds none, and acts in-process
    r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m", "gpucr.cli", "ps"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "server: not running" in r.stdout, r.stdout


@pytest.mark.skipif(os.getuid() != 0, reason="needs root (unshare makes a namespace)")
@pytest.mark.parametrize("unshare", [["-p", "-f", "--mount-proc"], ["-m"]], ids=["pid-and-mount", "mount-only"])
def test_namespaces_sharing_a_runtime_dir_each_have_their_own_server(server, unshare):
    """F27 (issue 24): a pid or mount namespace sharing this runtime dir starts a server of its own, beside this
    one (its own socket and log), and its clients find it. No one knocks on the other namespace's server: while
    both run, neither logs a refusal, though each one's pin-ahead loop lists the runtime dir every second, as
    `gpucr ps` does."""
    py = f"{sys.executable} -m gpucr.cli"
    both_run_s = 2.5 * daemon.PIN_AHEAD_EVERY_S
    inside = (f"{py} serve --simulate & S=$!; while kill -0 $S && ! {py} serve --status --simulate --json > st.json; "
              f"do sleep 0.1; done; {py} ps > /dev/null; sleep {both_run_s}; {py} serve --stop --simulate; wait")
    r = subprocess.run(["unshare", *unshare, "bash", "-c", inside], cwd=server.socket.parent,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"needs unshare to make a namespace here: {r.stderr.strip()}")
    theirs = json.loads((server.socket.parent / "st.json").read_text())
    assert theirs["running"], r.stderr
    assert theirs["socket"] != str(server.socket) and theirs["log"] != server.info()["log"]
    assert server.info()["pid"] == server.pid and "already listens" not in r.stderr, r.stderr
    assert "refused" not in r.stderr, r.stderr
    assert "refused" not in server.log.read_text(), server.log.read_text()


def test_garbage_and_bad_requests_are_answered_and_serving_goes_on(server, sim_app):
    app = sim_app("--sizes", "4M")

    def raw(data: bytes) -> dict | None:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(server.socket))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        s.close()
        return json.loads(out) if out else None
    ident = {"protocol": wire.PROTOCOL, "code": wire.code_identity()}
    assert raw(b"\x00\xff not json\n")["ok"] is False
    assert raw(b"[1,2]\n")["ok"] is False
    assert "unknown request" in raw(json.dumps({"op": "rm -rf", **ident}).encode() + b"\n")["error"]
    assert "malformed" in raw(json.dumps({"op": "status", "args": {"pid": "1; ls"}, **ident}).encode() + b"\n")["error"]
    assert "malformed" in raw(json.dumps({"op": "checkpoint", "args": {"pids": [True]}, **ident}).encode() + b"\n")["error"]
    bad_env = {"op": "ps", "env": {"LD_PRELOAD": "/tmp/evil.so"}, **ident}
    assert "may carry only" in raw(json.dumps(bad_env).encode() + b"\n")["error"]
    other = {"op": "ps", "protocol": wire.PROTOCOL, "code": "0.0.0:/elsewhere"}
    reply = raw(json.dumps(other).encode() + b"\n")
    assert reply["mismatch"] and "another gpucr" in reply["error"]
    assert raw(b"") is None                                    # a connection that says nothing
    assert raw(b"x" * (wire.MAX_MESSAGE + 10))["ok"] is False  # larger than any request
    assert gpucr.status(app.pid).state == "running"
    assert server.info()["pid"] == server.pid


# ---- started by `gpucr run`, stopped, gone when idle ----

def test_gpucr_run_starts_a_detached_server_that_serves_it(tmp_path):
    """`gpucr run` starts the server when none runs: detached (not the app's child), logging to a 0600
    file in the runtime dir; it serves the app's checkpoints; `gpucr serve --stop` stops it."""
    argv = [sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--", sys.executable, "-m",
            "gpucr.workloads.driver_app", "--sizes", "16M"]
    app = Workload("driver_app", argv=argv, agent=False, simulate=True)
    try:
        sock = paths.runtime_dir() / wire.socket_name(True)
        wait_for(lambda: client.info(True) is not None, what="the server gpucr run started")
        info = client.info(True)
        ppid = int(next(l for l in Path(f"/proc/{info['pid']}/status").read_text().splitlines()
                        if l.startswith("PPid:")).split()[1])
        assert ppid != app.pid, "the server must not be the app's child"
        assert os.getsid(info["pid"]) != os.getsid(app.pid), "the server runs in a session of its own"
        log = Path(info["log"])
        assert stat.S_IMODE(os.lstat(log).st_mode) == 0o600 and "serving uid" in log.read_text()
        assert info["idle_exit_s"] == client.AUTO_IDLE_EXIT_S
        before = app.ask("digest")
        r = gpucr_cli("checkpoint", "--json", str(app.pid))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["processes"][0]["data_plane"] == "server", r.stdout
        assert gpucr_cli("restore", str(app.pid)).returncode == 0
        assert client.info(True)["requests"] >= 2
        assert app.ask("digest") == before
        r = gpucr_cli("serve", "--simulate", "--stop")
        assert r.returncode == 0 and f"(pid {info['pid']}) stopped" in r.stdout
        assert not sock.exists() and "stopped" in log.read_text()
        assert gpucr_cli("serve", "--simulate", "--status").returncode == 3
    finally:
        app.close()
        gpucr_cli("serve", "--simulate", "--stop")


def test_gpucr_run_no_server_starts_none(tmp_path):
    """--no-server: no server."""
    argv = [sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--no-server", "--", sys.executable, "-m",
            "gpucr.workloads.driver_app", "--sizes", "4M"]
    app = Workload("driver_app", argv=argv, agent=False, simulate=True)
    try:
        time.sleep(1.0)
        assert client.info(True) is None
        assert not (paths.runtime_dir() / wire.socket_name(True)).exists()
    finally:
        app.close()


def test_a_server_that_cannot_start_leaves_a_note_and_the_app_runs(sim_app, tmp_path):
    """The server's log cannot be opened (a directory is in its place): `gpucr run` says so in one note
    and runs the app, whose checkpoints run in-process."""
    (paths.runtime_dir() / wire.log_name(True)).mkdir()
    argv = [sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--", sys.executable, "-m",
            "gpucr.workloads.driver_app", "--sizes", "4M"]
    err = tmp_path / "err"
    with err.open("w") as f:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True)
        try:
            assert json.loads(p.stdout.readline())["ready"]
            notes = [l for l in err.read_text().splitlines() if l.startswith("gpucr: note:")]
            assert len(notes) == 1 and "cannot start the gpucr server" in notes[0], err.read_text()
            assert gpucr_cli("checkpoint", str(p.pid)).returncode == 0
            assert gpucr_cli("restore", str(p.pid)).returncode == 0
        finally:
            p.kill()
            p.wait()


def test_an_idle_server_exits_only_when_no_process_is_under_gpucr(sim_app):
    app = sim_app("--sizes", "4M")
    s = RunningServer(True, "--idle-exit", "1")
    try:
        time.sleep(3)
        assert s.proc.poll() is None, "it must stay while a process runs under gpucr"
        app.proc.kill()
        app.proc.wait()
        assert s.proc.wait(timeout=30) == 0
        assert not s.socket.exists()
    finally:
        s.stop()


def test_the_systemd_unit_runs_gpucr_serve():
    """The shipped user unit starts and stops the server with commands gpucr's own parser accepts."""
    from gpucr import cli
    unit = (Path(__file__).resolve().parent.parent / "scripts" / "systemd" / "gpucr.service").read_text()
    lines = dict(l.split("=", 1) for l in unit.splitlines() if "=" in l and not l.startswith("#"))
    for key, want in (("ExecStart", ["serve"]), ("ExecStop", ["serve", "--stop"])):
        argv = lines[key].split()
        assert argv[:2] == ["/usr/bin/env", "gpucr"] and argv[2:] == want, lines[key]
        assert cli._parser().parse_args(argv[2:]).fn is cli.cmd_serve
    assert lines["Type"] == "simple" and lines["WantedBy"] == "default.target"


def test_bench_measures_the_cli_through_the_server_and_in_process(tmp_path):
    """`gpucr bench` methods gpucr-cli (a fresh CLI, --no-server) and gpucr-cli-server (a fresh CLI through a
    server the bench starts): both move every byte and are correct, and the bench stops its server."""
    out = tmp_path / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.05", "--methods", "gpucr-cli,gpucr-cli-server",
                  "--repeat", "2", "--out", str(out), "--chart", str(tmp_path / "r.png"), timeout=300)
    assert r.returncode == 0, r.stderr
    methods = json.loads(out.read_text())["workloads"]["raw:0.05"]["methods"]
    for name in ("gpucr-cli", "gpucr-cli-server"):
        m = methods[name]
        assert m["error"] is None and m["correct"] is True and len(m["samples"]) == 2, (name, m)
        assert m["median"]["bytes_out"] == m["median"]["bytes_in"] > 0
    assert client.info(True) is None, "the bench must stop the server it started"
    assert "gpucr-cli-server" in r.stdout


def test_a_server_that_dies_at_start_is_named_in_one_note(tmp_path):
    """`gpucr run` waits for the server it started; one that dies first (here its driver library has no
    cuInit) is named in one note with its log's last line, and the command runs all the same."""
    if not shutil.which("gcc"):
        pytest.skip("needs gcc to build a library that is not a driver")
    (tmp_path / "nocuda.c").write_text("int nothing_here(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "nocuda.c")], check=True)
    env = {k: v for k, v in os.environ.items() if k != "GPUCR_SIMULATE"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    r = gpucr_cli("run", "--", "true", env=env)
    assert r.returncode == 0, r.stderr
    notes = [l for l in r.stderr.splitlines() if l.startswith("gpucr: note:")]
    assert len(notes) == 1 and "cannot start the gpucr server (it exited: gpucr: error:" in notes[0], r.stderr
    assert "no cuInit" in notes[0]
    assert client.info(False) is None


def test_the_server_leaks_nothing_across_cycles(server, sim_app):
    """A long-lived server: 20 cycles through it leave its open files, threads and memory where they were."""
    app = sim_app("--sizes", "16M,2M")
    before = app.ask("digest")

    def resources() -> tuple[int, int, int]:
        time.sleep(0.3)   # the last connection's thread ends just after its answer
        status = Path(f"/proc/{server.pid}/status").read_text().splitlines()
        field = lambda k: int(next(l for l in status if l.startswith(k)).split()[1])
        return len(os.listdir(f"/proc/{server.pid}/fd")), field("Threads:"), field("VmRSS:")
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    fds0, threads0, rss0 = resources()
    for _ in range(20):
        gpucr.checkpoint(app.pid)
        gpucr.status(app.pid)
        gpucr.restore(app.pid)
    # the pin-ahead loop looks at each process every second (a connection and the layout's fds while it
    # does): a leak stays, what it holds for a moment does not, so look again before calling it one
    for _ in range(5):
        fds1, threads1, rss1 = resources()
        if (fds1, threads1) == (fds0, threads0):
            break
    assert (fds1, threads1) == (fds0, threads0)
    assert rss1 - rss0 < 8 << 10, f"the server grew by {(rss1 - rss0) >> 10} MiB over 20 cycles"
    assert app.ask("digest") == before and server.requests() >= 62


def test_stream_ordered_pools_through_the_server(server, sim_workload):
    """Pool memory the agent serves goes through the server's data plane too. Freed blocks are given back
    at the handover (the pools are trimmed), so the memory is listed again after it: the server copies
    each allocation from its own fd, never another's (found on the H200 as a failed cuMemMap)."""
    app = sim_workload("pool_app")
    app.ask("churn 30")   # freed blocks: trimmed away at the handover
    before = app.ask("digest")
    for _ in range(3):
        ck = gpucr.checkpoint(app.pid)
        assert "handover" in ck.phases_s, ck.phases_s
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
        app.ask("churn 10")
        before = app.ask("digest")


def staged_without_the_server(app) -> None:
    """A cycle of `app` by the CLI's own mover: its agent then holds staging (kept for the next cycle), which the
    server did not take and pins ahead."""
    for verb in ("checkpoint", "restore"):
        r = gpucr_cli(verb, "--no-server", str(app.pid))
        assert r.returncode == 0, r.stderr


def test_the_server_pins_staging_kept_from_an_earlier_cycle(server, sim_app):
    """Staging a process kept from a cycle the server did not make: the server maps and pins it while the
    process runs, so its first checkpoint through the server pins nothing (issue 13: the first checkpoint as
    fast as the rest); it says so in its log and in `pinned_staging_bytes`."""
    app = sim_app("--sizes", "32M,8M")
    before = app.ask("digest")
    staged_without_the_server(app)
    wait_for(lambda: server.info()["pinned_staging_bytes"] >= 40 << 20, what="the server to pin the staging ahead")
    ck = gpucr.checkpoint(app.pid)
    assert "handover" in ck.phases_s and "server_pin" not in ck.phases_s, ck.phases_s
    assert "staging" not in ck.phases_s, ck.phases_s   # the kept staging fits: nothing made before the handover
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
    log = server.log.read_text()
    assert "of its checkpoint" in log
    # a line per request, with its outcome and seconds, timestamped to the millisecond
    assert re.search(rf"\.\d{{3}} gpucr serve \[\d+\]: checkpoint of process {app.pid}: done in \d+\.\d{{3}} s", log), log
    assert re.search(rf"restore of process {app.pid}: done in \d+\.\d{{3}} s", log), log


def test_a_first_checkpoint_pins_in_the_server_first(server, sim_app):
    """With no staging yet, the first checkpoint through the server pins the staging then (reported as
    server_pin) and the next one pins nothing: the cost pinning ahead moves out of the checkpoint."""
    app = sim_app("--sizes", "32M")
    first = gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    second = gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert "server_pin" in first.phases_s and "server_pin" not in second.phases_s, (first.phases_s, second.phases_s)


def test_a_new_server_takes_up_what_a_killed_one_held(sim_app):
    """Staging is the process's own files, so a server SIGKILLed between cycles loses nothing: a new server
    pins the same staging ahead again and the next cycle through it is right (issue 13, item 5)."""
    first = RunningServer(True)
    app = sim_app("--sizes", "24M")
    before = app.ask("digest")
    try:
        gpucr.checkpoint(app.pid)
        gpucr.restore(app.pid)
        first.proc.kill()
        first.proc.wait(timeout=30)
        second = RunningServer(True)
        try:
            wait_for(lambda: second.info()["pinned_staging_bytes"] >= 24 << 20, what="the new server to pin ahead")
            ck = gpucr.checkpoint(app.pid)
            assert "handover" in ck.phases_s and "server_pin" not in ck.phases_s, ck.phases_s
            gpucr.restore(app.pid)
            assert app.ask("digest") == before
        finally:
            second.stop()
    finally:
        first.stop()


def test_staging_given_back_is_let_go_by_the_server_too(server, sim_app):
    """`gpucr restore --drop-staging` gives the host memory back: the server unmaps and unpins its view of
    that staging too (a mapping kept there would keep the memory)."""
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    assert server.info()["pinned_staging_bytes"] >= 16 << 20
    gpucr.restore(app.pid, drop_staging=True)
    assert server.info()["pinned_staging_bytes"] == 0
    assert gpucr.status(app.pid).staging_bytes == 0 and app.ask("digest") == before


def test_a_failed_driver_restore_leaves_no_memory_of_the_servers_behind(server, sim_app):
    """The server fills new memory while the driver restores; when the driver's restore fails, the new
    memory's fds are closed (they would keep it on the GPU for ever), the process stays checkpointed, and a
    second restore brings every byte back."""
    app = sim_app("--sizes", "32M", env=dict(os.environ, SIMCUDA_FAIL_RESTORE="1"))
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    parked = gpu_memory(sim_driver()).used
    with pytest.raises(gpucr.GpucrError):
        gpucr.restore(app.pid)
    assert gpucr.status(app.pid).state == "checkpointed"
    used = gpu_memory(sim_driver()).used
    assert used == parked, f"{(used - parked) >> 20} MiB more on the GPU after the failed restore"
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_a_failed_export_in_the_servers_fill_leaves_nothing_behind(sim_app, monkeypatch):
    """The server's fill exports each new allocation as an fd as it is made; when one export fails, those
    already exported are closed (each would keep its memory on the GPU) and the process stays checkpointed,
    nothing of the failed fill left on the GPU; the next restore brings every byte back."""
    app = sim_app("--sizes", "16M,16M,16M")
    before = app.ask("digest")
    running = gpu_memory(sim_driver()).used
    monkeypatch.setenv("SIMCUDA_FAIL_CALL", "cuMemExportToShareableHandle:2")   # the server's, not the app's
    s = RunningServer(True)
    try:
        assert "handover" in gpucr.checkpoint(app.pid).phases_s
        parked = gpu_memory(sim_driver()).used
        with pytest.raises(gpucr.GpucrError, match="exporting GPU memory as an fd failed"):
            gpucr.restore(app.pid)
        # its context is back (the driver's restore ran beside the fill), none of the memory the fill made
        assert gpucr.status(app.pid).state == "checkpointed"
        assert gpu_memory(sim_driver()).used == parked + SIM_CONTEXT_BYTES
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
        used = gpu_memory(sim_driver()).used - SIM_CONTEXT_BYTES   # the server's context set apart
        assert used == running, f"{(used - running) >> 20} MiB more on the GPU than before the cycle"
    finally:
        s.stop()


# ---- one server, cycle after cycle (issue 24, item 1) ----

def _cycle_through(server: RunningServer, app: Workload, **restore: object) -> None:
    """A checkpoint and a restore of `app`, both served by `server`, its data intact."""
    before, n = app.ask("digest"), server.requests()
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid, **restore)
    assert server.requests() == n + 2 and app.ask("digest") == before


@pytest.mark.parametrize("way", ["two apps one after the other", "an image cycle first", "a refused image first",
                                 "a restore that drops the staging first"])
def test_one_server_serves_cycle_after_cycle(server, sim_app, tmp_path, way):
    """The ways that broke a long-lived server on simcuda after one cycle (a failed unpin ignored, its address
    mapped again and pinned over the registration never undone: CUDA error 712), each followed by a plain
    cycle of the same size through the same server."""
    app = sim_app("--sizes", "12M")
    if way == "two apps one after the other":
        _cycle_through(server, app)
        app.close()
        app = sim_app("--sizes", "12M")
    elif way == "an image cycle first":
        _cycle_through(server, app)
        gpucr.checkpoint(app.pid, image=tmp_path / "img")
        gpucr.restore(app.pid, image=tmp_path / "img")
    elif way == "a refused image first":
        _cycle_through(server, app)   # its staging pinned in the server, then let go by the refused image
        (tmp_path / "file").write_text("not a directory")
        one_line_error(gpucr_cli("checkpoint", "--image", str(tmp_path / "file"), str(app.pid)), "not a directory")
    else:
        _cycle_through(server, app, drop_staging=True)
    _cycle_through(server, app)
    _cycle_through(server, app)
    assert not [h for h in server.info()["staging"] if h["stuck"]]


# A process that answers as a running agent with staging ahead would, but answers its 'layout' with a JSON
# list (F22, issue 24): it listens on its own agent socket name, so every SO_PEERCRED check passes.
NON_OBJECT_AGENT = r'''
import json, os, socket, sys, threading
ino = os.stat("/proc/self/ns/pid").st_ino
path = os.path.join(sys.argv[1], f"{os.getpid()}-{ino}.sock")
hello = {"ok": True, "agent": "gpucr", "protocol": int(sys.argv[2]), "pid": os.getpid(), "uid": os.getuid(),
         "cuda": True, "simulated": True, "libcuda": "", "group": ""}
status = {"ok": True, "pid": os.getpid(), "cuda": True, "simulated": True, "state": "running", "group": "",
          "staged": False, "busy": False, "generation": 0, "allocations": {}, "devices": [{"uuid": "GPU-x"}],
          "shared": [], "staging_segments": 1}
def serve(conn):
    with conn:
        for line in conn.makefile("rb"):
            verb = line.split()[0].decode() if line.split() else ""
            conn.sendall(json.dumps({"hello": hello, "status": status}.get(verb, [1, 2, 3])).encode() + b"\n")
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(8)
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
'''


def test_an_answer_that_is_not_an_object_ends_nothing_but_its_own_pin_ahead(server, sim_app):
    """F22: a process answering 'layout' with a JSON list is refused in the server's log, named; the pin-ahead
    loop goes on, and a process started after it still gets its staging pinned ahead."""
    from gpucr.agent import PROTOCOL
    bad = subprocess.Popen([sys.executable, "-c", NON_OBJECT_AGENT, str(paths.runtime_dir()), str(PROTOCOL)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert bad.stdout.readline().strip() == "ready"
        wait_for(lambda: f"pinning ahead for process {bad.pid} failed" in server.log.read_text(), 10,
                 "the bad answer to be refused")
        app = sim_app("--sizes", "16M")
        staged_without_the_server(app)
        wait_for(lambda: any(h["pid"] == app.pid and h["pinned_bytes"] >= 16 << 20 for h in server.info()["staging"]),
                 10, "the well-behaved process's staging to be pinned ahead")
        assert server.log.read_text().count(f"pinning ahead for process {bad.pid} failed") == 1
    finally:
        bad.kill()
        bad.wait()
