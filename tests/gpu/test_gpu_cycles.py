"""On a real NVIDIA GPU (the lent H200): frameworks' processes checkpointed at level full give the
card back to within 16 MiB of idle, and come back byte-identical at the same addresses."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import gpucr
from gpucr.driver import ProcessState, driver_for, gpu_memory
from gpucr.workloads.runner import Workload

from conftest import gpu, server_gpu_bytes

pytestmark = [gpu, pytest.mark.gpu]
MiB = 1 << 20
SLACK = 16 * MiB
# NVML's per-process figure against the card's used delta: not yet measured on the H200 (written
# without a GPU); the context's bookkeeping may differ a little between the two
PER_PROCESS_SLACK = 64 * MiB
RESULTS = Path(os.environ.get("GPUCR_GPU_RESULTS", "/tmp/gpucr-gpu-results.jsonl"))


def used() -> int:
    return gpu_memory(driver_for("libcuda.so.1")).used


def record(**row) -> None:
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


def cycles(name: str, module: str, args: list[str], n: int, env: dict | None = None) -> None:
    idle = used()
    with Workload(module, *args, env=env) as app:
        for i in range(n):
            app.ask("work")
            before = app.ask("digest")
            result = app.ask("compute")
            # what it holds now: a framework's allocator keeps what the digest and compute used (torch's cache
            # grew 8 GiB over the start on the H200), and a server that gives back its context holds nothing here
            held = used() - server_gpu_bytes() - idle
            ck = gpucr.checkpoint(app.pid, level="full", timeout=60)
            during = used() - server_gpu_bytes()
            assert during - idle <= SLACK, f"{name} cycle {i}: {(during - idle) / MiB:.0f} MiB above idle while checkpointed"
            assert gpucr.status(app.pid).state == "checkpointed"
            # NVML's per-process list: this process held what it added to the card, and holds nothing now
            [g] = ck.gpus
            assert abs(g.process_before_bytes - held) <= PER_PROCESS_SLACK and g.process_after_bytes == 0, g
            assert g.gpu_used_before_bytes - g.gpu_used_after_bytes >= g.process_before_bytes - PER_PROCESS_SLACK, g
            rs = gpucr.restore(app.pid, timeout=60)
            assert abs(rs.gpus[0].process_after_bytes - held) <= PER_PROCESS_SLACK, rs.gpus
            after = app.ask("digest")
            assert after["digest"] == before["digest"], f"{name} cycle {i}: bytes differ"
            assert after["ptrs"] == before["ptrs"], f"{name} cycle {i}: addresses moved"
            assert app.ask("compute") == result, f"{name} cycle {i}: computation differs"
            record(test=name, cycle=i, held_mib=held / MiB, above_idle_while_ckpt_mib=(during - idle) / MiB,
                   bytes_moved=ck.bytes_moved, left_to_driver=ck.bytes_left_to_driver,
                   ckpt=ck.phases_s, agent_s=ck.agent_phases_s, restore=rs.phases_s,
                   data_plane={"checkpoint": ck.data_plane, "restore": rs.data_plane})


def test_torch_default_allocator_20gib_ten_cycles():
    cycles("torch-20GiB", "torch_app", ["--gib", "20"], 10)


def test_torch_expandable_segments_ten_cycles():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cycles("torch-expandable-8GiB", "torch_app", ["--gib", "8"], 10, env=env)


def test_cupy_ten_cycles():
    pytest.importorskip("cupy")
    cycles("cupy-8GiB", "cupy_app", ["--gib", "8"], 10)


@pytest.mark.parametrize("mode", ["loop", "graph"])
def test_checkpoint_mid_loop(mode):
    with Workload("torch_app", "--gib", "2") as app:
        before = app.ask("digest")
        app.ask(f"{mode} start")
        time.sleep(0.5)
        for i in range(3):
            gpucr.checkpoint(app.pid, level="full", timeout=30)
            time.sleep(0.2)
            gpucr.restore(app.pid, timeout=30)
            time.sleep(0.3)
        out = app.ask(f"{mode} stop")
        assert out["error"] is None and out["iterations"] > 100, out
        after = app.ask("digest")
        assert after["digest"] == before["digest"], "a launch was lost or doubled"
        record(test=f"mid-{mode}", iterations=out["iterations"])


def test_long_kernel_past_deadline_is_refused_and_app_runs_on():
    with Workload("torch_app", "--gib", "1") as app:
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=60)   # staging prepared, so the deadline meets the kernel, not staging
        gpucr.restore(app.pid, timeout=60)
        app.ask("sleep 8")   # a kernel that runs ~8 s
        time.sleep(0.2)
        t0 = time.perf_counter()
        with pytest.raises(gpucr.GpucrError, match="did not finish|in flight"):
            gpucr.checkpoint(app.pid, timeout=1.0)
        refused_after = time.perf_counter() - t0
        assert refused_after < 5
        assert driver_for("libcuda.so.1").state(app.pid) == ProcessState.RUNNING
        assert gpucr.status(app.pid).state == "running"
        assert app.ask("digest")["digest"] == before["digest"]
        record(test="deadline", refused_after_s=refused_after)


def test_two_processes_checkpointed_together():
    from gpucr import checkpoint_many, restore_many
    idle = used()
    with Workload("torch_app", "--gib", "2", "--seed", "1") as a, Workload("cupy_app" if _has_cupy() else "torch_app",
                                                                            "--gib", "2", "--seed", "2") as b:
        before = [a.ask("digest"), b.ask("digest")]
        checkpoint_many([a.pid, b.pid], timeout=60)
        during = used() - server_gpu_bytes()
        assert during - idle <= SLACK, f"{(during - idle) / MiB:.0f} MiB above idle with both checkpointed"
        restore_many([a.pid, b.pid], timeout=60)
        assert [a.ask("digest"), b.ask("digest")] == before
        record(test="group-of-2", above_idle_while_ckpt_mib=(during - idle) / MiB)


def _has_cupy() -> bool:
    import importlib.util
    return importlib.util.find_spec("cupy") is not None


def test_jax_cycles():
    pytest.importorskip("jax")
    # XLA preallocates a share of the card: bound it, so staging fits in host memory
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.15")
    cycles("jax-4GiB", "jax_app", ["--gib", "4"], 3, env=env)
