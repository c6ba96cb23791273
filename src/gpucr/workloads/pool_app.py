"""A driver-API application that allocates with CUDA's stream-ordered allocator (ctypes, like a C++
program using cudaMallocAsync): buffers from the default pool on several streams and from an
explicit pool (cuMemPoolCreate), filled with known bytes.

Commands:
  digest                      sha256 of every buffer, and their addresses
  work V                      add V to every 32-bit word of every buffer (on its stream), then synchronise
  churn N                     N alloc/free pairs on each stream (sizes 512 B .. 4 MiB), buffers untouched
  reuse-same                  alloc, free, alloc on one stream: the same block? (CUDA: at once)
  reuse-cross [internal 0|1]  alloc + free on stream 0, then alloc on stream 1: the same block, and
                              (simcuda) whether stream 1 is then ordered after the free
  reuse-after-sync [opp 0|1]  the same, once stream 0 was synchronised (the free is complete), with
                              internal dependencies off (and REUSE_ALLOW_OPPORTUNISTIC as given, default 1)
  reuse-per-thread            a thread allocates, writes and frees on its per-thread default stream
                              (the _ptsz entry points, stream NULL); then this thread allocates on its own:
                              the same block, and (simcuda) whether its stream is ordered after that free
  attrs                       used/reserved (current, high) and release threshold of both pools
  threshold BYTES             the release threshold of the default pool
  trim BYTES                  cuMemPoolTrimTo(default pool, BYTES)
  sync                        cuCtxSynchronize
  ipc-pool MIB                a pool with POSIX-fd handles, MIB allocated from it and the pool exported
  peer-access D on|off        cuMemPoolSetAccess of the default pool for device D
  peer-write D V              from device D's context, memset the first buffer to V: the CUDA error (0: it
                              could) and, when it could, the first word as device 0 reads it back
  capture-free                during a stream capture, free the first buffer (CUDA: only a graph allocation
                              may be freed there): the free's error, the capture status, EndCapture's error
  graph KEEP CACHED           capture an allocation of KEEP bytes the graph does not free and one of CACHED
                              it frees, then destroy the graph (KEEP stays the application's)
  graph-mem                   device 0's graph memory: used and reserved (current, high)
  pool-destroy                cuMemPoolDestroy of the explicit pool (its buffers still in use)
  pool-free                   free the explicit pool's buffers (on their streams)
  usage-pool MIB              a pool with usage flags (the driver's): MIB allocated and freed, kept reserved
  usage-attrs                 that pool's used/reserved
  loop start THREADS          threads that each, on a stream of their own, allocate, write, read back and
  loop stop                   check, and free blocks handed on to the next thread's stream, until stopped
                              (a checkpoint lands mid-loop); stop answers the rounds and the first error
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import threading

from .driver_app import (SIM, Access, Loc, _sig, check, cuCtxSetCurrent, cuCtxSynchronize, cuDevicePrimaryCtxRetain,
                         cuInit, cuMemcpyDtoH, cuMemsetD32, parse_size)
from .protocol import serve

u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
ATTR = {"reserved": 5, "reserved_high": 6, "used": 7, "used_high": 8, "threshold": 4}


class PoolProps(ctypes.Structure):   # CUmemPoolProps (88 bytes)
    _fields_ = [("allocType", ctypes.c_int), ("handleTypes", ctypes.c_int), ("loc", Loc), ("win32", vp),
                ("maxSize", sz), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54)]


cuStreamCreate = _sig("cuStreamCreate", ctypes.POINTER(vp), ctypes.c_uint)
cuStreamSynchronize = _sig("cuStreamSynchronize", vp)
cuMemAllocAsync = _sig("cuMemAllocAsync", ctypes.POINTER(u64), sz, vp)
cuMemAllocFromPoolAsync = _sig("cuMemAllocFromPoolAsync", ctypes.POINTER(u64), sz, vp, vp)
cuMemFreeAsync = _sig("cuMemFreeAsync", u64, vp)
cuMemAllocAsync_ptsz = _sig("cuMemAllocAsync_ptsz", ctypes.POINTER(u64), sz, vp)
cuMemFreeAsync_ptsz = _sig("cuMemFreeAsync_ptsz", u64, vp)
cuMemcpyHtoDAsync_ptsz = _sig("cuMemcpyHtoDAsync_v2_ptsz", u64, vp, sz, vp)
PER_THREAD = vp(2)   # CU_STREAM_PER_THREAD
cuEventCreate = _sig("cuEventCreate", ctypes.POINTER(vp), ctypes.c_uint)
cuEventRecord = _sig("cuEventRecord", vp, vp)
cuEventDestroy = _sig("cuEventDestroy_v2", vp)
cuStreamWaitEvent = _sig("cuStreamWaitEvent", vp, vp, ctypes.c_uint)
cuMemcpyHtoDAsync = _sig("cuMemcpyHtoDAsync_v2", u64, vp, sz, vp)
cuMemPoolCreate = _sig("cuMemPoolCreate", ctypes.POINTER(vp), ctypes.POINTER(PoolProps))
cuMemPoolGetAttribute = _sig("cuMemPoolGetAttribute", vp, ctypes.c_int, vp)
cuMemPoolSetAttribute = _sig("cuMemPoolSetAttribute", vp, ctypes.c_int, vp)
cuMemPoolTrimTo = _sig("cuMemPoolTrimTo", vp, sz)
cuMemPoolSetAccess = _sig("cuMemPoolSetAccess", vp, ctypes.POINTER(Access), sz)
cuMemPoolExportToShareableHandle = _sig("cuMemPoolExportToShareableHandle", vp, vp, ctypes.c_int, u64)
cuDeviceGetDefaultMemPool = _sig("cuDeviceGetDefaultMemPool", ctypes.POINTER(vp), ctypes.c_int)
cuMemPoolDestroy = _sig("cuMemPoolDestroy", vp)
cuStreamBeginCapture = _sig("cuStreamBeginCapture_v2", vp, ctypes.c_int)
cuStreamEndCapture = _sig("cuStreamEndCapture", vp, ctypes.POINTER(vp))
cuStreamIsCapturing = _sig("cuStreamIsCapturing", vp, ctypes.POINTER(ctypes.c_int))
cuGraphDestroy = _sig("cuGraphDestroy", vp)
cuDeviceGetGraphMemAttribute = _sig("cuDeviceGetGraphMemAttribute", ctypes.c_int, ctypes.c_int, vp)
GRAPH_ATTR = {"used": 0, "used_high": 1, "reserved": 2, "reserved_high": 3}
CAPTURE_RELAXED = 2
if SIM:   # simcuda's stream-ordering model (a test double's introspection, not CUDA)
    simcudaStreamPosition = _sig("simcudaStreamPosition", vp, ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong))
    simcudaStreamOrdered = _sig("simcudaStreamOrdered", vp, ctypes.c_ulonglong, ctypes.c_ulonglong)


class App:
    def __init__(self, sizes: list[int], pool_sizes: list[int], nstreams: int, seed: int) -> None:
        check(cuInit(0), "cuInit")
        self.ctx = vp()
        check(cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "ctx")
        check(cuCtxSetCurrent(self.ctx), "set ctx")
        self.streams = []
        for _ in range(max(2, nstreams)):
            s = vp()
            check(cuStreamCreate(ctypes.byref(s), 1), "stream")
            self.streams.append(s)
        self.default = vp()
        check(cuDeviceGetDefaultMemPool(ctypes.byref(self.default), 0), "default pool")
        self.pool = vp()
        props = PoolProps(allocType=1, handleTypes=0, loc=Loc(1, 0))
        check(cuMemPoolCreate(ctypes.byref(self.pool), ctypes.byref(props)), "cuMemPoolCreate")
        # the pools keep what they reserve between synchronises (as PyTorch sets its pool)
        self._set(self.default, ATTR["threshold"], 1 << 62)
        self.bufs: list[tuple[int, int, vp]] = []   # (pointer, bytes, stream)
        for i, n in enumerate(sizes):
            self.bufs.append((self._alloc(n, self.streams[i % len(self.streams)]), n, self.streams[i % len(self.streams)]))
        for i, n in enumerate(pool_sizes):
            s = self.streams[i % len(self.streams)]
            self.bufs.append((self._alloc(n, s, self.pool), n, s))
        for i, (p, n, s) in enumerate(self.bufs):
            data = hashlib.shake_256((seed + i).to_bytes(8, "little")).digest(min(n, 1 << 16))
            block = ctypes.create_string_buffer((data * (n // len(data) + 1))[:n], n)
            check(cuMemcpyHtoDAsync(p, block, n, s), "fill")
            check(cuStreamSynchronize(s), "sync")   # the host buffer must outlive the copy
        self.npool = len(pool_sizes)   # the last buffers are the explicit pool's
        self.usage_pool = vp()
        self.ipc_pools: list[vp] = []
        self.loop_stop = threading.Event()
        self.loop_threads: list[threading.Thread] = []
        self.loop_rounds = 0
        self.loop_error: str | None = None

    def _alloc(self, n: int, s: vp, pool: vp | None = None) -> int:
        p = u64()
        if pool is None:
            check(cuMemAllocAsync(ctypes.byref(p), n, s), f"cuMemAllocAsync({n})")
        else:
            check(cuMemAllocFromPoolAsync(ctypes.byref(p), n, pool, s), f"cuMemAllocFromPoolAsync({n})")
        return p.value

    def _get(self, pool: vp, attr: int) -> int:
        v = u64()
        check(cuMemPoolGetAttribute(pool, attr, ctypes.byref(v)), "cuMemPoolGetAttribute")
        return v.value

    def _set(self, pool: vp, attr: int, value: int, size=u64) -> None:
        v = size(value)
        check(cuMemPoolSetAttribute(pool, attr, ctypes.byref(v)), "cuMemPoolSetAttribute")

    def _position(self, s: vp) -> tuple[int, int]:
        i, q = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        check(simcudaStreamPosition(s, ctypes.byref(i), ctypes.byref(q)), "position")
        return i.value, q.value

    def digest(self) -> dict:
        h = hashlib.sha256()
        for p, n, _ in self.bufs:
            buf = ctypes.create_string_buffer(n)
            check(cuMemcpyDtoH(buf, p, n), "read back")
            h.update(buf.raw)
        return {"digest": h.hexdigest(), "ptrs": [p for p, _, _ in self.bufs]}

    def work(self, v: int) -> None:
        for p, n, s in self.bufs:
            arr = (ctypes.c_uint32 * (n // 4))()
            check(cuStreamSynchronize(s), "sync")
            check(cuMemcpyDtoH(arr, p, n // 4 * 4), "read")
            for i in range(len(arr)):
                arr[i] = (arr[i] + v) & 0xFFFFFFFF
            check(cuMemcpyHtoDAsync(p, arr, n // 4 * 4, s), "write")
            check(cuStreamSynchronize(s), "sync")

    def churn(self, n: int) -> None:
        sizes = [512, 4096, 65536, 1 << 20, 3 << 20, 4 << 20]
        for k in range(n):
            for i, s in enumerate(self.streams):
                p = self._alloc(sizes[(k + i) % len(sizes)], s)
                check(cuMemFreeAsync(p, s), "free")

    def reuse_cross(self, internal: int | None, sync_first: bool, opportunistic: int = 1) -> dict:
        s0, s1 = self.streams[0], self.streams[1]
        if internal is not None:
            self._set(self.default, 3, internal, ctypes.c_int)
        self._set(self.default, 2, opportunistic, ctypes.c_int)
        a = self._alloc(3 << 20, s0)
        # work on stream 0 that uses the block, then its free: stream 1 may have it only after both
        src = ctypes.create_string_buffer(b"\x5a" * (3 << 20), 3 << 20)
        check(cuMemcpyHtoDAsync(a, src, 3 << 20, s0), "write")
        check(cuMemFreeAsync(a, s0), "free")
        pos = self._position(s0) if SIM else None
        if sync_first:
            check(cuStreamSynchronize(s0), "sync")
        b = self._alloc(3 << 20, s1)
        ordered = bool(simcudaStreamOrdered(s1, *pos)) if SIM else None
        check(cuMemFreeAsync(b, s1), "free")
        check(cuCtxSynchronize(), "sync")
        if internal is not None:
            self._set(self.default, 3, 1, ctypes.c_int)
        self._set(self.default, 2, 1, ctypes.c_int)
        return {"same": a == b, "ordered": ordered}

    def capture_free(self) -> dict:
        """Free a buffer allocated outside any capture while stream 0 captures: CUDA refuses it (a free
        node takes only a graph allocation), the capture goes on; the buffer stays the app's."""
        s, status, graph = self.streams[0], ctypes.c_int(-1), vp()
        check(cuStreamBeginCapture(s, CAPTURE_RELAXED), "cuStreamBeginCapture")
        free_rc = cuMemFreeAsync(self.bufs[0][0], s)
        check(cuStreamIsCapturing(s, ctypes.byref(status)), "cuStreamIsCapturing")
        end_rc = cuStreamEndCapture(s, ctypes.byref(graph))
        if graph.value:
            check(cuGraphDestroy(graph), "cuGraphDestroy")
        return {"free_rc": free_rc, "status": status.value, "end_rc": end_rc}

    def graph(self, keep: int, cached: int) -> dict:
        """Graph memory nodes by stream capture: one allocation the graph leaves allocated (the app's
        after the graph is gone), one it frees (cached for graphs once the graph is destroyed)."""
        s, graph, a, b = self.streams[1], vp(), u64(), u64()
        check(cuStreamBeginCapture(s, CAPTURE_RELAXED), "cuStreamBeginCapture")
        check(cuMemAllocAsync(ctypes.byref(a), keep, s), "cuMemAllocAsync (captured)")
        check(cuMemAllocAsync(ctypes.byref(b), cached, s), "cuMemAllocAsync (captured)")
        check(cuMemFreeAsync(b, s), "cuMemFreeAsync (captured)")
        check(cuStreamEndCapture(s, ctypes.byref(graph)), "cuStreamEndCapture")
        check(cuGraphDestroy(graph), "cuGraphDestroy")
        return {"kept": a.value}

    def _churn_thread(self, k: int, n: int) -> None:
        """Stream k allocates, writes and checks a block, then hands its free to stream k+1 (which waits
        on an event for the work): blocks move between streams while others allocate."""
        try:
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            mine, nxt = self.loop_streams[k], self.loop_streams[(k + 1) % n]
            ev = vp()
            check(cuEventCreate(ctypes.byref(ev), 2), "event")
            sizes = [4096, 300 << 10, 1 << 20, 3 << 20]
            r = 0
            while not self.loop_stop.is_set():
                size = sizes[(r + k) % len(sizes)]
                p = self._alloc(size, mine)
                pattern = bytes([(r * 7 + k) & 0xFF]) * size
                src, back = ctypes.create_string_buffer(pattern, size), ctypes.create_string_buffer(size)
                check(cuMemcpyHtoDAsync(p, src, size, mine), "write")
                check(cuStreamSynchronize(mine), "sync")
                check(cuMemcpyDtoH(back, p, size), "read")
                if back.raw != pattern:
                    raise RuntimeError(f"thread {k} round {r}: block {p:#x} does not hold what was written")
                check(cuEventRecord(ev, mine), "record")
                check(cuStreamWaitEvent(nxt, ev, 0), "wait")
                check(cuMemFreeAsync(p, nxt), "free on the next stream")
                r += 1
                self.loop_rounds += 1
            check(cuEventDestroy(ev), "event destroy")
        except Exception as exc:
            self.loop_error = self.loop_error or f"{type(exc).__name__}: {exc}"

    def reuse_per_thread(self) -> dict:
        n, out = 3 << 20, {}

        def other() -> None:
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            p = u64()
            check(cuMemAllocAsync_ptsz(ctypes.byref(p), n, None), "alloc (per-thread stream)")
            src = ctypes.create_string_buffer(b"\x33" * n, n)
            check(cuMemcpyHtoDAsync_ptsz(p.value, src, n, None), "write (per-thread stream)")
            check(cuMemFreeAsync_ptsz(p.value, None), "free (per-thread stream)")
            out["a"], out["pos"] = p.value, self._position(PER_THREAD) if SIM else None
        t = threading.Thread(target=other)
        t.start()
        t.join()
        q = u64()
        check(cuMemAllocAsync_ptsz(ctypes.byref(q), n, None), "alloc (this thread's per-thread stream)")
        ordered = bool(simcudaStreamOrdered(PER_THREAD, *out["pos"])) if SIM else None
        check(cuMemFreeAsync_ptsz(q.value, None), "free")
        check(cuCtxSynchronize(), "sync")
        return {"same": q.value == out["a"], "ordered": ordered}

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "digest":
            return self.digest()
        if cmd == "work":
            self.work(int(words[1]))
            return {"ok": True}
        if cmd == "churn":
            self.churn(int(words[1]))
            return {"ok": True}
        if cmd == "reuse-same":
            s = self.streams[0]
            a = self._alloc(1 << 20, s)
            check(cuMemFreeAsync(a, s), "free")
            b = self._alloc(1 << 20, s)
            check(cuMemFreeAsync(b, s), "free")
            return {"same": a == b}
        if cmd == "reuse-cross":
            return self.reuse_cross(int(words[1]) if len(words) > 1 else None, False)
        if cmd == "reuse-after-sync":
            return self.reuse_cross(0, True, int(words[1]) if len(words) > 1 else 1)
        if cmd == "capture-free":
            return self.capture_free()
        if cmd == "graph":
            return self.graph(parse_size(words[1]), parse_size(words[2]))
        if cmd == "graph-mem":
            out = {}
            for k, a in GRAPH_ATTR.items():
                v = u64()
                check(cuDeviceGetGraphMemAttribute(0, a, ctypes.byref(v)), "cuDeviceGetGraphMemAttribute")
                out[k] = v.value
            return out
        if cmd == "pool-destroy":
            check(cuMemPoolDestroy(self.pool), "cuMemPoolDestroy")
            return {"ok": True}
        if cmd == "pool-free":
            kept = self.bufs[:len(self.bufs) - self.npool]
            for p, _, s in self.bufs[len(kept):]:
                check(cuMemFreeAsync(p, s), "free")
            self.bufs, self.npool = kept, 0
            return {"ok": True}
        if cmd == "usage-pool":
            props = PoolProps(allocType=1, handleTypes=0, loc=Loc(1, 0), usage=2)   # HW_DECOMPRESS
            check(cuMemPoolCreate(ctypes.byref(self.usage_pool), ctypes.byref(props)), "cuMemPoolCreate (usage)")
            self._set(self.usage_pool, ATTR["threshold"], 1 << 62)
            p = self._alloc(int(words[1]) << 20, self.streams[0], self.usage_pool)
            check(cuMemFreeAsync(p, self.streams[0]), "free")
            check(cuCtxSynchronize(), "sync")
            return {"ok": True}
        if cmd == "usage-attrs":
            return {k: self._get(self.usage_pool, ATTR[k]) for k in ("used", "reserved")}
        if cmd == "reuse-per-thread":
            return self.reuse_per_thread()
        if cmd == "attrs":
            return {name: {k: self._get(pool, a) for k, a in ATTR.items()}
                    for name, pool in (("default", self.default), ("explicit", self.pool))}
        if cmd == "threshold":
            self._set(self.default, ATTR["threshold"], parse_size(words[1]))
            return {"ok": True}
        if cmd == "trim":
            check(cuMemPoolTrimTo(self.default, parse_size(words[1])), "cuMemPoolTrimTo")
            return {"ok": True}
        if cmd == "sync":
            check(cuCtxSynchronize(), "sync")
            return {"ok": True}
        if cmd == "loop" and words[1] == "start":
            n = int(words[2]) if len(words) > 2 else 3
            self.loop_stop.clear()
            self.loop_streams = []
            for _ in range(n):
                s = vp()
                check(cuStreamCreate(ctypes.byref(s), 1), "stream")
                self.loop_streams.append(s)
            self.loop_threads = [threading.Thread(target=self._churn_thread, args=(k, n), daemon=True) for k in range(n)]
            for t in self.loop_threads:
                t.start()
            return {"started": n}
        if cmd == "loop" and words[1] == "stop":
            self.loop_stop.set()
            for t in self.loop_threads:
                t.join()
            check(cuCtxSynchronize(), "sync")
            return {"rounds": self.loop_rounds, "error": self.loop_error}
        if cmd == "peer-access":
            acc = Access(loc=Loc(1, int(words[1])), flags=3 if words[2] == "on" else 0)
            check(cuMemPoolSetAccess(self.default, ctypes.byref(acc), 1), "cuMemPoolSetAccess")
            return {"ok": True}
        if cmd == "peer-write":
            peer = vp()
            check(cuDevicePrimaryCtxRetain(ctypes.byref(peer), int(words[1])), "peer ctx")
            p, n, _ = self.bufs[0]
            check(cuCtxSetCurrent(peer), "set peer ctx")
            rc = cuMemsetD32(p, int(words[2]), n // 4)
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            word = ctypes.c_uint32()
            if rc == 0:
                check(cuMemcpyDtoH(ctypes.byref(word), p, 4), "read")
            return {"rc": rc, "word": word.value if rc == 0 else None}
        if cmd == "ipc-pool":
            pool = vp()
            props = PoolProps(allocType=1, handleTypes=1, loc=Loc(1, 0))
            check(cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(props)), "cuMemPoolCreate (POSIX fd)")
            p = self._alloc(int(words[1]) << 20, self.streams[0], pool)
            fd = ctypes.c_int(-1)
            check(cuMemPoolExportToShareableHandle(ctypes.byref(fd), pool, 1, 0), "export pool")
            self.ipc_pools.append(pool)
            return {"ptr": p, "fd": fd.value}
        raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8M,3M,64K,1000", help="default-pool buffers, comma-separated (K/M/G suffixes)")
    ap.add_argument("--pool-sizes", default="6M,100K", help="explicit-pool buffers")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    pool_sizes = [parse_size(s) for s in a.pool_sizes.split(",") if s]
    app = App(sizes, pool_sizes, a.streams, a.seed)
    serve(app.handle, {"simulated": SIM})


if __name__ == "__main__":
    main()
