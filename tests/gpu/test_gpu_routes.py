"""Routes through an idle NVLink neighbour on real GPUs (issue 13, item 3): on a host with two GPUs joined
by NVLink, a process on GPU 0 with GPU 1 idle is checkpointed and restored through a gpucr server that
sends part of the data through GPU 1 (host <-> GPU 1 over its own link, GPU 1 <-> GPU 0 over NVLink).
Every byte comes back, and the server keeps nothing on GPU 1 but its context. A process told to start on
GPU 1 as a restore begins has its start and its own host copies recorded against the same on an idle GPU 1
(on the H200s it reached the GPU after the restore had ended); when it shows before the end, the route
is given up and the restore says so. The CPU suite covers giving up mid-copy on two simulated GPUs
(tests/test_server.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import gpucr
from gpucr.driver import driver_for, process_gpu_memory
from gpucr.workloads.runner import Workload

from conftest import gpu, two_gpus
from test_gpu_cycles import record

pytestmark = [gpu, two_gpus, pytest.mark.gpu]
GiB = 1 << 30
CONTEXT_MOST = 768 << 20   # an H200 context with its copy streams is ~530 MiB (NVML, per process)

# A newcomer on GPU 1: torch imported (which touches no GPU), it waits for "go" before touching CUDA (so
# the route is there to be taken), then times its start (context and a 2 GiB allocation) and its own
# host-to-GPU copies, 1 GiB each, for 1.5 s. Importing torch after "go" (the first H200 run) took 4.8 s,
# longer than the restore: the newcomer then never met the route.
NEWCOMER = r"""
import json, sys, time
import torch
sys.stdout.write("waiting\n"); sys.stdout.flush()
sys.stdin.readline()
t0 = time.perf_counter()
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
started = time.perf_counter() - t0
h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
copies = []
while time.perf_counter() - t0 < started + 1.5:
    a = time.perf_counter()
    x[: 1 << 30].copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    copies.append([round(a - t0, 4), round((1 << 30) / (time.perf_counter() - a) / 1e9, 2)])
print(json.dumps({"start_s": started, "copies": copies}))
"""


class Newcomer:
    def __init__(self) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
        env.pop("LD_PRELOAD", None)
        self.proc = subprocess.Popen([sys.executable, "-c", NEWCOMER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "waiting"

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])


def gbps(nbytes: int, phases: dict, key: str) -> float | None:
    s = phases.get(key)
    return round(nbytes / s / 1e9, 1) if s else None


def test_half_the_data_goes_through_the_idle_neighbour_both_ways(gpu_server):
    drv = driver_for("libcuda.so.1")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    with Workload("torch_app", "--gib", "32", env=env) as app:
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=180)   # the first cycle pins staging: not measured
        gpucr.restore(app.pid, timeout=180)
        for i in range(3):
            ck = gpucr.checkpoint(app.pid, timeout=180)
            rs = gpucr.restore(app.pid, timeout=180)
            after = app.ask("digest")
            assert after["digest"] == before["digest"] and after["ptrs"] == before["ptrs"], f"cycle {i}"
            [nb] = ck.routes or [None]
            assert nb and set(rs.routes) == {nb}, (ck.routes, rs.routes, ck.warnings)
            for r, moved in ((ck.routes, ck.bytes_moved), (rs.routes, rs.bytes_moved)):
                assert 0.25 * moved <= r[nb] <= 0.75 * moved, (r, moved)
            record(test="route-two-links-32GiB", cycle=i, bytes_moved=ck.bytes_moved, routes_out=ck.routes,
                   routes_in=rs.routes, checkpoint_s=ck.phases_s, restore_s=rs.phases_s,
                   data_out_gbps=gbps(ck.bytes_moved, ck.phases_s, "data_out"),
                   data_in_gbps=gbps(rs.bytes_moved, rs.phases_s, "data_in"))
        held = process_gpu_memory(drv, gpu_server.pid, 1)
        assert held is not None and held <= CONTEXT_MOST, f"the server holds {held} bytes on GPU 1: its slots stayed"


def test_a_process_starting_on_the_neighbour_takes_the_route_back(gpu_server):
    """The route is given up once the newcomer shows on GPU 1; its start and copies are timed against the
    same newcomer on an idle GPU 1 (recorded: what a route costs a process that starts meanwhile)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    alone = Newcomer()
    alone.go()
    baseline = alone.result()
    with Workload("torch_app", "--gib", "48", env=env) as app:
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=180)
        gpucr.restore(app.pid, timeout=180)
        ck = gpucr.checkpoint(app.pid, timeout=180)
        assert ck.routes, ck.warnings
        late = Newcomer()
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(rs=gpucr.restore(app.pid, timeout=180)))
        late.go()
        t0 = time.perf_counter()
        t.start()
        t.join()
        restore_s = time.perf_counter() - t0
        meanwhile = late.result()
        rs = box["rs"]
        assert app.ask("digest") == before
        routed = sum(rs.routes.values())
        record(test="route-cost-to-a-newcomer", newcomer_idle=baseline, newcomer_during_restore=meanwhile,
               restore_s=restore_s, restore_bytes=rs.bytes_moved, routed_bytes=routed, warnings=rs.warnings)
        if any("given up" in w for w in rs.warnings):   # the newcomer showed mid-restore: the rest went straight
            assert routed < 0.75 * rs.bytes_moved, rs
        # the newcomer has gone: GPU 1 is idle again and lends its link to the next cycle
        ck2 = gpucr.checkpoint(app.pid, timeout=180)
        gpucr.restore(app.pid, timeout=180)
        assert app.ask("digest") == before
        record(test="route-after-the-newcomer-left", routes_out=ck2.routes)
