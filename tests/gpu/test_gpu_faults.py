"""Faults and load on the real driver (issue 6): each a test that needs the H200."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

import gpucr
from gpucr import paths
from gpucr import target as targets
from gpucr import checkpoint_many, restore_many   # through the server when one runs, else the CLI's own mover
from gpucr.driver import ProcessState, driver_for, gpu_memory
from gpucr.workloads.runner import Workload

from conftest import bring_back_on_the_gpu, gpucr_cli, check_fork_child_apart, cycle_concurrently, gpu, process_resources

pytestmark = [gpu, pytest.mark.gpu]
MiB = 1 << 20


def used() -> int:
    return gpu_memory(driver_for("libcuda.so.1")).used


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return gpucr_cli(*args, env=env, timeout=180)


@pytest.mark.parametrize("point", ["after-data-out", "after-driver-lock", "after-driver-checkpoint",
                                   "after-driver-restore", "after-driver-unlock"])
def test_controller_killed_at_each_phase(point):
    with Workload("torch_app", "--gib", "2") as app:
        before = app.ask("digest")
        env = dict(os.environ, GPUCR_TEST_KILL_AT=point)
        if point.startswith("after-driver-re") or point == "after-driver-unlock":
            gpucr.checkpoint(app.pid, timeout=60)
            r = cli("restore", str(app.pid), env=env)
        else:
            r = cli("checkpoint", str(app.pid), env=env)
        if os.environ.get("GPUCR_TEST_VIA_SERVER") == "1":
            # through a server (scripts/gpu-check VIA_SERVER=1) the phases run in it: it is the one killed,
            # and the client says so in one line (test_gpu_server.py has the server's own phases too)
            assert r.returncode == 1 and "gpucr server" in r.stderr and "died" in r.stderr, r.stderr
        else:
            assert r.returncode == -signal.SIGKILL
        # after data out only (the driver never took it), the agent rolls back on its own: let it;
        # with the driver holding the process, its roll-back waits for the restore instead
        bring_back_on_the_gpu(app.pid, cli)
        assert app.ask("digest") == before


def test_restore_refused_while_another_process_holds_the_memory():
    with Workload("torch_app", "--gib", "8") as app:
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=60)
        free = gpu_memory(driver_for("libcuda.so.1")).free
        hog_gib = max(1.0, (free - 4 * (1 << 30)) / (1 << 30))   # leave less than the process needs
        with Workload("torch_app", "--gib", f"{hog_gib:.1f}", env={**os.environ, "GPUCR_AGENT_DISABLE": "1"}):
            with pytest.raises(gpucr.GpucrError, match="not enough free GPU memory"):
                gpucr.restore(app.pid, timeout=60)
            assert gpucr.status(app.pid).state == "checkpointed"
        gpucr.restore(app.pid, timeout=60)
        assert app.ask("digest") == before


def test_managed_and_legacy_ipc_refused_before_touching_on_the_real_driver():
    with Workload("driver_app", "--sizes", "64M,1000") as app:
        before = app.ask("digest")
        app.ask(f"managed {4 * MiB}")
        r = cli("checkpoint", str(app.pid))
        assert r.returncode == 1 and "managed memory" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert driver_for("libcuda.so.1").state(app.pid) == ProcessState.RUNNING and app.ask("digest") == before
        app.ask("free-managed")
        assert app.ask("ipc 0")["rc"] != 0, "memory gpucr made checkpointable refuses a legacy IPC export"
        assert app.ask("ipc 1")["rc"] == 0
        r = cli("checkpoint", str(app.pid))
        assert r.returncode == 1 and "legacy CUDA IPC" in r.stderr, r.stderr
        assert driver_for("libcuda.so.1").state(app.pid) == ProcessState.RUNNING and app.ask("digest") == before


def test_two_controllers_at_once_one_is_told_busy():
    with Workload("torch_app", "--gib", "4") as app:
        before = app.ask("digest")
        done, errors = [], []

        def go() -> None:
            try:
                done.append(gpucr.checkpoint(app.pid, timeout=60))
            except gpucr.GpucrError as exc:
                errors.append(str(exc))
        threads = [threading.Thread(target=go) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(done) == 1 and len(errors) == 1, (done, errors)
        assert "busy" in errors[0] or "already checkpointed" in errors[0]
        gpucr.restore(app.pid, timeout=60)
        assert app.ask("digest") == before


def test_app_killed_while_checkpointed_leaves_nothing_behind():
    idle = used()
    app = Workload("torch_app", "--gib", "2")
    gpucr.checkpoint(app.pid, timeout=60)
    rdir = paths.runtime_dir()
    assert (rdir / targets.agent_socket_name(app.pid)).exists()
    app.proc.kill()
    app.proc.wait()
    assert app.pid not in [p.pid for p in gpucr.ps().processes]
    assert not [e for e in rdir.iterdir() if e.name.startswith(f"{app.pid}.")]
    deadline = time.time() + 30
    while used() > idle + 16 * MiB and time.time() < deadline:
        time.sleep(0.2)
    assert used() <= idle + 16 * MiB


def test_fork_child_that_never_uses_cuda_costs_nothing():
    with Workload("driver_app", "--sizes", "64M") as app:
        check_fork_child_apart(app, timeout=60)


def test_fifty_cycles_leak_nothing():
    with Workload("torch_app", "--gib", "2") as app:
        before = app.ask("digest")
        for i in range(5):   # staging prepared, thread stacks cached: the steady state
            gpucr.checkpoint(app.pid, level="full" if i % 2 else "data", timeout=60)
            gpucr.restore(app.pid, timeout=60)
        fds0, maps0, rss0 = process_resources(app.pid)
        dev0 = used()
        for i in range(50):
            gpucr.checkpoint(app.pid, level="full" if i % 2 else "data", timeout=60)
            gpucr.restore(app.pid, timeout=60)
        fds1, maps1, rss1 = process_resources(app.pid)
        assert app.ask("digest") == before
        assert fds1 <= fds0 + 1 and maps1 <= maps0 + 8 and rss1 <= rss0 + 64 * MiB, (fds0, fds1, maps0, maps1, rss0, rss1)
        assert abs(used() - dev0) <= 16 * MiB


def test_eight_processes_cycled_concurrently():
    apps = [Workload("torch_app", "--gib", "1", "--seed", str(i)) for i in range(8)]
    try:
        before = [a.ask("digest") for a in apps]
        assert cycle_concurrently([a.pid for a in apps], 3, timeout=120) == []
        assert [a.ask("digest") for a in apps] == before
    finally:
        for a in apps:
            a.close()


def test_two_processes_sharing_a_buffer():
    """Issue 5 on one GPU: an exporter and an importer of one VMM buffer (POSIX fd), checkpointed together."""
    idle = used()
    with Workload("driver_app", "--sizes", "64M") as exp, Workload("driver_app", "--sizes", "32M") as imp:
        fd = exp.ask("share 256")["fd"]
        imp.ask(f"import pidfd:{exp.pid}:{fd} 256")
        # an open fd of the export keeps its memory in the driver (found on the H200): the exporter
        # closes it once imported, as NCCL does, and gpucr warns about any left open
        exp.ask(f"close-fd {fd}")
        exp.ask("write-shared 7")
        assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
        before = [exp.ask("digest"), imp.ask("digest")]
        checkpoint_many([exp.pid, imp.pid], timeout=60)
        assert used() - idle <= 16 * MiB
        restore_many([exp.pid, imp.pid], timeout=60)
        assert [exp.ask("digest"), imp.ask("digest")] == before
        imp.ask("write-shared 9")
        assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]
