"""One `gpucr serve` kept running from one application to the next, as a user's server is (issue 24): apps of
different sizes and of the same size, each checkpointed and restored through it, then gone. Once an app has
gone, nothing of it stays in the server: no staging mapped (its /proc maps), no fd (the count is back to the
idle one) and no GPU memory beyond the server's own context (NVML's per-process count). The server makes its
context at its first request, and that context opens the driver's device files, eventfds and a pipe: so "idle"
is what the server holds once the first app has gone, and the fds it gained by then must all be the driver's. The CPU suite holds
the same on simcuda (tests/test_server.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpucr.workloads.runner import Workload

from conftest import gpu
from test_gpu_cycles import SLACK

pytestmark = [gpu, pytest.mark.gpu]

SIZES_GIB = ("2", "4", "1", "2", "2")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucr.cli", *args], capture_output=True, text=True, timeout=300)


def staging_maps(pid: int) -> list[str]:
    """The server's mappings of any process's staging (the agent names its memfds gpucr-staging)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.strip() for line in f if "gpucr-staging" in line]


def fds(pid: int) -> dict[str, str]:
    """The process's fds and what each names (a path, memfd:..., socket:[...], anon_inode:...)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:   # closed meanwhile
            pass
    return out


def fd_count(pid: int) -> int:
    return len(fds(pid))


def gpu_bytes_of(pid: int) -> int:
    """NVML's count of one process's GPU memory, through nvidia-smi (0 when it holds none)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        p, mib = (v.strip() for v in line.split(","))
        if p == str(pid):
            return int(mib) << 20
    return 0


def settled(probe, want, seconds: float = 20.0):
    """probe() once it equals want, or its last value after `seconds` (the server lets go at its own pace)."""
    deadline = time.time() + seconds
    while True:
        got = probe()
        if got == want or time.time() > deadline:
            return got
        time.sleep(0.2)


def test_apps_one_after_another_leave_nothing_in_the_server(gpu_server):
    spid = gpu_server.pid
    before_any = fds(spid)
    idle_fds = context = None    # the server with its context, measured once the first app has gone
    for i, gib in enumerate(SIZES_GIB):
        with Workload("torch_app", "--gib", gib, "--seed", str(i)) as app:
            before = app.ask("digest")
            for _ in range(2):
                r = cli("checkpoint", str(app.pid))
                assert r.returncode == 0, r.stderr
                r = cli("restore", str(app.pid))
                assert r.returncode == 0, r.stderr
                assert app.ask("digest") == before, f"app {i} ({gib} GiB): data changed"
        assert settled(lambda: staging_maps(spid), []) == [], f"after app {i} ({gib} GiB) the server still maps its staging"
        if idle_fds is None:
            gained = {fd: what for fd, what in fds(spid).items() if fd not in before_any}
            # the context's: the device files, and the driver's own eventfds and pipe (seen on the H200);
            # never a process's staging (a memfd) nor a connection (a socket)
            assert not [w for w in gained.values() if w.startswith(("/memfd:", "socket:"))], \
                f"after the first app the server holds fds that are not its context's: {gained}"
            idle_fds, context = fd_count(spid), gpu_bytes_of(spid)
        assert settled(lambda: fd_count(spid), idle_fds) == idle_fds, \
            f"after app {i} ({gib} GiB): {fds(spid)} in the server, {idle_fds} fds when idle"
        held = gpu_bytes_of(spid)
        assert abs(held - context) <= SLACK, \
            f"after app {i} ({gib} GiB) the server holds {held >> 20} MiB on the GPU, its context alone {context >> 20} MiB"
        ps = cli("ps")
        assert ps.returncode == 0, ps.stderr
        print(f"app {i} ({gib} GiB) gone: server fds {fd_count(spid)} (idle {idle_fds}), GPU {held >> 20} MiB; ps:\n{ps.stdout}")
