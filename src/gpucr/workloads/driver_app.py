"""A CUDA driver-API application written with ctypes, like a plain C++ program would be.

On simcuda (the simulated driver, a test double) its kernels are simcuda's builtins; on a real GPU
it does the same through copies and memsets. Allocations: plain cuMemAlloc buffers of the given
sizes, a pitched one, and (with --vmm) the application's own VMM range mapped in 2 MiB handles, the
way PyTorch's expandable segments do.

Commands: digest | work N | loop start | loop stop | spin MS | free I | alloc BYTES | quit |
poll start [MS] | poll counts | poll stop (a thread per family of queries, synchronizes and event records), and for
several GPUs: device D BYTES [vmm] (a buffer on device D, plain or the application's own VMM) |
peer on|off (device 1 gets or loses peer access to device 0's plain allocations) | peer-add I
(device 1 adds 0 to buffer I in a kernel: simcuda only) | uuids (each device's UUID, as this process sees it),
and contexts: ctx-keep N BYTES (N more contexts, each with a buffer of BYTES, kept) | ctx-temp BYTES (a
context of its own, BYTES and a small buffer allocated in it, then destroyed) | reset (cuDevicePrimaryCtxReset, as cudaDeviceReset; then every buffer made again),
and exports: vmm-export MIB (its own VMM made without any handle type, then exported as a POSIX fd) |
export-shared I (export the handle of shared buffer I again: one this process imported too) | meminfo
(cuMemGetInfo) | many N BYTES (N more plain allocations, unfilled) | free-many | buffers (each buffer's
address, size and sha256)
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import threading
from typing import Iterator

from ..driver import uuid_text
from .polling import Pollers
from .protocol import serve

cu = ctypes.CDLL("libcuda.so.1")
SIM = hasattr(cu, "simcudaIsSimulated")
u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
HOST_STEP = 64 << 20   # bytes through the host at a time when a buffer is filled or read back


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handleTypes", ctypes.c_int), ("loc", Loc), ("win32", vp),
                ("flags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]


def _sig(name, *args):
    f = getattr(cu, name)
    f.argtypes, f.restype = list(args), ctypes.c_int
    return f


cuInit = _sig("cuInit", ctypes.c_uint)
cuDevicePrimaryCtxRetain = _sig("cuDevicePrimaryCtxRetain", ctypes.POINTER(vp), ctypes.c_int)
cuDeviceGetUuid = _sig("cuDeviceGetUuid_v2", ctypes.c_char_p, ctypes.c_int)
cuDeviceGetCount = _sig("cuDeviceGetCount", ctypes.POINTER(ctypes.c_int))
cuCtxEnablePeerAccess = _sig("cuCtxEnablePeerAccess", vp, ctypes.c_uint)
cuCtxDisablePeerAccess = _sig("cuCtxDisablePeerAccess", vp)
cuCtxCreate = _sig("cuCtxCreate_v2", ctypes.POINTER(vp), ctypes.c_uint, ctypes.c_int)
cuCtxDestroy = _sig("cuCtxDestroy_v2", vp)
cuDevicePrimaryCtxReset = _sig("cuDevicePrimaryCtxReset_v2", ctypes.c_int)
cuCtxSetCurrent = _sig("cuCtxSetCurrent", vp)
cuMemAlloc = _sig("cuMemAlloc_v2", ctypes.POINTER(u64), sz)
cuMemAllocPitch = _sig("cuMemAllocPitch_v2", ctypes.POINTER(u64), ctypes.POINTER(sz), sz, sz, ctypes.c_uint)
cuMemFree = _sig("cuMemFree_v2", u64)
cuMemcpyHtoD = _sig("cuMemcpyHtoD_v2", u64, vp, sz)
cuMemcpyDtoH = _sig("cuMemcpyDtoH_v2", vp, u64, sz)
cuMemsetD32 = _sig("cuMemsetD32_v2", u64, ctypes.c_uint, sz)
cuCtxSynchronize = _sig("cuCtxSynchronize")
cuMemAddressReserve = _sig("cuMemAddressReserve", ctypes.POINTER(u64), sz, sz, u64, u64)
cuMemCreate = _sig("cuMemCreate", ctypes.POINTER(u64), sz, ctypes.POINTER(Prop), u64)
cuMemMap = _sig("cuMemMap", u64, sz, sz, u64, u64)
cuMemSetAccess = _sig("cuMemSetAccess", u64, sz, ctypes.POINTER(Access), sz)
cuMemRelease = _sig("cuMemRelease", u64)
cuMemAllocManaged = _sig("cuMemAllocManaged", ctypes.POINTER(u64), sz, ctypes.c_uint)
cuIpcGetMemHandle = _sig("cuIpcGetMemHandle", ctypes.c_char_p, u64)
cuMemExportToShareableHandle = _sig("cuMemExportToShareableHandle", vp, u64, ctypes.c_int, u64)
cuMemImportFromShareableHandle = _sig("cuMemImportFromShareableHandle", ctypes.POINTER(u64), vp, ctypes.c_int)
cuMemGetInfo = _sig("cuMemGetInfo_v2", ctypes.POINTER(sz), ctypes.POINTER(sz))
cuEventCreate = _sig("cuEventCreate", ctypes.POINTER(vp), ctypes.c_uint)
cuEventRecord = _sig("cuEventRecord", vp, vp)
cuEventQuery = _sig("cuEventQuery", vp)
cuEventSynchronize = _sig("cuEventSynchronize", vp)
cuStreamQuery = _sig("cuStreamQuery", vp)
cuStreamSynchronize = _sig("cuStreamSynchronize", vp)
# outside gpucr's table of wrapped calls, and held by the driver's lock like any call into a context
cuStreamIsCapturing = _sig("cuStreamIsCapturing", vp, ctypes.POINTER(ctypes.c_int))
CUDA_ERROR_NOT_READY = 600


class MulticastProp(ctypes.Structure):
    _fields_ = [("numDevices", ctypes.c_uint), ("size", sz), ("handleTypes", ctypes.c_ulonglong),
                ("flags", ctypes.c_ulonglong)]


if SIM:
    cuModuleLoadData = _sig("cuModuleLoadData", ctypes.POINTER(vp), ctypes.c_char_p)
    cuModuleGetFunction = _sig("cuModuleGetFunction", ctypes.POINTER(vp), vp, ctypes.c_char_p)
    cuLaunchKernel = _sig("cuLaunchKernel", vp, *([ctypes.c_uint] * 7), vp, ctypes.POINTER(vp), ctypes.POINTER(vp))


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


class DriverPollers(Pollers):
    """Stream and event queries, synchronizes and event records on the driver API."""

    FAMILIES = ("stream-query", "event-query", "ctx-sync", "stream-sync", "event-sync", "event-record")
    DEFAULT_MS = 2.0

    def __init__(self, ctx: vp) -> None:
        super().__init__()
        self.ctx = ctx

    def enter(self) -> vp:
        check(cuCtxSetCurrent(self.ctx), "set ctx")   # a new thread enters the context, then calls into it
        ev = vp()
        check(cuEventCreate(ctypes.byref(ev), 0), "event")
        check(cuEventRecord(ev, None), "record")
        return ev

    def call(self, family: str, ev: vp) -> None:
        calls = {"stream-query": lambda: cuStreamQuery(None), "event-query": lambda: cuEventQuery(ev),
                 "ctx-sync": cuCtxSynchronize, "stream-sync": lambda: cuStreamSynchronize(None),
                 "event-sync": lambda: cuEventSynchronize(ev), "event-record": lambda: cuEventRecord(ev, None)}
        rc = calls[family]()
        if rc not in (0, CUDA_ERROR_NOT_READY):
            raise RuntimeError(f"CUDA error {rc}")


class LateEntry:
    """`enter start`: a new thread whose first CUDA call enters the context (cuCtxSetCurrent), then queries the
    stream, as a thread an engine starts late does; `enter state` says which of the two have returned, and with what."""

    def __init__(self, ctx: vp) -> None:
        self.ctx = ctx
        self.returned: dict[str, int] = {}

    def _run(self) -> None:
        self.returned["set_current"] = cuCtxSetCurrent(self.ctx)
        self.returned["stream_query"] = cuStreamQuery(None)

    def command(self, word: str) -> dict:
        if word == "start":
            self.returned = {}
            threading.Thread(target=self._run, daemon=True).start()
        return {"returned": dict(self.returned)}


class App:
    def __init__(self, sizes: list[int], pitch: bool, vmm_mib: int, seed: int, vmm_rdma: bool = False) -> None:
        check(cuInit(0), "cuInit")
        self.vmm_rdma = vmm_rdma
        self.ctx = vp()
        check(cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "ctx")
        check(cuCtxSetCurrent(self.ctx), "set ctx")
        self.bufs: list[tuple[int, int]] = []   # (device pointer, bytes)
        self.shared: list[tuple[int, int]] = []  # buffers shared with other processes (share / import), in order
        self.handles: dict[int, int] = {}         # a shared buffer's address -> the handle this process holds of it
        self.many: list[int] = []                 # allocations made by "many"
        self.ctxs = {0: self.ctx}                 # device ordinal -> its primary context
        self.buf_dev: dict[int, int] = {}         # device pointer -> device, for buffers not on device 0
        for i, n in enumerate(sizes):
            self.bufs.append((self._alloc(n), n))
        if pitch:
            p, pitch_b = u64(), sz()
            check(cuMemAllocPitch(ctypes.byref(p), ctypes.byref(pitch_b), 3000, 700, 4), "pitch")
            self.bufs.append((p.value, pitch_b.value * 700))
        if vmm_mib:
            self.bufs.append((self._vmm(vmm_mib << 20), vmm_mib << 20))
        self.seed = seed
        for i, (p, n) in enumerate(self.bufs):
            self._fill(p, n, seed + i)
        check(cuCtxSynchronize(), "sync")
        if SIM:
            self.mod, self.add = vp(), vp()
            check(cuModuleLoadData(ctypes.byref(self.mod), b"simcuda-builtin"), "module")
            check(cuModuleGetFunction(ctypes.byref(self.add), self.mod, b"add_u32"), "add_u32")
            self.spin_fn = vp()
            check(cuModuleGetFunction(ctypes.byref(self.spin_fn), self.mod, b"spin_ms"), "spin_ms")
        self.loop_thread: threading.Thread | None = None
        self.loop_stop = threading.Event()
        self.loop_iters = 0
        self.loop_error: str | None = None
        self.pollers = DriverPollers(self.ctx)
        self.late = LateEntry(self.ctx)

    def _alloc(self, n: int) -> int:
        p = u64()
        check(cuMemAlloc(ctypes.byref(p), n), f"cuMemAlloc({n})")
        return p.value

    def _ctx_of(self, dev: int) -> vp:
        if dev not in self.ctxs:
            c = vp()
            check(cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), f"ctx of device {dev}")
            self.ctxs[dev] = c
        return self.ctxs[dev]

    def _vmm(self, n: int, dev: int = 0) -> int:
        gran = 2 << 20
        va = u64()
        check(cuMemAddressReserve(ctypes.byref(va), n, 0, 0, 0), "reserve")
        prop = Prop(type=1, handleTypes=0, loc=Loc(1, dev))
        prop.flags[1] = int(self.vmm_rdma)   # allocFlags.gpuDirectRDMACapable, as PyTorch's expandable segments ask
        acc = Access(loc=Loc(1, dev), flags=3)
        for off in range(0, n, gran):
            h = u64()
            check(cuMemCreate(ctypes.byref(h), gran, ctypes.byref(prop), 0), "create")
            check(cuMemMap(va.value + off, gran, 0, h.value, 0), "map")
            check(cuMemSetAccess(va.value + off, gran, ctypes.byref(acc), 1), "access")
            check(cuMemRelease(h.value), "release")   # the mapping keeps it, as PyTorch does
        return va.value

    def _vmm_one(self, n: int, handle_types: int = 0) -> tuple[int, int]:
        va, h = u64(), u64()
        check(cuMemAddressReserve(ctypes.byref(va), n, 0, 0, 0), "reserve")
        prop = Prop(type=1, handleTypes=handle_types, loc=Loc(1, 0))
        check(cuMemCreate(ctypes.byref(h), n, ctypes.byref(prop), 0), "create")
        check(cuMemMap(va.value, n, 0, h.value, 0), "map")
        acc = Access(loc=Loc(1, 0), flags=3)
        check(cuMemSetAccess(va.value, n, ctypes.byref(acc), 1), "access")
        return va.value, h.value

    def share(self, n: int, seed: int = 99) -> tuple[int, int]:
        """n bytes of VMM memory made exportable, filled and exported as a POSIX fd: (address, fd)."""
        va, h = self._vmm_one(n, handle_types=1)
        self._fill(va, n, seed)
        fd = ctypes.c_int(-1)
        check(cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, 0), "export")
        self._keep_shared(va, n, h)
        return va, fd.value

    def import_fd(self, fd: int, n: int) -> int:
        """Another process's exported memory of n bytes (a POSIX fd of it, left open) mapped here: its address."""
        h = u64()
        check(cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1), "import")
        va = u64()
        check(cuMemAddressReserve(ctypes.byref(va), n, 0, 0, 0), "reserve")
        check(cuMemMap(va.value, n, 0, h.value, 0), "map")
        acc = Access(loc=Loc(1, 0), flags=3)
        check(cuMemSetAccess(va.value, n, ctypes.byref(acc), 1), "access")
        self._keep_shared(va.value, n, h.value)
        return va.value

    def _keep_shared(self, va: int, n: int, h: int) -> None:
        self.shared.append((va, n))
        self.bufs.append((va, n))
        self.handles[va] = h

    def _export(self, va: int) -> dict:
        fd = ctypes.c_int(-1)
        rc = cuMemExportToShareableHandle(ctypes.byref(fd), self.handles[va], 1, 0)
        return {"rc": rc, "fd": fd.value, "va": va, "index": next(i for i, (v, _) in enumerate(self.shared) if v == va)}

    def _fill(self, p: int, n: int, seed: int) -> None:
        """A 64 KiB pattern of the seed, repeated over the buffer; written 64 MiB at a time, so a buffer of
        many GiB needs no host copy of its size."""
        data = hashlib.shake_256(seed.to_bytes(8, "little")).digest(min(n, 1 << 16))
        block = data * (min(n, HOST_STEP) // len(data) + 1)   # the pattern's period divides HOST_STEP
        for off in range(0, n, HOST_STEP):
            k = min(HOST_STEP, n - off)
            check(cuMemcpyHtoD(p + off, block, k), "fill")

    def _read(self, p: int, n: int) -> Iterator[bytes]:
        """A buffer's bytes, HOST_STEP at a time (through one host buffer of that size)."""
        buf = ctypes.create_string_buffer(min(n, HOST_STEP))
        for off in range(0, n, HOST_STEP):
            k = min(HOST_STEP, n - off)
            check(cuMemcpyDtoH(buf, p + off, k), "read back")
            yield buf.raw[:k]

    def digest(self) -> str:
        h = hashlib.sha256()
        for p, n in self.bufs:
            check(cuCtxSetCurrent(self.ctxs[self.buf_dev.get(p, 0)]), "set ctx")   # read in the owner's context
            for part in self._read(p, n):
                h.update(part)
        check(cuCtxSetCurrent(self.ctx), "set ctx")
        return h.hexdigest()

    def _add(self, p: int, n: int, v: int) -> None:
        if SIM:
            args = [u64(p), ctypes.c_uint(v & 0xFFFFFFFF), u64(n // 4)]
            params = (vp * 3)(*[ctypes.cast(ctypes.byref(a), vp) for a in args])
            check(cuLaunchKernel(self.add, 1, 1, 1, 1, 1, 1, 0, None, params, None), "add_u32")
        else:  # no kernels of our own on a real GPU: read, add, write back
            arr = (ctypes.c_uint32 * (n // 4))()
            check(cuMemcpyDtoH(arr, p, n), "read")
            for i in range(len(arr)):
                arr[i] = (arr[i] + v) & 0xFFFFFFFF
            check(cuMemcpyHtoD(p, arr, n), "write")

    def work(self, v: int) -> None:
        for p, n in self.bufs:
            self._add(p, n, v)
        check(cuCtxSynchronize(), "sync")

    def _loop(self) -> None:
        # +1 then -1 on the first buffer, as fast as possible: a lost or doubled launch shows in the digest
        check(cuCtxSetCurrent(self.ctx), "set ctx")
        p, n = self.bufs[0]
        try:
            while not self.loop_stop.is_set():
                self._add(p, n, 1)
                self._add(p, n, -1)
                self.loop_iters += 1
        except Exception as exc:  # reported by "loop stop"
            self.loop_error = str(exc)

    def spin(self, ms: int) -> None:
        def run() -> None:
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            arg = ctypes.c_uint(ms)
            params = (vp * 1)(ctypes.cast(ctypes.byref(arg), vp))
            check(cuLaunchKernel(self.spin_fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "spin_ms")
        threading.Thread(target=run, daemon=True).start()

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "digest":
            return {"digest": self.digest(), "ptrs": [p for p, _ in self.bufs], "bytes": sum(n for _, n in self.bufs)}
        if cmd == "work":
            self.work(int(words[1]))
            return {"done": True}
        if cmd == "loop" and words[1] == "start":
            self.loop_stop.clear()
            self.loop_iters = 0
            self.loop_thread = threading.Thread(target=self._loop, daemon=True)
            self.loop_thread.start()
            return {"started": True}
        if cmd == "loop" and words[1] == "stop":
            self.loop_stop.set()
            if self.loop_thread:
                self.loop_thread.join()
            return {"iterations": self.loop_iters, "error": self.loop_error}
        if cmd == "capturing":   # a call the agent does not wrap (as cuBLAS makes before a launch)
            status = ctypes.c_int(-1)
            check(cuStreamIsCapturing(None, ctypes.byref(status)), "cuStreamIsCapturing")
            return {"capturing": status.value}
        if cmd == "poll":   # poll start [MS] | poll counts | poll stop: a thread per family of GPU-watching calls
            return self.pollers.command(words[1:])
        if cmd == "enter":   # enter start | enter state: a thread started now enters the context and queries
            return self.late.command(words[1])
        if cmd == "churn" and words[1] == "start":   # threads that allocate, fill, check and free in a loop
            self.churn_stop = threading.Event()
            self.churn_stats = {"cycles": 0, "errors": []}

            def churn(seed: int) -> None:
                check(cuCtxSetCurrent(self.ctx), "set ctx")
                n = (3 << 20) + seed * 4096   # converted to VMM (>= 2 MiB), odd sizes
                while not self.churn_stop.is_set():
                    try:
                        p = self._alloc(n)
                        self._fill(p, n, seed)
                        want = hashlib.shake_256(seed.to_bytes(8, "little")).digest(min(n, 1 << 16))
                        got = ctypes.create_string_buffer(len(want))
                        check(cuMemcpyDtoH(got, p, len(want)), "read")
                        if got.raw != want:
                            self.churn_stats["errors"].append("wrong bytes")
                        check(cuMemFree(p), "free")
                        self.churn_stats["cycles"] += 1
                    except Exception as exc:
                        self.churn_stats["errors"].append(str(exc))
                        return
            self.churn_threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(int(words[2]))]
            for t in self.churn_threads:
                t.start()
            return {"started": len(self.churn_threads)}
        if cmd == "churn" and words[1] == "stop":
            self.churn_stop.set()
            for t in self.churn_threads:
                t.join()
            return dict(self.churn_stats)
        if cmd == "spin":
            self.spin(int(words[1]))
            return {"started": True}
        if cmd == "alloc":
            n = int(words[1])
            p = self._alloc(n)
            self._fill(p, n, len(self.bufs))
            self.bufs.append((p, n))
            return {"ptr": p}
        if cmd == "join":   # join the cut: prepare succeeds (ok), raises (fail) or never returns (hang)
            import gpucr.app
            mode = words[1]
            self.joined = {"prepared": 0, "resumed": 0}

            def prepare() -> None:
                if mode == "fail":
                    raise RuntimeError("not now")
                if mode == "hang":
                    threading.Event().wait()
                self.joined["prepared"] += 1

            def resume() -> None:
                self.joined["resumed"] += 1
            gpucr.app.on_checkpoint(prepare, resume)
            gpucr.app.publish_epoch(int(words[2]) if len(words) > 2 else 0)
            return {"joined": mode}
        if cmd == "joined":
            return dict(self.joined)
        if cmd == "managed":   # managed memory: no CUDA checkpoint can save it
            p = u64()
            check(cuMemAllocManaged(ctypes.byref(p), int(words[1]), 1), "managed")
            self.managed = p.value
            return {"ptr": p.value}
        if cmd == "free-managed":
            check(cuMemFree(self.managed), "free managed")
            return {"freed": self.managed}
        if cmd == "ipc":   # legacy CUDA IPC export of buffer I
            handle = ctypes.create_string_buffer(64)
            rc = cuIpcGetMemHandle(handle, self.bufs[int(words[1])][0])
            return {"rc": rc}
        if cmd == "fork":   # fork SECONDS [cuda]: a child that shares nothing CUDA with us, and sleeps
            pid = os.fork()
            if pid == 0:
                import time
                if "cuda" in words[2:]:   # one CUDA call, as a DataLoader worker touching CUDA by mistake: it fails
                    cuMemAlloc(ctypes.byref(u64()), 1 << 20)
                time.sleep(float(words[1]) if len(words) > 1 else 30)
                os._exit(0)
            return {"child": pid}
        if cmd == "close-fd":   # the exported fd, once the importer has its own copy (as NCCL does)
            os.close(int(words[1]))
            return {"closed": int(words[1])}
        if cmd == "share":   # export MIB of VMM memory as a POSIX fd, for another process to import
            va, fd = self.share(int(words[1]) << 20)
            return {"fd": fd, "va": va, "index": len(self.shared) - 1}
        if cmd == "import":   # import shared memory from another process's fd (pidfd:PID:FD) and map it
            fd = take_fd(words[1])
            try:
                va = self.import_fd(fd, int(words[2]) << 20)
            finally:
                os.close(fd)
            return {"va": va, "index": len(self.shared) - 1}
        if cmd == "multicast":   # a multicast object for one device (NCCL's NVLS makes them): no checkpoint covers it
            prop = MulticastProp(1, 2 << 20, 1, 0)
            h = u64()
            rc = cu.cuMulticastCreate(ctypes.byref(h), ctypes.byref(prop))
            return {"rc": rc}
        if cmd == "share-fabric":   # export MIB of VMM memory as a fabric handle (cross-node sharing)
            n = int(words[1]) << 20
            va, h = self._vmm_one(n, handle_types=8)
            out = ctypes.create_string_buffer(64)
            return {"rc": cuMemExportToShareableHandle(out, h, 8, 0)}
        if cmd == "write-shared":   # write-shared VALUE [I]: a 32-bit value over shared buffer I (default: the last)
            va, n = self.shared[int(words[2]) if len(words) > 2 else -1]
            check(cuMemsetD32(va, int(words[1]), n // 4), "memset")
            check(cuCtxSynchronize(), "sync")
            return {"done": True}
        if cmd == "read-shared":   # read-shared [I]
            va, n = self.shared[int(words[1]) if len(words) > 1 else -1]
            buf = ctypes.create_string_buffer(n)
            check(cuMemcpyDtoH(buf, va, n), "read")
            return {"sha256": hashlib.sha256(buf.raw).hexdigest(), "va": va}
        if cmd == "zero":   # memset buffer I to zero on the device
            p, n = self.bufs[int(words[1])]
            check(cuMemsetD32(p, 0, n // 4), "memset")
            check(cuCtxSynchronize(), "sync")
            return {"zeroed": p}
        if cmd == "device":   # a buffer on another device, in that device's own context
            dev, n = int(words[1]), parse_size(words[2])
            check(cuCtxSetCurrent(self._ctx_of(dev)), "set ctx")
            p = self._vmm(n, dev) if words[3:] == ["vmm"] else self._alloc(n)
            self._fill(p, n, len(self.bufs))
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            self.bufs.append((p, n))
            self.buf_dev[p] = dev
            return {"ptr": p}
        if cmd == "peer":   # device 1's context opens (or closes) its access to device 0's plain allocations
            check(cuCtxSetCurrent(self._ctx_of(1)), "set ctx")
            rc = cuCtxEnablePeerAccess(self.ctx, 0) if words[1] == "on" else cuCtxDisablePeerAccess(self.ctx)
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            return {"rc": rc}
        if cmd == "peer-add":   # a kernel on device 1 that adds 0 to every word of buffer I (simcuda's builtin)
            p, n = self.bufs[int(words[1])]
            check(cuCtxSetCurrent(self._ctx_of(1)), "set ctx")
            if not hasattr(self, "add1"):   # a module belongs to the context it was loaded in
                self.mod1, self.add1 = vp(), vp()
                check(cuModuleLoadData(ctypes.byref(self.mod1), b"simcuda-builtin"), "module")
                check(cuModuleGetFunction(ctypes.byref(self.add1), self.mod1, b"add_u32"), "add_u32")
            args = [u64(p), ctypes.c_uint(0), u64(n // 4)]
            params = (vp * 3)(*[ctypes.cast(ctypes.byref(a), vp) for a in args])
            rc = cuLaunchKernel(self.add1, 1, 1, 1, 1, 1, 1, 0, None, params, None)
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            return {"rc": rc}
        if cmd == "ctx-temp":
            c = vp()
            check(cuCtxCreate(ctypes.byref(c), 0, 0), "create ctx")
            big, small = self._alloc(parse_size(words[1])), self._alloc(4096)
            self._fill(big, parse_size(words[1]), 5)
            check(cuCtxDestroy(c), "destroy ctx")
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            return {"freed_with_context": [big, small]}
        if cmd == "ctx-keep":   # ctx-keep N BYTES: N more contexts on device 0, each with a buffer that is kept
            for _ in range(int(words[1])):
                c = vp()
                check(cuCtxCreate(ctypes.byref(c), 0, 0), "create ctx")
                n = parse_size(words[2])
                p = self._alloc(n)
                self._fill(p, n, self.seed + len(self.bufs))
                self.bufs.append((p, n))
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            return {"buffers": len(self.bufs)}
        if cmd == "reset":   # everything on device 0 is gone; make the same buffers again, with the same contents
            check(cuDevicePrimaryCtxReset(0), "reset")
            self.ctx = vp()
            check(cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "ctx")
            check(cuCtxSetCurrent(self.ctx), "set ctx")
            self.ctxs[0] = self.ctx
            sizes = [n for _, n in self.bufs]
            self.bufs = [(self._alloc(n), n) for n in sizes]
            for i, (p, n) in enumerate(self.bufs):
                self._fill(p, n, self.seed + i)
            if SIM:
                check(cuModuleLoadData(ctypes.byref(self.mod), b"simcuda-builtin"), "module")
                check(cuModuleGetFunction(ctypes.byref(self.add), self.mod, b"add_u32"), "add_u32")
                check(cuModuleGetFunction(ctypes.byref(self.spin_fn), self.mod, b"spin_ms"), "spin_ms")
            return {"ptrs": [p for p, _ in self.bufs]}
        if cmd == "uuids":
            count = ctypes.c_int()
            check(cuDeviceGetCount(ctypes.byref(count)), "count")
            out = []
            for d in range(count.value):
                u = ctypes.create_string_buffer(16)
                check(cuDeviceGetUuid(u, d), "uuid")
                out.append(uuid_text(u.raw))
            return {"uuids": out}
        if cmd == "vmm-export":
            n = int(words[1]) << 20
            va, h = self._vmm_one(n, handle_types=0)
            self._fill(va, n, 77)
            self.shared.append((va, n))
            self.bufs.append((va, n))
            self.handles[va] = h
            return self._export(va)
        if cmd == "export-shared":
            return self._export(self.shared[int(words[1])][0])
        if cmd == "meminfo":
            free, total = sz(), sz()
            check(cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "meminfo")
            return {"free": free.value, "total": total.value}
        if cmd == "many":
            n, size = int(words[1]), int(words[2])
            for _ in range(n):
                self.many.append(self._alloc(size))
            return {"count": len(self.many)}
        if cmd == "cache":   # cache N: hold N bytes free for later, as a caching allocator (PyTorch's) does
            self.many.append(self._alloc(int(words[1])))
            return {"count": len(self.many)}
        if cmd == "alloc-retry":   # as PyTorch allocates: on out-of-memory, free the cache ("cache") and retry once
            n, tries = int(words[1]), 1
            try:
                p = self._alloc(n)
            except RuntimeError as exc:
                if "CUDA error 2" not in str(exc):
                    raise
                self.handle(["free-many"])
                p, tries = self._alloc(n), 2
            self.bufs.append((p, n))
            return {"ptr": p, "tries": tries}
        if cmd == "free-many":
            for p in self.many:
                check(cuMemFree(p), "free")
            self.many.clear()
            return {"count": 0}
        if cmd == "buffers":
            out = []
            for p, n in self.bufs:
                buf = ctypes.create_string_buffer(n)
                check(cuMemcpyDtoH(buf, p, n), "read")
                out.append({"va": p, "bytes": n, "sha256": hashlib.sha256(buf.raw).hexdigest()})
            return {"buffers": out}
        if cmd == "free":
            p, _ = self.bufs.pop(int(words[1]))
            check(cuMemFree(p), "free")
            return {"freed": p}
        raise ValueError(f"unknown command {cmd}")


def take_fd(spec: str) -> int:
    """A copy of another process's file descriptor: 'pidfd:PID:FD' (pidfd_getfd), or a path to open."""
    if not spec.startswith("pidfd:"):
        return os.open(spec, os.O_RDWR)
    _, pid, target = spec.split(":")
    pidfd = os.pidfd_open(int(pid))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(438, pidfd, int(target), 0)   # pidfd_getfd
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd failed")
        return fd
    finally:
        os.close(pidfd)


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8M,3M,64K,1000", help="comma-separated buffer sizes (K/M/G suffixes)")
    ap.add_argument("--pitch", action="store_true")
    ap.add_argument("--vmm-mib", type=int, default=0)
    ap.add_argument("--vmm-rdma", action="store_true", help="the --vmm-mib chunks ask for GPUDirect RDMA (PyTorch's "
                    "expandable segments do, where the GPU has it)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    app = App([parse_size(s) for s in a.sizes.split(",") if s], a.pitch, a.vmm_mib, a.seed, a.vmm_rdma)
    serve(app.handle, {"simulated": SIM})


if __name__ == "__main__":
    main()
