"""Jobs as users start them, on simcuda: a shell-wrapped app with a fork child that never touches
CUDA, checkpointed by group; a launcher with workers, checkpointed by its tree; and `gpucr recover`
for processes left locked, checkpointed or parked with no controller."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import gpucr
from gpucr.driver import ProcessState
from gpucr.workloads.runner import Workload, plain_env

from conftest import gpucr_cli, sim_driver

APP = [sys.executable, "-m", "gpucr.workloads.driver_app"]


def _wait_for_socket_of(pid: int, timeout: float = 20.0, min_bytes: int = 0) -> None:
    """Until the process answers under gpucr (and tracks min_bytes: its channel opens at its first CUDA
    call, before its context and memory exist)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if gpucr.status(pid).allocations.tracked_bytes >= min_bytes:
                return
        except gpucr.GpucrError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never came up under gpucr with {min_bytes} bytes tracked")


def _child_pid(pid: int) -> int:
    from gpucr.jobs import children_of
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        kids = children_of(pid)
        if kids:
            return kids[0]
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no child")


@pytest.fixture
def wrapped():
    """`bash -c 'APP; true'` under gpucr in group 'job', the app with a fork child that made one CUDA
    call (which fails there: the driver is its parent's) and sleeps."""
    env = dict(os.environ, GPUCR_GROUP="job")
    w = Workload("", argv=["bash", "-c", " ".join(APP) + " --sizes 8M,4M; true"], simulate=True, env=env)
    app = _child_pid(w.pid)
    fork = w.ask("fork 120 cuda")["child"]
    _wait_for_socket_of(fork)   # its channel started with that call
    yield w, app, fork
    subprocess.run(["pkill", "-KILL", "-P", str(w.pid)], check=False)
    for p in (fork, app):
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    w.proc.kill()
    w.proc.wait()


def test_group_takes_the_processes_holding_gpu_state_and_lists_the_others(wrapped):
    """The group of a shell-wrapped app: the shell (no CUDA), the app's fork child (the driver knows
    no CUDA of its own) and a launcher that only initialised the driver (as torchrun does: the driver
    knows it, but it holds no context) are left out and listed; the app alone is checkpointed."""
    w, app, fork = wrapped
    from gpucr import paths
    launcher = subprocess.Popen([sys.executable, "-c", "import ctypes, sys; cu = ctypes.CDLL('libcuda.so.1');"
                                 "assert cu.cuInit(0) == 0; print('ready', flush=True); sys.stdin.read()"],
                                env=paths.run_env(simulate=True, base=dict(os.environ, GPUCR_GROUP="job")),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "ready"
    _wait_for_socket_of(launcher.pid)
    assert sim_driver().state(launcher.pid) == ProcessState.RUNNING, "the driver knows it"
    before = w.ask("digest")
    r = gpucr_cli("checkpoint", "--group", "job", "--json")
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout)
    assert [x["pid"] for x in out["processes"]] == [app]
    assert {x["pid"] for x in out["left_out"]} == {w.pid, fork, launcher.pid}, "the JSON lists what was left out"
    notes = [l for l in r.stderr.splitlines() if "left out" in l]
    assert any(f"process {w.pid} " in l and "not loaded the CUDA driver" in l for l in notes), r.stderr
    assert any(f"process {fork} " in l and "no CUDA context" in l for l in notes), r.stderr
    assert any(f"process {launcher.pid} " in l and "holds no CUDA context" in l for l in notes), r.stderr
    launcher.kill()
    launcher.wait()
    assert sim_driver().state(app) == ProcessState.CHECKPOINTED
    assert gpucr.status(fork).state == "running", "the fork child is left alone"
    r = gpucr_cli("restore", "--group", "job")
    assert r.returncode == 0, r.stderr
    assert w.ask("digest") == before


def test_tree_of_a_launcher_checkpoints_its_workers(tmp_path):
    """A launcher (itself not under gpucr, as torchrun would be run) starts two workers under gpucr;
    `--tree LAUNCHER` checkpoints and restores both and leaves the launcher alone, listed."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import os, subprocess, sys\n"
        "env = dict(os.environ, LD_PRELOAD=os.environ['WORKER_PRELOAD'])\n"
        f"ws = [subprocess.Popen({APP!r} + ['--sizes', s], env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)"
        " for s in ('8M', '6M')]\n"
        "print('started', flush=True)\n"
        "sys.stdin.read()\n")
    env = plain_env(simulate=True)
    from gpucr import paths
    env["WORKER_PRELOAD"] = str(paths.agent_lib())
    proc = subprocess.Popen([sys.executable, str(launcher)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    from gpucr.jobs import children_of
    try:
        assert proc.stdout.readline().strip() == "started"
        workers = children_of(proc.pid)
        assert len(workers) == 2
        for p in workers:
            _wait_for_socket_of(p, min_bytes=6 << 20)
        r = gpucr_cli("checkpoint", "--tree", str(proc.pid))
        assert r.returncode == 0, r.stderr
        assert f"process {proc.pid} " in r.stderr and "not running under gpucr" in r.stderr
        assert all(sim_driver().state(p) == ProcessState.CHECKPOINTED for p in workers)
        r = gpucr_cli("restore", "--tree", str(proc.pid))
        assert r.returncode == 0, r.stderr
        assert all(gpucr.status(p).state == "running" for p in workers)
    finally:
        for p in children_of(proc.pid):
            os.kill(p, 9)
        proc.kill()
        proc.wait()


@pytest.mark.serial   # `gpucr recover` with no pid acts on every process of the machine (root)
def test_recover_brings_back_what_a_killed_controller_left(sim_app):
    a = sim_app("--sizes", "8M")
    b = sim_app("--sizes", "4M")
    before = [a.ask("digest"), b.ask("digest")]
    env = dict(os.environ, GPUCR_TEST_KILL_AT="after-driver-lock")
    assert gpucr_cli("checkpoint", str(a.pid), env=env).returncode != 0      # killed with a locked
    env["GPUCR_TEST_KILL_AT"] = "after-driver-checkpoint"
    assert gpucr_cli("checkpoint", str(b.pid), env=env).returncode != 0      # and a checkpointed process
    assert sim_driver().state(a.pid) == ProcessState.LOCKED
    assert sim_driver().state(b.pid) == ProcessState.CHECKPOINTED

    listed = gpucr_cli("recover", "--list")
    assert listed.returncode == 0
    assert f"process {a.pid} " in listed.stdout and "driver locked" in listed.stdout
    assert f"process {b.pid} " in listed.stdout and "driver checkpointed" in listed.stdout
    r = gpucr_cli("recover")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("running") >= 2
    assert [a.ask("digest"), b.ask("digest")] == before
    assert gpucr_cli("recover", "--list").stdout.startswith("no stuck process")


@pytest.mark.serial   # `gpucr recover` with no pid acts on every process of the machine (root)
def test_recover_unlocks_a_process_gpucr_never_saw():
    """The driver can hold a process that runs without gpucr (another tool locked it and died)."""
    w = Workload("driver_app", "--sizes", "4M", simulate=True, agent=False)
    try:
        before = w.ask("digest")
        drv = sim_driver()
        drv.lock(w.pid, 5000)
        drv.checkpoint(w.pid)
        r = gpucr_cli("recover")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"process {w.pid} " in r.stdout and "restored and unlocked" in r.stdout
        assert drv.state(w.pid) == ProcessState.RUNNING
        assert w.ask("digest") == before
    finally:
        w.close()
