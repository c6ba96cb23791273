"""Jobs on real GPUs: faults across the ranks of a two-rank NCCL job (a rank killed during data out,
one stuck in a collective its peer never joins, one with no room on its GPU at restore), `gpucr
recover` after a controller died mid-checkpoint, and a shell-wrapped app with a fork child
checkpointed by group. Every rank ends running with its data, or all are checkpointed and
restorable; never one left alone in the driver's LOCKED or CHECKPOINTED state."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import gpucr
from gpucr import checkpoint_many, restore_many   # through the server when one runs, else the CLI's own mover
from gpucr.driver import ProcessState, driver_for, gpu_memory
from gpucr.gpus import machine_gpus
from gpucr.workloads.runner import Workload

from conftest import gpu, gpucr_cli, two_gpus

pytestmark = [gpu, pytest.mark.gpu]
ENV = dict(os.environ, NCCL_CUMEM_ENABLE="1", NCCL_NVLS_ENABLE="0", NCCL_GRAPH_REGISTER="0",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def drv():
    return driver_for("libcuda.so.1")


def _ranks(port: int) -> list[Workload]:
    with ThreadPoolExecutor(2) as pool:   # both ranks must start together: init waits for the other
        return list(pool.map(lambda r: Workload("nccl_app", "--rank", str(r), "--port", str(port), env=ENV), range(2)))


def _allreduce_all(ranks: list[Workload], n: int = 3) -> list[dict]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda w: w.ask(f"allreduce {n}", timeout=120), ranks))


@pytest.fixture
def job():
    ranks = _ranks(29600 + os.getpid() % 300)
    try:
        assert all(r["ok"] for r in _allreduce_all(ranks))
        yield ranks
    finally:
        for w in ranks:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()


def _all_running(ranks: list[Workload]) -> bool:
    return all(drv().state(w.pid) == ProcessState.RUNNING and gpucr.status(w.pid).state == "running"
               for w in ranks if w.proc.poll() is None)


@two_gpus
def test_rank_killed_during_data_out_rolls_the_other_back(job, monkeypatch):
    r0, r1 = job
    before = r0.ask("digest", timeout=120)
    monkeypatch.setenv("GPUCR_TEST_KILL_TARGET", f"data-out:{r1.pid}")
    with pytest.raises(gpucr.GpucrError, match=f"process {r1.pid}"):
        checkpoint_many([r0.pid, r1.pid], timeout=60)
    # what rank 0 imported from rank 1 (NCCL's buffers) died with it: zeroed memory takes its place
    r1.proc.wait(timeout=30)
    assert drv().state(r0.pid) == ProcessState.RUNNING and gpucr.status(r0.pid).state == "running"
    assert r0.ask("digest", timeout=120) == before, "the surviving rank runs on with its data"


@two_gpus
def test_rank_stuck_in_a_collective_misses_the_deadline_and_all_roll_back(job):
    r0, r1 = job
    before = [w.ask("digest", timeout=120) for w in job]
    r0.proc.stdin.write("allreduce 1\n")   # rank 0 enters an all-reduce that rank 1 has not joined
    r0.proc.stdin.flush()
    time.sleep(1.0)
    t0 = time.monotonic()
    with pytest.raises(gpucr.GpucrError, match="did not finish within|still in flight after|deadline"):
        checkpoint_many([r0.pid, r1.pid], timeout=3)
    assert time.monotonic() - t0 < 60
    assert _all_running(job), "every rank is rolled back and runs on"
    assert r1.ask("allreduce 1", timeout=120)["ok"]   # now rank 1 joins, and both finish
    assert r0._read(120)["ok"]
    assert [w.ask("digest", timeout=120) for w in job] == before
    assert all(r["ok"] for r in _allreduce_all(job))


@two_gpus
def test_no_room_on_one_gpu_at_restore_leaves_all_restorable(job):
    r0, r1 = job
    before = [w.ask("digest", timeout=120) for w in job]
    checkpoint_many([r0.pid, r1.pid], timeout=60)
    uuid1 = gpucr.status(r1.pid).gpus[0].uuid
    g1 = next(g for g in machine_gpus(drv()) if g.uuid == uuid1)
    free = gpu_memory(drv(), g1.ordinal, uuid1).free
    # another process takes all but 64 MiB of rank 1's GPU
    filler = subprocess.Popen([sys.executable, "-c",
                               "import sys, torch;"
                               "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda');"
                               "print('held', flush=True); sys.stdin.read()", str(free - (64 << 20))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=uuid1))
    try:
        assert filler.stdout.readline().strip() == "held"
        with pytest.raises(gpucr.GpucrError, match="not enough free GPU memory"):
            restore_many([r0.pid, r1.pid], timeout=60)
        assert all(drv().state(w.pid) == ProcessState.CHECKPOINTED for w in job), "all stay checkpointed, restorable"
    finally:
        filler.kill()
        filler.wait()
    restore_many([r0.pid, r1.pid], timeout=60)
    assert [w.ask("digest", timeout=120) for w in job] == before
    assert all(r["ok"] for r in _allreduce_all(job))


@two_gpus
def test_recover_after_the_controller_died_mid_checkpoint(job):
    before = [w.ask("digest", timeout=120) for w in job]
    env = dict(os.environ, GPUCR_TEST_KILL_AT="after-driver-checkpoint")
    r = gpucr_cli("checkpoint", *(str(w.pid) for w in job), "--timeout", "60", env=env, timeout=300)
    assert r.returncode != 0
    listed = gpucr_cli("recover", "--list", "--json")
    stuck = {s["pid"] for s in json.loads(listed.stdout)["processes"]}
    assert stuck >= {w.pid for w in job}, listed.stdout
    r = gpucr_cli("recover", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    states = {w.pid: (drv().state(w.pid).name, gpucr.status(w.pid).state, gpucr.status(w.pid).gate_closed)
              for w in job}
    assert _all_running(job), f"recover said:\n{r.stdout}{r.stderr}\nthen: {states}"
    assert [w.ask("digest", timeout=120) for w in job] == before
    assert all(x["ok"] for x in _allreduce_all(job))


def test_shell_wrapped_app_with_a_fork_child_checkpointed_by_group():
    """`gpucr run --group g -- bash -c 'APP; true'`: the shell and the app's fork child (a CUDA call
    failed there: no CUDA of its own) are left out and listed; the app is checkpointed and restored,
    every byte back."""
    env = dict(os.environ, GPUCR_GROUP="wrapped")
    app_cmd = f"{sys.executable} -m gpucr.workloads.driver_app --sizes 256M,64M"
    w = Workload("", argv=["bash", "-c", f"{app_cmd}; true"], env=env)
    try:
        before = w.ask("digest", timeout=120)
        fork = w.ask("fork 120 cuda", timeout=120)["child"]
        time.sleep(1.0)
        r = gpucr_cli("checkpoint", "--group", "wrapped", "--json", "--timeout", "60", timeout=300)
        assert r.returncode == 0, r.stderr
        pids = [x["pid"] for x in json.loads(r.stdout)["processes"]]
        assert len(pids) == 1 and pids[0] != w.pid
        assert f"process {w.pid} " in r.stderr and f"process {fork} " in r.stderr, r.stderr
        assert drv().state(pids[0]) == ProcessState.CHECKPOINTED
        r = gpucr_cli("restore", "--group", "wrapped", timeout=300)
        assert r.returncode == 0, r.stderr
        assert w.ask("digest", timeout=120) == before
        os.kill(fork, 9)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(w.pid)], check=False)
        w.proc.kill()
        w.proc.wait()


@two_gpus
def test_every_rank_of_a_job_restored_onto_the_other_gpu(job):
    """--map for every rank of a job: each rank's GPU swapped with its peer's, the collectives run on."""
    before = [w.ask("digest", timeout=120) for w in job]
    u = [gpucr.status(w.pid).gpus[0].uuid for w in job]
    assert u[0] != u[1]
    checkpoint_many([w.pid for w in job], timeout=60)
    restore_many([w.pid for w in job], timeout=60, gpu_map={u[0]: u[1], u[1]: u[0]})
    assert [gpucr.status(w.pid).gpus[0].uuid for w in job] == [u[1], u[0]]
    assert [w.ask("digest", timeout=120) for w in job] == before
    assert all(r["ok"] for r in _allreduce_all(job))
    checkpoint_many([w.pid for w in job], timeout=60)   # and back
    restore_many([w.pid for w in job], timeout=60, gpu_map={u[0]: u[1], u[1]: u[0]})
    assert [gpucr.status(w.pid).gpus[0].uuid for w in job] == u
    assert all(r["ok"] for r in _allreduce_all(job))
