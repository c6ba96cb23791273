"""The bounds a bench result is set against, each measured in the run itself: the pinned-copy ceiling
of one GPU's host link (or of every link at once), by a child process of its own (`python3 -m
gpucr.bench.bounds ceiling GIB`), so its memory is gone before any workload starts; and the disk's
rate where images are written (`disk_rate`)."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ..errors import GpucrError
from ..image import CHUNK, IN_FLIGHT
from ..imagefs import try_direct
from .specs import plain_env

def _measured_by_child(what: str, args: list[str], simulate: bool, timeout: float) -> dict[str, Any]:
    """A rate measured by a child process of this module (`python -m gpucr.bench.bounds ARGS`) that then exits, so
    its contexts and pinned buffers are gone before the bench goes on; its last line of output, as JSON."""
    out = subprocess.run([sys.executable, "-m", "gpucr.bench.bounds", *args], capture_output=True, text=True,
                         env=plain_env(simulate), timeout=timeout)
    if out.returncode != 0:
        raise GpucrError(f"{what} could not be measured: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ceiling(simulate: bool, gib: float, timeout: float = 600.0) -> dict[str, Any]:
    """D2H and H2D GB/s of one pinned copy of GIB GiB, measured by a child process that then exits."""
    return _measured_by_child("the pinned-copy ceiling", ["ceiling", str(gib)], simulate, timeout)


class _Link:
    """One GPU's pinned-copy path: a device buffer and a pinned host buffer of n bytes, through the
    driver API via ctypes (the same bindings as driver_app), so it runs on simcuda too."""

    def __init__(self, ordinal: int, n: int) -> None:
        from ..workloads import driver_app as d
        self.d, self.n = d, n
        self.host_alloc = d._sig("cuMemHostAlloc", ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
        self.free_host = d._sig("cuMemFreeHost", ctypes.c_void_p)
        d.check(d.cuInit(0), "cuInit")
        self.ctx = ctypes.c_void_p()
        d.check(d.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), ordinal), f"context on device {ordinal}")
        self.enter()
        self.dev, self.host = ctypes.c_uint64(), ctypes.c_void_p()
        d.check(d.cuMemAlloc(ctypes.byref(self.dev), n), f"device buffer on device {ordinal}")
        t0 = time.perf_counter()
        d.check(self.host_alloc(ctypes.byref(self.host), n, 0), "pinned host buffer")
        self.pin_s = time.perf_counter() - t0
        self.d2h()   # untimed: first-use costs are not the rate
        self.h2d()

    def enter(self) -> None:
        """Make this GPU's context current in the calling thread (contexts are per thread)."""
        self.d.check(self.d.cuCtxSetCurrent(self.ctx), "set context")

    def d2h(self) -> None:
        self.d.check(self.d.cuMemcpyDtoH(self.host, self.dev.value, self.n), "D2H")

    def h2d(self) -> None:
        self.d.check(self.d.cuMemcpyHtoD(self.dev.value, self.host, self.n), "H2D")

    def close(self) -> None:
        self.d.check(self.free_host(self.host), "free host")
        self.d.check(self.d.cuMemFree(self.dev.value), "free device")


HOW = "one cuMemcpyDtoH/HtoD of a cuMemHostAlloc (pinned) buffer, driver API, default stream"


def _ceiling_child(gib: float, repeat: int = 3) -> dict[str, Any]:
    link = _Link(0, int(gib * (1 << 30)))
    d2h, h2d = [], []
    for _ in range(repeat):
        for fn, rates in ((link.d2h, d2h), (link.h2d, h2d)):
            t0 = time.perf_counter()
            fn()
            rates.append(link.n / (time.perf_counter() - t0) / 1e9)
    link.close()
    return {"bytes": link.n, "d2h_gbps": statistics.median(d2h), "h2d_gbps": statistics.median(h2d),
            "samples": {"d2h_gbps": d2h, "h2d_gbps": h2d}, "pin_s": link.pin_s, "simulated": link.d.SIM, "how": HOW}


def _ceiling_all_child(gib: float, gpus: int, repeat: int = 3) -> dict[str, Any]:
    """Every GPU's link at once: one thread per GPU (ctypes lets the GIL go during each copy), all
    starting each copy together; per GPU its own rate, and the aggregate: all bytes over the time
    from the first start to the last end."""
    import threading
    links = [_Link(i, int(gib * (1 << 30))) for i in range(gpus)]
    barrier = threading.Barrier(gpus)
    spans: dict[tuple[str, int, int], tuple[float, float]] = {}

    def run(i: int) -> None:
        links[i].enter()
        for r in range(repeat):
            for name in ("d2h", "h2d"):
                barrier.wait()
                t0 = time.perf_counter()
                getattr(links[i], name)()
                spans[(name, r, i)] = (t0, time.perf_counter())
    threads = [threading.Thread(target=run, args=(i,)) for i in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = links[0].n
    out: dict[str, Any] = {"bytes_per_gpu": n, "gpus": gpus, "how": HOW + ", one thread per GPU, all at once",
                           "simulated": links[0].d.SIM, "per_gpu": []}
    for i in range(gpus):
        out["per_gpu"].append({f"{k}_gbps": statistics.median(n / (spans[(k, r, i)][1] - spans[(k, r, i)][0]) / 1e9
                                                             for r in range(repeat)) for k in ("d2h", "h2d")})
    for k in ("d2h", "h2d"):
        rounds = [[spans[(k, r, i)] for i in range(gpus)] for r in range(repeat)]
        out[f"aggregate_{k}_gbps"] = statistics.median(n * gpus / (max(e for _, e in sp) - min(b for b, _ in sp)) / 1e9
                                                       for sp in rounds)
    for link in links:
        link.close()
    return out


def ceiling_all(simulate: bool, gib: float, gpus: int, timeout: float = 600.0) -> dict[str, Any]:
    """The pinned-copy ceiling of every GPU's link at once, by a child process that then exits."""
    return _measured_by_child(f"the pinned-copy ceiling of {gpus} GPUs at once", ["ceiling-all", str(gib), str(gpus)],
                              simulate, timeout)


def two_way(simulate: bool, gib: float, timeout: float = 600.0) -> dict[str, Any]:
    """GB/s each way of a D2H and an H2D of GIB GiB each at once (a two-way switch's link), by a child process."""
    return _measured_by_child("the two-way rate", ["two-way", str(gib)], simulate, timeout)


def _two_way_child(gib: float, repeat: int = 3) -> dict[str, Any]:
    """Two links' buffers on GPU 0, each direction on a stream of its own (non-blocking: the legacy default stream
    would serialise them), both copies started together; the rate each way is its bytes over the time until both
    are done."""
    out_link, in_link = _Link(0, int(gib * (1 << 30))), _Link(0, int(gib * (1 << 30)))
    d, vp = out_link.d, ctypes.c_void_p
    create = d._sig("cuStreamCreate", ctypes.POINTER(vp), ctypes.c_uint)
    d2h = d._sig("cuMemcpyDtoHAsync_v2", vp, ctypes.c_uint64, ctypes.c_size_t, vp)
    h2d = d._sig("cuMemcpyHtoDAsync_v2", ctypes.c_uint64, vp, ctypes.c_size_t, vp)
    sync = d._sig("cuStreamSynchronize", vp)
    s_out, s_in = vp(), vp()
    d.check(create(ctypes.byref(s_out), 1), "stream")
    d.check(create(ctypes.byref(s_in), 1), "stream")
    n, rates = out_link.n, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        d.check(d2h(out_link.host, out_link.dev.value, n, s_out), "D2H")
        d.check(h2d(in_link.dev.value, in_link.host, n, s_in), "H2D")
        d.check(sync(s_out), "sync")
        d.check(sync(s_in), "sync")
        rates.append(n / (time.perf_counter() - t0) / 1e9)
    out_link.close()
    in_link.close()
    return {"bytes_each_way": n, "each_way_gbps": statistics.median(rates), "samples": rates, "simulated": d.SIM,
            "how": "a cuMemcpyDtoHAsync and a cuMemcpyHtoDAsync of cuMemHostAlloc (pinned) buffers at once, "
                   "each on a non-blocking stream of its own, driver API"}


# ---- the disk's rate ----

BLOCK = 4096   # O_DIRECT moves whole blocks: sizes are rounded up to this


def disk_rate(directory: str | Path, nbytes: int) -> dict[str, Any]:
    """The disk's rate under `directory`, measured as an image moves (gpucr.image): `nbytes` of random
    bytes written, then fsync'd, then read back, CHUNK at a time with IN_FLIGHT in flight, O_DIRECT
    where the filesystem allows it (the page cache is dropped before the read where it does not), in
    a file of its own that is removed after."""
    total = -(-nbytes // BLOCK) * BLOCK
    fd, path = tempfile.mkstemp(prefix="gpucr-bench-disk-", dir=directory)
    try:
        direct = try_direct(fd)
        pattern = mmap.mmap(-1, CHUNK)   # page-aligned, as O_DIRECT wants its buffers
        pattern.write(os.urandom(CHUNK))   # random: nothing below can compress or skip it
        t0 = time.perf_counter()
        _each_chunk(total, lambda off, n, _: os.pwrite(fd, memoryview(pattern)[:n], off))
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        _each_chunk(total, lambda off, n, buf: os.preadv(fd, [memoryview(buf)[:n]], off))
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return {"dir": str(directory), "bytes": total, "write_s": write_s, "read_s": read_s,
            "write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9, "direct_io": direct,
            "how": f"write + fsync, then read, {CHUNK >> 20} MiB at a time, {IN_FLIGHT} in flight"
                   + (", O_DIRECT" if direct else ", buffered (no O_DIRECT here), page cache dropped before the read")}


def _each_chunk(total: int, move: Callable[[int, int, mmap.mmap], int]) -> None:
    """move(offset, bytes, this thread's buffer) for every chunk of `total`, IN_FLIGHT at once; a short
    transfer is an error (the disk is full, or the file was cut)."""
    local = threading.local()

    def one(off: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, CHUNK)
        n = min(CHUNK, total - off)
        done = move(off, n, local.buf)
        if done != n:
            raise GpucrError(f"the disk's rate: moved {done} of {n} bytes at offset {off} (disk full?)")
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        list(pool.map(one, range(0, total, CHUNK)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "ceiling":
        print(json.dumps(_ceiling_child(float(sys.argv[2]))))
    elif len(sys.argv) == 3 and sys.argv[1] == "two-way":
        print(json.dumps(_two_way_child(float(sys.argv[2]))))
    elif len(sys.argv) == 4 and sys.argv[1] == "ceiling-all":
        print(json.dumps(_ceiling_all_child(float(sys.argv[2]), int(sys.argv[3]))))
    else:
        sys.exit("usage: python3 -m gpucr.bench.bounds ceiling GIB | two-way GIB | ceiling-all GIB GPUS")
