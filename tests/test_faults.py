"""Faults and refusals on simcuda: a checkpoint completes or the application runs on untouched; a
restore completes or the process stays checkpointed and restorable; nothing is left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gpucr
from gpucr import memory as server_memory, paths
from gpucr.agent import AgentClient
from gpucr.workloads.runner import Workload
from gpucr.target import agent_socket_name
from gpucr.driver import ProcessState

from conftest import (check_fork_child_apart, cycle_concurrently, gpucr_cli, process_resources, server_gpu_bytes,
                      sim_driver)

# every test here goes through one gpucr server reused by the module, as a user's requests do
pytestmark = pytest.mark.usefixtures("reused_server")

MiB = 1 << 20


# ---- pre-flight coverage ----

def test_managed_memory_is_refused_before_touching(sim_app):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    app.ask(f"managed {4 * MiB}")
    r = gpucr_cli("checkpoint", str(app.pid))
    assert r.returncode != 0 and "managed memory" in r.stderr and "cudaMalloc" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert gpucr.status(app.pid).state == "running"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    assert app.ask("digest") == before
    app.ask("free-managed")       # once it is gone, the checkpoint proceeds
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_legacy_ipc(sim_app):
    app = sim_app("--sizes", "16M,1000")
    # memory the agent made checkpointable cannot be exported with legacy IPC: the call fails clearly
    assert app.ask("ipc 0")["rc"] == 801
    # a small (native) allocation can be, and then the process cannot be checkpointed
    assert app.ask("ipc 1")["rc"] == 0
    with pytest.raises(gpucr.GpucrError, match="legacy CUDA IPC"):
        gpucr.checkpoint(app.pid)
    assert gpucr.status(app.pid).state == "running"


def test_multicast_objects_are_refused_before_touching(sim_app):
    """NCCL's NVLS binds memory of several GPUs into a multicast object: no checkpoint covers it."""
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    assert app.ask("multicast")["rc"] == 0
    r = gpucr_cli("checkpoint", str(app.pid))
    assert r.returncode != 0 and "multicast" in r.stderr and "NCCL_NVLS_ENABLE=0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


def test_fabric_handles_are_refused_before_touching(sim_app):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    assert app.ask("share-fabric 2")["rc"] == 0
    with pytest.raises(gpucr.GpucrError, match="fabric handles"):
        gpucr.checkpoint(app.pid)
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


def test_hugepages_asked_for_but_missing_refused_before_touching(sim_app):
    if int(Path("/proc/sys/vm/nr_hugepages").read_text()) > 0:
        pytest.skip("needs a host with no hugepages reserved (nr_hugepages is not 0 here)")
    app = sim_app("--sizes", "16M", env=dict(os.environ, GPUCR_STAGING="hugetlbfs"))
    before = app.ask("digest")
    with pytest.raises(gpucr.GpucrError, match="hugepages"):
        gpucr.checkpoint(app.pid)
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


# ---- driver calls that fail during a cycle (simcuda's SIMCUDA_FAIL_CALL) ----

def test_a_driver_call_failing_during_a_cycle_is_logged_by_name(sim_app, capfd):
    """cuMemRelease fails as a checkpoint gives memory back: nobody is told through a return value,
    so the agent logs it, naming the call and the error; the cycle completes, the data intact."""
    app = sim_app("--sizes", "16M", env=dict(os.environ, SIMCUDA_FAIL_CALL="cuMemRelease"))
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
    logged = [l for l in capfd.readouterr().err.splitlines() if f"gpucr[{app.pid}]" in l and "cuMemRelease" in l]
    assert logged and "failed: CUDA_ERROR_UNKNOWN (unknown error)" in logged[0], logged


@pytest.mark.in_process   # the coordinator runs here, so that its adopt batches can be made one allocation each
def test_an_adopt_that_fails_part_way_leaves_the_process_parked_whole(sim_app, monkeypatch):
    """The agent maps the first of the plane's new allocations, then its driver refuses to map the second (the app's
    4th cuMemMap: 2 when its allocations were made, 1 per adopted allocation): what it
    adopted is given back (unadopt: unmapped, released, its fd closed), so the process stays checkpointed whole, not
    half mapped, and the next restore brings every byte back."""
    from gpucr.coordinator import through_plane
    monkeypatch.setattr(through_plane, "ADOPT_BATCH", 1)
    app = sim_app("--sizes", "8M,4M", env=dict(os.environ, SIMCUDA_FAIL_CALL="cuMemMap:4"))
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    with pytest.raises(gpucr.GpucrError) as failed:
        gpucr.restore(app.pid)
    assert "mapping the server's memory" in str(failed.value), failed.value
    st = gpucr.status(app.pid)
    assert st.state == "checkpointed", st
    with AgentClient(paths.runtime_dir() / agent_socket_name(app.pid), app.pid) as agent:
        listed = [e for e in server_memory.gather(agent, 10.0) if e.bytes >= 4 << 20]
    server_memory.close_all(listed)
    assert [e.released for e in listed] == [True, True], f"nothing adopted is left mapped: {listed}"
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


@pytest.mark.in_process   # the mover runs in this process (no server): its cuMemCreate is the one that fails
def test_a_driver_call_failing_in_a_restore_is_reported_by_name(sim_app, monkeypatch):
    """The data plane's cuMemCreate fails while it makes the process's memory again: the error names the call,
    the process stays checkpointed with its data in staging, and the next restore completes."""
    from gpucr.driver import DriverError
    from gpucr.vmm import Vmm
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    real = Vmm.create
    fails = [DriverError("cuMemCreate", 999, "CUDA_ERROR_UNKNOWN (unknown error)")]
    monkeypatch.setattr(Vmm, "create", lambda self, *a, **k: (_ for _ in ()).throw(fails.pop()) if fails
                        else real(self, *a, **k))
    with pytest.raises(gpucr.GpucrError) as failed:
        gpucr.restore(app.pid)
    assert "cuMemCreate failed: CUDA_ERROR_UNKNOWN" in str(failed.value), failed.value
    assert gpucr.status(app.pid).state == "checkpointed" and sim_driver().state(app.pid) == ProcessState.RUNNING
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


# ---- a controller killed at every phase ----

@pytest.mark.in_process   # the in-process controller is the one killed: the CLI, its own mover copying (no server)
@pytest.mark.parametrize("point,after", [
    ("after-handover", "running"),            # the agent's lease maps its memory again from its fds
    ("during-server-copy", "running"),        # ... with the CLI's copy under way: nothing left the GPU
    ("after-driver-lock", "restorable"),      # the driver holds it: a new controller finishes the job
    ("after-driver-checkpoint", "restorable"),
    ("after-data-out", "restorable"),         # copied, not committed: a restore takes it back from the agent's fds
])
def test_controller_killed_during_checkpoint(sim_app, point, after):
    app = sim_app("--sizes", "32M,4M", "--vmm-mib", "8")
    before = app.ask("digest")
    r = gpucr_cli("checkpoint", str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    assert r.returncode == -signal.SIGKILL
    if after == "running":
        deadline = time.time() + 30
        while (gpucr.status(app.pid).state != "running" or gpucr.status(app.pid).busy) and time.time() < deadline:
            time.sleep(0.05)
    else:
        assert sim_driver().state(app.pid) != ProcessState.RUNNING
        assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert gpucr.status(app.pid).state == "running"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    assert app.ask("digest") == before
    assert gpucr.checkpoint(app.pid).data_plane == "cli"   # and it can be checkpointed again, by the CLI's mover
    assert gpucr.restore(app.pid).data_plane == "cli"
    assert app.ask("digest") == before


@pytest.mark.in_process   # the in-process controller is the one killed
@pytest.mark.parametrize("point", ["after-driver-restore", "after-driver-unlock"])
def test_controller_killed_during_restore(sim_app, point):
    app = sim_app("--sizes", "32M,4M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    r = gpucr_cli("restore", str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    assert r.returncode == -signal.SIGKILL
    assert gpucr.status(app.pid).state == "checkpointed"
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("digest") == before


@pytest.mark.in_process   # the in-process controller is the one killed (a gone client does not yet end the server's work: F20)
def test_controller_killed_mid_data_out(sim_app):
    app = sim_app("--sizes", "1500M")
    before = app.ask("digest")
    p = subprocess.Popen([sys.executable, "-m", "gpucr.cli", "checkpoint", str(app.pid)])
    time.sleep(0.15)
    p.kill()
    p.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        st = gpucr.status(app.pid)
        if st.state == "running" and not st.busy:
            break
        time.sleep(0.05)
    assert gpucr.status(app.pid).state == "running"
    assert app.ask("digest") == before


# ---- two controllers at once ----

def test_two_controllers_at_once_one_is_told_busy(sim_app):
    app = sim_app("--sizes", "1200M")
    before = app.ask("digest")
    errors, done = [], []

    def go() -> None:
        try:
            done.append(gpucr.checkpoint(app.pid, level="data"))
        except gpucr.GpucrError as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 1 and len(errors) == 1, (done, errors)
    assert "busy" in errors[0] or "already checkpointed" in errors[0]
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


# ---- the application goes away ----

@pytest.mark.in_process   # the runtime dir must end empty: no server socket in it
def test_app_killed_while_checkpointed_leaves_nothing_behind(sim_app, tmp_path):
    sdir = tmp_path / "staging"
    sdir.mkdir()
    app = sim_app("--sizes", "32M", env=dict(os.environ, GPUCR_STAGING=f"file:{sdir}"))
    app.ask("join ok 1")
    gpucr.checkpoint(app.pid)
    rdir = paths.runtime_dir()
    assert (rdir / agent_socket_name(app.pid)).exists() and (rdir / f"{app.pid}.app.sock").exists()
    app.proc.kill()
    app.proc.wait()
    assert gpucr.ps().processes == []          # stale sockets are cleaned by the first listing
    assert list(rdir.iterdir()) == []
    assert list(sdir.iterdir()) == []
    # the simulated device counts no memory for the dead process (its record is reaped on reading)
    from gpucr.driver import gpu_memory
    gpu_memory(sim_driver())
    simdir = Path(os.environ["SIMCUDA_DIR"])
    assert not (simdir / f"{app.pid}.mem").exists()


def test_fork_child_that_never_uses_cuda_costs_nothing(sim_app):
    check_fork_child_apart(sim_app("--sizes", "16M"))


# A launcher under the agent that never uses CUDA forks a worker; the worker waits for "go" on stdin
# (until then it has not touched CUDA), then becomes driver_app, answering on the same stdin/stdout.
FORK_THEN_CUDA = """
import json, os, sys
pid = os.fork()
if pid:
    print(json.dumps({"ready": True, "child": pid}), flush=True)
    os.waitpid(pid, 0)
else:
    sys.stdin.readline()
    sys.argv = ["driver_app", "--sizes", "16M,1M"]
    from gpucr.workloads import driver_app
    driver_app.main()
"""


def test_fork_child_gets_its_channel_at_its_first_cuda_call():
    w = Workload("", argv=[sys.executable, "-c", FORK_THEN_CUDA], simulate=True)
    child = w.info["child"]
    sock = paths.runtime_dir() / agent_socket_name(child)
    try:
        time.sleep(1.0)
        assert not sock.exists() and len(os.listdir(f"/proc/{child}/task")) == 1, "nothing before CUDA is used"
        w.proc.stdin.write("go\n")
        w.proc.stdin.flush()
        assert w._read(60)["pid"] == child
        assert sock.exists(), "the channel appeared with the first CUDA call"
        before = w.ask("digest")
        assert gpucr.status(child).allocations.converted == 1
        gpucr.checkpoint(child)
        gpucr.restore(child)
        assert w.ask("digest") == before
        # in a checkpoint of the tree, the launcher (it never used CUDA) is left out, the worker taken
        r = gpucr_cli("checkpoint", "--tree", str(w.pid), "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert [x["pid"] for x in out["processes"]] == [child]
        assert f"process {w.pid} " in r.stderr and "left out: it has not loaded the CUDA driver" in r.stderr, r.stderr
        assert gpucr_cli("restore", "--tree", str(w.pid)).returncode == 0
        assert w.ask("digest") == before
    finally:
        for pid in (child, w.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        w.proc.wait()


# ---- load ----

def _device_bytes(drv, pid: int) -> tuple[int, int, int]:
    """(the whole device's memory in use, process `pid`'s own count, the module's long-lived server's)."""
    from gpucr.driver import gpu_memory, process_gpu_memory
    return gpu_memory(drv).used, process_gpu_memory(drv, pid), server_gpu_bytes()


def test_fifty_cycles_leak_nothing(sim_app):
    app = sim_app("--sizes", "16M,4M,100K", "--vmm-mib", "8")
    before = app.ask("digest")
    for i in range(10):             # staging prepared, thread stacks cached: the steady state
        gpucr.checkpoint(app.pid, level="full" if i % 2 else "data")
        gpucr.restore(app.pid)
    drv = sim_driver()
    used0, own0, server0 = _device_bytes(drv, app.pid)
    fds0, maps0, rss0 = process_resources(app.pid)
    for i in range(50):
        gpucr.checkpoint(app.pid, level="full" if i % 2 else "data")
        gpucr.restore(app.pid)
    fds1, maps1, rss1 = process_resources(app.pid)
    assert app.ask("digest") == before
    assert fds1 == fds0, "file descriptors leaked"
    assert maps1 <= maps0 + 4, "mappings leaked (a few may come and go with helper threads' stacks)"
    assert rss1 - rss0 < 8 * MiB, "host memory grew by more than 8 MiB"
    used1, own1, server1 = _device_bytes(drv, app.pid)
    assert (own1, server1) == (own0, server0), "device memory leaked in the process or in the server"
    # the whole device may meanwhile get back what an earlier test of the module left (66 MiB in one run, not
    # the server's nor this process's): only growth is a leak there
    assert used1 <= used0, "device memory leaked"


def test_eight_processes_cycled_concurrently(sim_app):
    apps = [sim_app("--sizes", "24M,2M", "--seed", str(i)) for i in range(8)]
    befores = [a.ask("digest") for a in apps]
    assert cycle_concurrently([a.pid for a in apps], 5) == []
    assert [a.ask("digest") for a in apps] == befores


@pytest.mark.in_process   # the coordinator runs here, with the CLI's own mover
def test_controller_killed_before_the_gate_reopens(sim_app, monkeypatch):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    from gpucr.coordinator import restore_many
    from gpucr.coordinator import restoring as co   # whose resume step asks _agent_restored
    from gpucr.dataplane.cli_plane import cli_plane
    # data back in, gate still closed: as if the controller died just before its last step
    with monkeypatch.context() as mp, cli_plane() as mover:
        mp.setattr(co, "_agent_restored", lambda m: False)
        restore_many([app.pid], mover)
    st = gpucr.status(app.pid)
    assert st.state == "running" and st.gate_closed
    r = gpucr_cli("restore", str(app.pid))
    assert r.returncode == 0, r.stderr   # finishes the job
    assert not gpucr.status(app.pid).gate_closed
    assert app.ask("digest") == before
