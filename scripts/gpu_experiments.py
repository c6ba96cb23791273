"""GPU experiments behind the closing notes (run by scripts/gpu-check on the lent H200):

1. How the driver's control half depends on host staging pinned in the process: the same
   PyTorch process (20 GiB) with staging in 4 KiB shared memory, in 2 MiB hugepages, and with no
   staging at all (data in an image on disk).
2. Checkpoint images on this machine's disk, next to dd's numbers for the same disk.
3. How fast host memory is pinned (cuMemHostRegister) by 1, 2, 4 and 8 threads at once, 2 GiB
   segments of shared memory (and of hugetlbfs when hugepages are free), and unpinned again: the
   rate the restore's pin-ahead threads must keep ahead of the copies with.
4. How fast CPU threads copy between host buffers (memcpy, 1-16 threads): what a ring between
   pinned slots and pageable staging (the CLI's mover, no server) needs to keep up with the 55 GB/s link.
5. fill-rate: how the gpucr server's copies between pinned staging and VMM memory of its own depend on
   streams, piece size and whether the memory is made (cuMemCreate + map) inside the timed fill, for
   one large allocation and for many small ones: why the fill ran at 90 % of the link when the copy
   out ran at 99 %; and the same memory made without the POSIX-fd handle type.
6. fill-matrix: which side holds the fill at 49 GB/s: each kind of host staging (shared memory, anonymous
   memory, hugetlbfs, all cuMemHostRegister'd; and the driver's own cuMemHostAlloc, the ceiling's kind)
   against each kind of device memory (exportable VMM, plain VMM, cuMemAlloc; one allocation, and many
   20 MiB ones), both ways; then piece size and streams for the server's own pair (shm into exportable VMM).
7. kernel-rate: gpucr's kernels (gpucr.dataplane.kernels) over EXP_KERNEL_GIB (32) GiB of device memory, in
   TB/s, median of EXP_KERNEL_RUNS (7) runs: the zero scan over all-zero memory (every byte read) and over
   non-zero memory (it leaves each chunk at its first non-zero batch), the digest, for 256, 512 and 1024
   threads a block, each timed to the end of its stream and again with its results read into Python (_read);
   next to a device-to-device copy of the same memory (read + write) as the bound; and the fatbin's load time
   in a fresh context. Then the data plane's table kernels (gpucr.dataplane.sweep), 512 threads, over the same
   memory cut into 1 GiB parts, one launch each kind: the scan (zero flags and digests, read back) and the
   check (digests compared on the GPU with those the scan took, one verdict back).
8. vmm-calls: what each driver call of a fill and of an adopt costs per allocation, for EXP_VMM_COUNT (1500)
   allocations of 20 MiB (torch's expandable segments): create, map (reserve + map + access), export, then
   import + map as the agent's adopt does, by 1, 2 and 4 threads at once, with the link idle and with a copy
   running: whether making and adopting can be spread over threads or run beside the fill's copies.

Prints one JSON object per line; writes them to $OUT/experiments.jsonl too.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpucr
from gpucr.doctor import meminfo
from gpucr.workloads.runner import Workload

OUT = Path(os.environ.get("OUT", "."))
GIB = float(os.environ.get("EXP_GIB", "20"))


def emit(**row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with (OUT / "experiments.jsonl").open("a") as f:
        f.write(line + "\n")


def rss_shmem(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def staging_experiment(kind: str, cycles: int = int(os.environ.get("EXP_CYCLES", "3"))) -> None:
    """kind: shm | hugetlbfs, the staging the data plane pins (through the driver's checkpoint)."""
    env = dict(os.environ, GPUCR_STAGING=kind)
    with Workload("torch_app", "--gib", str(GIB), env=env) as app:
        before = app.ask("digest")
        samples = []
        for i in range(cycles + 1):   # the first cycle prepares staging
            ck = gpucr.checkpoint(app.pid, timeout=120)
            rs = gpucr.restore(app.pid, timeout=120)
            assert app.ask("digest") == before
            if i:
                samples.append({"control_out": ck.phases_s["control_out"], "control_in": rs.phases_s["control_in"],
                                "data_out": ck.phases_s["data_out"], "data_in": rs.phases_s["data_in"]})
        st = gpucr.status(app.pid)
        emit(experiment="control-vs-staging", staging=st.staging_kind,
             staging_gib=st.staging_bytes / 2**30,
             bytes_moved=ck.bytes_moved, median={k: statistics.median(s[k] for s in samples) for k in samples[0]},
             samples=samples)


def pin_rate(segments: int = 8, seg_gib: int = 2) -> None:
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    seg = seg_gib << 30
    kinds = ["shm"]
    free_huge = meminfo().get("HugePages_Free", 0)
    if free_huge * (2 << 20) >= segments * seg:
        kinds.append("hugetlbfs")
    for kind in kinds:
        flags = os.MFD_HUGETLB if kind == "hugetlbfs" else 0
        maps = []
        for _ in range(segments):
            fd = os.memfd_create("gpucr-exp", flags)
            os.ftruncate(fd, seg)
            maps.append((fd, mmap.mmap(fd, seg)))
        bufs = [ctypes.c_char.from_buffer(m) for _, m in maps]
        addrs = [ctypes.addressof(b) for b in bufs]
        t0 = time.perf_counter()
        touchers = [threading.Thread(target=ctypes.memset, args=(a, 0, seg)) for a in addrs]
        [t.start() for t in touchers]
        [t.join() for t in touchers]
        touch_s = time.perf_counter() - t0

        def each(fn, threads: int) -> float:
            todo = list(addrs)
            lock = threading.Lock()

            def work() -> None:
                cu.cuCtxSetCurrent(ctx)
                while True:
                    with lock:
                        if not todo:
                            return
                        a = todo.pop(0)
                    rc = fn(a)
                    assert rc == 0, rc
            ts = [threading.Thread(target=work) for _ in range(threads)]
            t0 = time.perf_counter()
            [t.start() for t in ts]
            [t.join() for t in ts]
            return time.perf_counter() - t0
        rows = {}
        for threads in (1, 2, 4, 8):
            reg = each(lambda a: cu.cuMemHostRegister_v2(ctypes.c_void_p(a), ctypes.c_size_t(seg), 1), threads)
            unreg = each(lambda a: cu.cuMemHostUnregister(ctypes.c_void_p(a)), threads)
            rows[threads] = {"register_gbps": segments * seg / reg / 1e9, "unregister_gbps": segments * seg / unreg / 1e9}
        emit(experiment="pin-rate", kind=kind, bytes=segments * seg, segment_bytes=seg, touch_s=touch_s, threads=rows)
        del bufs
        for fd, m in maps:
            m.close()
            os.close(fd)


def memcpy_rate(gib: int = 8) -> None:
    n = gib << 30
    src, dst = mmap.mmap(-1, n), mmap.mmap(-1, n)
    bs, bd = ctypes.c_char.from_buffer(src), ctypes.c_char.from_buffer(dst)
    a, b = ctypes.addressof(bs), ctypes.addressof(bd)
    ctypes.memset(a, 1, n)
    ctypes.memset(b, 0, n)
    rows = {}
    for threads in (1, 4, 8, 16):
        per = n // threads
        ts = [threading.Thread(target=ctypes.memmove, args=(b + i * per, a + i * per, per)) for i in range(threads)]
        t0 = time.perf_counter()
        [t.start() for t in ts]
        [t.join() for t in ts]
        rows[threads] = n / (time.perf_counter() - t0) / 1e9
    emit(experiment="memcpy-rate", bytes=n, gbps_by_threads=rows)
    del bs, bd
    src.close()
    dst.close()


def fill_rate(gib: int = int(os.environ.get("EXP_FILL_GIB", "16"))) -> None:
    from gpucr.driver import controller_driver
    from gpucr.vmm import Vmm
    vmm = Vmm(controller_driver())
    ctx = vmm.retain_context(0)
    vmm.use(ctx)
    streams = [vmm.stream() for _ in range(4)]
    n = gib << 30
    fd = os.memfd_create("gpucr-fill", 0)
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n)
    buf = ctypes.c_char.from_buffer(m)
    host = ctypes.addressof(buf)
    ctypes.memset(host, 7, n)
    t0 = time.perf_counter()
    vmm.pin(host, n)
    pin_s = time.perf_counter() - t0
    mib = 1 << 20
    layouts = {f"one-{g}-gib": [g << 30] for g in (1, 2, 4, 8, 16) if g <= gib}
    # like llm_app's llama3-8b: a KV tensor per layer (~1.8 GiB each) and the weights in many blocks
    layouts["llm-like"] = [1792 * mib] * ((gib << 30) * 7 // 8 // (1792 * mib)) + [20 * mib] * ((gib << 30) // 8 // (20 * mib))

    def run(sizes: list[int], out: bool, nstreams: int, piece: int, make: str, exportable: bool = True) -> dict:
        """make: before (not timed), first (all made, then all copies: timed), interleaved (each made, then
        its copies queued, as the server's fill did); exportable: made with the POSIX-fd handle type (the
        data plane's) or with none (torch_memory_saver's)."""
        made: list[tuple[int, int, int]] = []
        t0 = time.perf_counter()
        if make in ("before", "first"):
            made = [(h, vmm.map(h, z, 0), z) for z in sizes for h in [vmm.create(z, 0, exportable)]]
        make_s = time.perf_counter() - t0
        if make == "before":
            t0 = time.perf_counter()
        off, turn = 0, 0
        for i, z in enumerate(sizes):
            if make == "interleaved":
                t1 = time.perf_counter()
                h = vmm.create(z, 0, exportable)
                made.append((h, vmm.map(h, z, 0), z))
                make_s += time.perf_counter() - t1
            va = made[i][1]
            step = piece or z
            for k in range(0, z, step):
                c = min(step, z - k)
                s = streams[turn % nstreams]
                turn += 1
                (vmm.d2h(host + off + k, va + k, c, s) if out else vmm.h2d(va + k, host + off + k, c, s))
            off += z
        for s in streams:
            vmm.sync(s)
        dt = time.perf_counter() - t0
        for h, va, z in made:
            vmm.unmap(va, z)
            vmm.release(h)
        return {"gbps": round(sum(sizes) / dt / 1e9, 2), "s": round(dt, 4), "make_s": round(make_s, 4)}

    for name, sizes in layouts.items():
        rows = []
        for out in (True, False):
            for nstreams, piece in ((4, 64 << 20), (1, 0), (4, 256 << 20)):
                for make in (("before",) if out else ("before", "first", "interleaved")):
                    r = [run(sizes, out, nstreams, piece, make) for _ in range(3)]
                    rows.append({"dir": "out" if out else "in", "streams": nstreams, "piece_mib": piece >> 20,
                                 "make": make, "median_gbps": statistics.median(x["gbps"] for x in r),
                                 "make_s": statistics.median(x["make_s"] for x in r)})
        # the same bytes in cuMemAlloc memory (the bench ceiling's kind), allocation by allocation
        for out in (True, False):
            ptrs = [vmm.alloc(z) for z in sizes]
            samples = []
            for _ in range(3):
                t1, off = time.perf_counter(), 0
                for k, (ptr, z) in enumerate(zip(ptrs, sizes)):
                    for j in range(0, z, 64 << 20):
                        c = min(64 << 20, z - j)
                        s = streams[(k + j // (64 << 20)) % 4]
                        (vmm.d2h(host + off + j, ptr + j, c, s) if out else vmm.h2d(ptr + j, host + off + j, c, s))
                    off += z
                for s in streams:
                    vmm.sync(s)
                samples.append(sum(sizes) / (time.perf_counter() - t1) / 1e9)
            for ptr in ptrs:
                vmm.free(ptr)
            rows.append({"dir": "out" if out else "in", "streams": 4, "piece_mib": 64, "make": "cuMemAlloc",
                         "median_gbps": round(statistics.median(samples), 2)})
        # the same memory made without an exportable handle type: is the type what slows the copy in?
        for out in (True, False):
            r = [run(sizes, out, 4, 64 << 20, "before", exportable=False) for _ in range(3)]
            rows.append({"dir": "out" if out else "in", "streams": 4, "piece_mib": 64, "make": "before",
                         "exportable": False, "median_gbps": statistics.median(x["gbps"] for x in r)})
        emit(experiment="fill-rate", layout=name, allocations=len(sizes), bytes=sum(sizes), pin_s=pin_s, rows=rows)
    vmm.unpin(host)
    del buf
    m.close()
    os.close(fd)


def fill_matrix(gib: int = int(os.environ.get("EXP_FILL_GIB", "8"))) -> None:
    from gpucr.driver import controller_driver
    from gpucr.vmm import Vmm
    vmm = Vmm(controller_driver())
    ctx = vmm.retain_context(0)
    vmm.use(ctx)
    cu = vmm._cu
    cu.cuMemHostAlloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
    cu.cuMemFreeHost.argtypes = (ctypes.c_void_p,)
    streams = [vmm.stream() for _ in range(8)]
    n, mib = gib << 30, 1 << 20

    def host_memory(kind: str):
        """(address, prepare seconds, release) of n bytes of pinned host memory of this kind, or None."""
        t0 = time.perf_counter()
        if kind == "cuMemHostAlloc":
            p = ctypes.c_void_p()
            if cu.cuMemHostAlloc(ctypes.byref(p), n, 0):
                return None
            ctypes.memset(p.value, 7, n)
            return p.value, time.perf_counter() - t0, lambda: cu.cuMemFreeHost(p)
        if kind == "hugetlbfs" and meminfo().get("HugePages_Free", 0) * (2 << 20) < n:
            return None
        fd = -1
        if kind == "anon":
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            fd = os.memfd_create("gpucr-fill", os.MFD_HUGETLB if kind == "hugetlbfs" else 0)
            os.ftruncate(fd, n)
            m = mmap.mmap(fd, n)
        buf = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(buf)
        ctypes.memset(addr, 7, n)
        vmm.pin(addr, n)

        def release() -> None:
            nonlocal buf
            vmm.unpin(addr)
            del buf
            m.close()
            if fd >= 0:
                os.close(fd)
        return addr, time.perf_counter() - t0, release

    def device_memory(kind: str) -> tuple[list[tuple[int, int]], callable]:
        """[(address, bytes)] of n bytes of device memory of this kind, and how to free it."""
        sizes = [20 * mib] * (n // (20 * mib)) if kind.endswith("-20mib") else [n]
        if kind.startswith("cuMemAlloc"):
            ptrs = [vmm.alloc(z) for z in sizes]
            return list(zip(ptrs, sizes)), lambda: [vmm.free(p) for p in ptrs]
        made = [(h, vmm.map(h, z, 0), z) for z in sizes for h in [vmm.create(z, 0, kind.startswith("vmm-fd"))]]

        def free() -> None:
            for h, va, z in made:
                vmm.unmap(va, z)
                vmm.release(h)
        return [(va, z) for _, va, z in made], free

    def one_pass(host: int, dev: list[tuple[int, int]], out: bool, piece: int = 64 * mib, nstreams: int = 4) -> float:
        """GB/s of one timed copy of every allocation of `dev` to (out) or from staging, in pieces over streams."""
        t0, off, turn = time.perf_counter(), 0, 0
        for va, z in dev:
            for k in range(0, z, piece):
                c, s = min(piece, z - k), streams[turn % nstreams]
                turn += 1
                (vmm.d2h(host + off + k, va + k, c, s) if out else vmm.h2d(va + k, host + off + k, c, s))
            off += z
        for s in streams[:nstreams]:
            vmm.sync(s)
        return sum(z for _, z in dev) / (time.perf_counter() - t0) / 1e9

    def rate(host: int, dev: list[tuple[int, int]], out: bool, piece: int = 64 * mib, nstreams: int = 4) -> float:
        return round(statistics.median(one_pass(host, dev, out, piece, nstreams) for _ in range(3)), 2)

    def cold(host: int, dk: str, prep: str) -> dict:
        """The first copy into (or out of) memory made just before: its rate, and the preparation's time.
        prep: none; memset (cuMemsetD8Async over it first, timed apart); wait (1 s between making and copying);
        wait-before-make (1 s between freeing the memory of the sample before and making this one)."""
        ins, outs, prep_s = [], [], []
        for _ in range(3):
            for out in (False, True):
                if prep == "wait-before-make":
                    time.sleep(1.0)
                dev, free = device_memory(dk)
                t0 = time.perf_counter()
                if prep == "memset":
                    for k, (va, z) in enumerate(dev):
                        vmm.memset(va, z, streams[k % 4])
                    for s in streams[:4]:
                        vmm.sync(s)
                elif prep == "wait":
                    time.sleep(1.0)
                prep_s.append(time.perf_counter() - t0)
                (outs if out else ins).append(one_pass(host, dev, out))
                free()
        return {"cold_in_gbps": round(statistics.median(ins), 2), "cold_out_gbps": round(statistics.median(outs), 2),
                "prep_s": round(statistics.median(prep_s), 4)}

    rows, skipped = [], []
    if os.environ.get("EXP_FILL_COLD_ONLY") == "1":
        got = host_memory("shm")
        host, _prep, release = got
        kinds = os.environ.get("EXP_FILL_COLD_KINDS", "vmm-fd,vmm-plain,cuMemAlloc,vmm-fd-20mib").split(",")
        preps = os.environ.get("EXP_FILL_COLD_PREPS", "none,memset,wait").split(",")
        for dk in kinds:
            for prep in preps:
                rows.append({"host": "shm", "device": dk, "prep": prep, **cold(host, dk, prep)})
                print(json.dumps(rows[-1]), flush=True)
        release()
        emit(experiment="fill-cold", bytes=n, piece_mib=64, streams=4, rows=rows)
        return
    dev_kinds = ("vmm-fd", "vmm-plain", "cuMemAlloc", "vmm-fd-20mib", "cuMemAlloc-20mib")
    for hk in ("shm", "anon", "hugetlbfs", "cuMemHostAlloc"):
        got = host_memory(hk)
        if got is None:
            skipped.append({"host": hk, "why": "no hugepages free for it" if hk == "hugetlbfs" else "could not be made"})
            continue
        host, prep_s, release = got
        for dk in dev_kinds:
            dev, free = device_memory(dk)
            rate(host, dev, False)   # untimed: first use
            rows.append({"host": hk, "device": dk, "prepare_s": round(prep_s, 2),
                         "out_gbps": rate(host, dev, True), "in_gbps": rate(host, dev, False)})
            free()
        if hk == "shm":   # the server's own pair: piece size and streams
            dev, free = device_memory("vmm-fd")
            for piece, nstreams in ((2 * mib, 4), (8 * mib, 4), (20 * mib, 4), (256 * mib, 4), (64 * mib, 1), (64 * mib, 2), (64 * mib, 8), (20 * mib, 8)):
                rows.append({"host": hk, "device": "vmm-fd", "piece_mib": piece // mib, "streams": nstreams,
                             "out_gbps": rate(host, dev, True, piece, nstreams), "in_gbps": rate(host, dev, False, piece, nstreams)})
            free()
        release()
        print(json.dumps([r for r in rows if r["host"] == hk]), flush=True)
    emit(experiment="fill-matrix", bytes=n, default_piece_mib=64, default_streams=4, rows=rows, skipped=skipped)


def kernel_rate(gib: int = int(os.environ.get("EXP_KERNEL_GIB", "32")),
                runs: int = int(os.environ.get("EXP_KERNEL_RUNS", "7"))) -> None:
    from gpucr.dataplane import kernels as kmod
    from gpucr.driver import controller_driver
    from gpucr.vmm import Vmm
    vmm = Vmm(controller_driver())
    ctx = vmm.retain_context(0)
    vmm.use(ctx)
    stream = vmm.stream()
    t0 = time.perf_counter()
    k = kmod.Kernels(vmm, [ctx])
    load_s = time.perf_counter() - t0
    n = gib << 30
    va = vmm.alloc(n)

    def tbps(fn) -> float:
        fn()   # untimed: first use
        vmm.sync(stream)
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            vmm.sync(stream)
            samples.append(n / (time.perf_counter() - t0) / 1e12)
        return round(statistics.median(samples), 3)

    def enqueue(kind: str):
        return (k.enqueue_zero_scan if kind == "zero" else k.enqueue_digests)(ctx, [(va, n)], stream)

    def kernel_only(kind: str) -> float:
        """The kernel and its results' copy back, timed to the stream's end; the results read untimed."""
        enqueue(kind).read()   # first use: its result buffer made
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            pending = enqueue(kind)
            vmm.sync(stream)
            samples.append(n / (time.perf_counter() - t0) / 1e12)
            pending.read()   # its buffer back for the next
        return round(statistics.median(samples), 3)

    rows = []
    for value in (0, 0x5A):
        vmm.memset(va, n, stream, value)
        vmm.sync(stream)
        for threads in (256, 512, 1024):
            kmod.THREADS = threads
            rows.append({"memory": "zero" if value == 0 else "non-zero", "threads": threads,
                         "zero_scan_tbps": kernel_only("zero"), "digest_tbps": kernel_only("digest"),
                         "zero_scan_read_tbps": tbps(lambda: enqueue("zero").read()),
                         "digest_read_tbps": tbps(lambda: enqueue("digest").read())})
            print(json.dumps(rows[-1]), flush=True)
    half = n // 2
    copy = tbps(lambda: vmm.d2d(va + half, va, half, stream))   # half read and half written: n bytes of traffic
    kmod.THREADS = 512
    tables = table_rates(k, ctx, stream, va, n, runs)
    vmm.free(va)
    k.close()
    emit(experiment="kernel-rate", bytes=n, runs=runs, module_load_s=round(load_s, 4), rows=rows,
         d2d_copy_read_plus_write_tbps=round(copy, 3), **tables)


def table_rates(k, ctx: int, stream: int, va: int, n: int, runs: int) -> dict:
    """The table kernels over [va, va + n) in 1 GiB parts, one sweep each, timed to its results on the host (TB/s,
    median of runs): the scan with its flags and digests read back, the check with its verdict."""
    from gpucr.dataplane.chunks import chunk_count
    from gpucr.dataplane.sweep import PART, Sweep, parts_of
    parts = parts_of(n, PART)

    def sweep(kind: str, digests: list[bytes]):
        s = Sweep(k, ctx, stream, kind, len(parts), chunk_count(n))
        try:
            for at, size in parts:
                first = at // (2 << 20)
                s.add(0, first, va + at, size, b"".join(digests[first:first + chunk_count(size)]) if kind == "check" else b"")
            if kind == "scan":
                return [d for _p, _z, ds in s.read(s.flush()) for d in ds]
            return s.verdict()
        finally:
            s.close()

    taken = sweep("scan", [])
    out = {}
    for kind in ("scan", "check"):
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            got = sweep(kind, taken)
            samples.append(n / (time.perf_counter() - t0) / 1e12)
        assert got == taken if kind == "scan" else got == (0, None), "the table kernels disagree with themselves"
        out[f"{kind}_table_tbps"] = round(statistics.median(samples), 3)
    print(json.dumps(out), flush=True)
    return out


def split_map(vmm, ctx: int, count: int, size: int) -> dict:
    """Where a map's time goes (reserve, map, set access, each per allocation), against one reservation for all
    with one cuMemSetAccess over the whole range (ms per allocation)."""
    import ctypes as C
    from gpucr.vmm import _AccessDesc, _MemLocation, _DEVICE, _READ_WRITE
    cu = vmm._cu
    acc = (_AccessDesc * 1)(_AccessDesc(location=_MemLocation(_DEVICE, 0), flags=_READ_WRITE))
    hs = [vmm.create(size, 0) for _ in range(count)]
    row: dict = {"what": "map split"}
    vas = []
    t0 = time.perf_counter()
    for _h in hs:
        va = C.c_uint64()
        cu.cuMemAddressReserve(C.byref(va), size, 0, 0, 0)
        vas.append(va.value)
    t1 = time.perf_counter()
    for h, va in zip(hs, vas):
        cu.cuMemMap(va, size, 0, h, 0)
    t2 = time.perf_counter()
    for va in vas:
        cu.cuMemSetAccess(va, size, acc, 1)
    t3 = time.perf_counter()
    row.update(reserve_ms=(t1 - t0), map_only_ms=(t2 - t1), set_access_ms=(t3 - t2))
    for va in vas:
        cu.cuMemUnmap(va, size)
        cu.cuMemAddressFree(va, size)
    base = C.c_uint64()
    t0 = time.perf_counter()
    cu.cuMemAddressReserve(C.byref(base), size * count, 0, 0, 0)
    for k, h in enumerate(hs):
        cu.cuMemMap(base.value + k * size, size, 0, h, 0)
    t1 = time.perf_counter()
    rc = cu.cuMemSetAccess(base.value, size * count, acc, 1)
    t2 = time.perf_counter()
    row.update(one_range_map_ms=(t1 - t0), one_set_access_total_ms=(t2 - t1) * count, one_set_access_rc=rc)
    t0 = time.perf_counter()
    for k in range(count):
        cu.cuMemUnmap(base.value + k * size, size)
    t1 = time.perf_counter()
    row.update(unmap_each_ms=(t1 - t0))
    # the same mapped again, then one cuMemUnmap over all of them: does the driver take it, and at what cost?
    for k, h in enumerate(hs):
        cu.cuMemMap(base.value + k * size, size, 0, h, 0)
    cu.cuMemSetAccess(base.value, size * count, acc, 1)
    t0 = time.perf_counter()
    rc = cu.cuMemUnmap(base.value, size * count)
    row.update(one_unmap_total_ms=(time.perf_counter() - t0) * count, one_unmap_rc=rc)
    if rc:
        for k in range(count):
            cu.cuMemUnmap(base.value + k * size, size)
    cu.cuMemAddressFree(base.value, size * count)
    for h in hs:
        vmm.release(h)
    return {k: (round(v * 1000 / count, 4) if k.endswith("_ms") else v) for k, v in row.items()}


def vmm_calls(count: int = int(os.environ.get("EXP_VMM_COUNT", "1500")), size: int = 20 << 20) -> None:
    from gpucr.driver import controller_driver
    from gpucr.vmm import Vmm
    vmm = Vmm(controller_driver())
    ctx = vmm.retain_context(0)
    vmm.use(ctx)

    def timed(threads: int, step) -> float:
        """Seconds for `count` calls of step(i), split over `threads` threads (each makes the context current)."""
        def work(part: range) -> None:
            vmm.use(ctx)
            for i in part:
                step(i)
        parts = [range(k, count, threads) for k in range(threads)]
        ts = [threading.Thread(target=work, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    def round_(threads: int) -> dict:
        hs, vas, fds, hs2, vas2 = [0] * count, [0] * count, [0] * count, [0] * count, [0] * count
        row = {"threads": threads}
        row["create_ms"] = timed(threads, lambda i: hs.__setitem__(i, vmm.create(size, 0)))
        row["map_ms"] = timed(threads, lambda i: vas.__setitem__(i, vmm.map(hs[i], size, 0)))
        row["export_ms"] = timed(threads, lambda i: fds.__setitem__(i, vmm.export_fd(hs[i])))
        row["import_ms"] = timed(threads, lambda i: hs2.__setitem__(i, vmm.import_fd(fds[i])))
        row["map_imported_ms"] = timed(threads, lambda i: vas2.__setitem__(i, vmm.map(hs2[i], size, 0)))
        row["teardown_ms"] = timed(threads, lambda i: (vmm.unmap(vas2[i], size), vmm.release(hs2[i]), os.close(fds[i]),
                                                       vmm.unmap(vas[i], size), vmm.release(hs[i])))
        return {k: (round(v * 1000 / count, 4) if k != "threads" else v) for k, v in row.items()}

    rows = [round_(t) for t in (1, 2, 4)]
    rows.append(split_map(vmm, ctx, count, size))
    # the same with the link busy: a host-to-device copy loop on a stream of its own
    n = int(os.environ.get("EXP_VMM_COPY_GIB", "8")) << 30
    host = vmm.host_alloc(n)
    dev = vmm.alloc(n)
    s = vmm.stream()
    stop = threading.Event()

    def copy_loop() -> None:
        vmm.use(ctx)
        while not stop.is_set():
            vmm.h2d(dev, host, n, s)
            vmm.sync(s)
    t = threading.Thread(target=copy_loop)
    t.start()
    busy = [dict(round_(th), link="busy") for th in (1, 2)]
    stop.set()
    t.join()
    vmm.free(dev)
    vmm.host_free(host)
    emit(experiment="vmm-calls", count=count, bytes_each=size, per_call_ms=rows + busy)


def dd(path: Path, gib: int) -> dict:
    out = {}
    w = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={gib * 16}", "oflag=direct", "conv=fsync"],
                       capture_output=True, text=True)
    out["dd_write"] = w.stderr.strip().splitlines()[-1]
    subprocess.run(["sync"])
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], capture_output=True, text=True)
    out["dd_read"] = r.stderr.strip().splitlines()[-1]
    path.unlink()
    return out


def image_experiment(directory: Path) -> None:
    with Workload("torch_app", "--gib", str(GIB), env=dict(os.environ, GPUCR_STAGING="shm")) as app:
        before = app.ask("digest")
        result = app.ask("compute")
        gpucr.checkpoint(app.pid, timeout=120)   # warm-up: staging prepared
        gpucr.restore(app.pid, timeout=120)
        img = directory / "img"
        t0 = time.perf_counter()
        ck = gpucr.checkpoint(app.pid, image=img, timeout=120)
        ck_s = time.perf_counter() - t0
        rss_after = rss_shmem(app.pid)
        st = gpucr.status(app.pid)
        t0 = time.perf_counter()
        rs = gpucr.restore(app.pid, image=img, timeout=120)
        rs_s = time.perf_counter() - t0
        ok = app.ask("digest") == before and app.ask("compute") == result
        subprocess.run(["rm", "-rf", str(img)], check=True)   # the disk holds one image at a time
        # a corrupt byte in a chunk: refused; the byte put back, the same image restores
        img2 = directory / "img2"
        gpucr.checkpoint(app.pid, image=img2, timeout=120)
        m = json.loads((img2 / "manifest.json").read_text())
        alloc, chunk = next((a, c) for a in m["processes"][0]["data"] for c in a["chunks"] if not c.get("zero"))
        where = alloc["file_offset"] + chunk["offset"] + 12345
        with open(img2 / "data.bin", "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 1]))
            f.flush()
            try:
                gpucr.restore(app.pid, image=img2, timeout=120)
                refused = None
            except gpucr.GpucrError as exc:
                refused = str(exc)
            f.seek(where)
            f.write(b)
        gpucr.restore(app.pid, image=img2, timeout=120)
        ok2 = app.ask("digest") == before
        emit(experiment="image", gib=GIB, image=gpucr.to_json(ck.image), read=gpucr.to_json(rs.image), checkpoint_s=ck_s, restore_s=rs_s,
             phases_checkpoint=ck.phases_s, phases_restore=rs.phases_s, rss_shmem_after_image=rss_after,
             staging_bytes_after_image=st.staging_bytes, byte_exact=ok, corrupt_refused=refused,
             restored_from_good_after_refusal=ok2)
    emit(experiment="dd", dir=str(directory), **dd(directory / "dd.bin", 8))


def image_in_exp_dir() -> None:
    d = Path(os.environ.get("EXP_IMAGE_DIR", "/var/tmp/gpucr-exp"))
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        image_experiment(Path(tmp))


EXPERIMENTS = {"pin-rate": pin_rate, "memcpy-rate": memcpy_rate, "fill-rate": fill_rate, "fill-matrix": fill_matrix,
               "kernel-rate": kernel_rate, "vmm-calls": vmm_calls, "image": image_in_exp_dir}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for w in sys.argv[1:] or ["shm", "hugetlbfs", "image"]:
        EXPERIMENTS.get(w, lambda: staging_experiment(w))()   # any other name: a staging kind
