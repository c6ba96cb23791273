"""On a real NVIDIA GPU (the lent H200): the agent keeps one exported fd of every allocation it manages.
A free gives the memory back at once, a parked process holds nothing, and a controller process can
import the fds and read the application's bytes. Written without a GPU (not yet run)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpucr
from gpucr.driver import driver_for, gpu_memory
from gpucr.workloads.runner import Workload

from conftest import gpu, server_gpu_bytes

pytestmark = [gpu, pytest.mark.gpu]
MiB = 1 << 20
SLACK = 16 * MiB
HELPER = Path(__file__).parent.parent / "apps" / "import_memory.py"


def used() -> int:
    return gpu_memory(driver_for("libcuda.so.1")).used


def test_free_gives_memory_back_at_once_and_a_parked_process_holds_nothing():
    idle = used()
    with Workload("driver_app", "--sizes", "64M", "--vmm-mib", "64") as app:
        start = used()
        app.ask(f"alloc {1024 * MiB}")
        assert used() - start >= 1024 * MiB - SLACK
        app.ask("free 2")
        assert abs(used() - start) <= SLACK, "the agent's fd was closed with the free"
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=60)
        assert used() - server_gpu_bytes() - idle <= SLACK, "the agent's fds keep nothing on the GPU while parked"
        gpucr.restore(app.pid, timeout=60)
        assert app.ask("digest") == before


def test_controller_imports_the_agents_fds_on_the_real_driver():
    with Workload("driver_app", "--sizes", "256M,8M", "--vmm-mib", "64") as app:
        bufs = app.ask("buffers")["buffers"]
        r = subprocess.run([sys.executable, str(HELPER), str(app.pid),
                            json.dumps({b["va"]: b["bytes"] for b in bufs}), "libcuda.so.1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert all(m["fd"] for m in got["memory"])
        assert got["digests"] == {str(b["va"]): b["sha256"] for b in bufs}
