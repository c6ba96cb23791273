"""ctypes binding of the VMM, copy, event and module half of the CUDA driver API (the data plane's; the checkpoint
half and what gpucr reads about the GPU are in driver.py, whose Driver this uses)."""
from __future__ import annotations

import ctypes
from contextlib import suppress
from dataclasses import dataclass
from typing import Iterable

from .driver import CUDA_ERROR_OUT_OF_MEMORY, Driver, DriverError, _sig, uuid_text


class NoRoomForServerContext(DriverError):
    """The GPU has too little free memory for this process's context there (the data plane makes it at its first
    copy): a park's copy waits for the driver's checkpoint to take the process's own context off, then tries again;
    the swap service's room counts it as more than is free."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@dataclass(frozen=True)
class AllocFlags:
    """An allocation's flags that new memory standing for it must have too (CUmemAllocationProp.allocFlags)."""
    rdma: int = 0          # gpuDirectRDMACapable: PyTorch's expandable segments ask for it where the GPU has it
    compression: int = 0   # compressionType
    usage: int = 0


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


POSIX_FD = 1           # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_DEVICE, _PINNED, _READ_WRITE = 1, 1, 3
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_NOT_READY = 600           # CUDA_ERROR_NOT_READY: an event query whose work is still running
_HOST_REGISTER_PORTABLE = 1


class Vmm:
    """The VMM and copy half of the driver API, for the gpucr server's data plane (gpucr.dataplane.mover): one
    context per GPU it serves, memory imported from and exported to other processes as POSIX fds, copies
    between it and pinned host memory, and gpucr's own kernels (gpucr.dataplane.kernels). Each call raises
    DriverError on failure."""

    def __init__(self, drv: Driver) -> None:
        self.drv = drv
        cu = drv._cu
        u64, sz, p, i = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        pu64 = ctypes.POINTER(u64)
        for name, args in (("cuDeviceGetCount", (ctypes.POINTER(i),)), ("cuDeviceGet", (ctypes.POINTER(i), i)),
                           ("cuDeviceGetUuid", (ctypes.c_char_p, i)),
                           ("cuDevicePrimaryCtxRetain", (ctypes.POINTER(p), i)), ("cuDevicePrimaryCtxRelease", (i,)),
                           ("cuCtxSetCurrent", (p,)), ("cuCtxGetCurrent", (ctypes.POINTER(p),)),
                           ("cuMemAddressReserve", (pu64, sz, sz, u64, u64)), ("cuMemAddressFree", (u64, sz)),
                           ("cuMemCreate", (pu64, sz, ctypes.POINTER(_AllocProp), u64)), ("cuMemRelease", (u64,)),
                           ("cuMemMap", (u64, sz, sz, u64, u64)), ("cuMemUnmap", (u64, sz)),
                           ("cuMemSetAccess", (u64, sz, ctypes.POINTER(_AccessDesc), sz)),
                           ("cuMemExportToShareableHandle", (p, u64, i, u64)),
                           ("cuMemImportFromShareableHandle", (pu64, p, i)),
                           ("cuMemHostRegister_v2", (p, sz, ctypes.c_uint)), ("cuMemHostUnregister", (p,)),
                           ("cuMemcpyDtoHAsync_v2", (p, u64, sz, p)), ("cuMemcpyHtoDAsync_v2", (u64, p, sz, p)),
                           ("cuStreamCreate", (ctypes.POINTER(p), ctypes.c_uint)), ("cuStreamSynchronize", (p,)),
                           ("cuStreamDestroy_v2", (p,)),
                           ("cuMemAlloc_v2", (pu64, sz)), ("cuMemFree_v2", (u64,)), ("cuMemcpyAsync", (u64, u64, sz, p)),
                           ("cuMemsetD8Async", (u64, ctypes.c_ubyte, sz, p)),
                           ("cuDeviceCanAccessPeer", (ctypes.POINTER(i), i, i)),
                           ("cuEventCreate", (ctypes.POINTER(p), ctypes.c_uint)), ("cuEventRecord", (p, p)),
                           ("cuEventSynchronize", (p,)), ("cuEventDestroy_v2", (p,)),
                           ("cuStreamWaitEvent", (p, p, ctypes.c_uint)), ("cuEventQuery", (p,)),
                           ("cuMemHostAlloc", (ctypes.POINTER(p), sz, ctypes.c_uint)), ("cuMemFreeHost", (p,)),
                           ("cuMemHostGetDevicePointer_v2", (pu64, p, ctypes.c_uint)),
                           ("cuModuleLoadData", (ctypes.POINTER(p), p)), ("cuModuleUnload", (p,)),
                           ("cuModuleGetFunction", (ctypes.POINTER(p), p, ctypes.c_char_p)),
                           ("cuLaunchKernel", (p, *[ctypes.c_uint] * 7, p, ctypes.POINTER(p), ctypes.POINTER(p)))):
            _sig(cu, name, *args)
        self._cu = cu

    def _ok(self, rc: int, what: str) -> None:
        self.drv._check(rc, what)

    def device_by_uuid(self) -> dict[str, int]:
        """{UUID as NVML writes it: ordinal} of every GPU this process sees."""
        n = ctypes.c_int()
        self._ok(self._cu.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        out = {}
        for k in range(n.value):
            dev, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
            self._ok(self._cu.cuDeviceGet(ctypes.byref(dev), k), "cuDeviceGet")
            self._ok(self._cu.cuDeviceGetUuid(raw, dev.value), "cuDeviceGetUuid")
            out[uuid_text(raw.raw)] = dev.value
        return out

    def retain_context(self, dev: int) -> int:
        """NoRoomForServerContext where the GPU has too little free memory for it."""
        c = ctypes.c_void_p()
        rc, what = self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), f"retaining a context on GPU {dev}"
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise NoRoomForServerContext(what, rc, self.drv._errstr(rc))
        self._ok(rc, what)
        return c.value or 0

    def release_context(self, dev: int) -> None:
        self._ok(self._cu.cuDevicePrimaryCtxRelease(dev), f"releasing the context on GPU {dev}")

    def use(self, ctx: int) -> None:
        self._ok(self._cu.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")

    def current(self) -> int:
        """The calling thread's current context (0: none)."""
        c = ctypes.c_void_p()
        self._ok(self._cu.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return c.value or 0

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._ok(self._cu.cuStreamCreate(ctypes.byref(s), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return s.value or 0

    def destroy_stream(self, stream: int) -> None:
        """A stream of ours gone (it would outlive a context someone else, the application, still holds)."""
        self._ok(self._cu.cuStreamDestroy_v2(ctypes.c_void_p(stream)), "cuStreamDestroy")

    def sync(self, stream: int) -> None:
        self._ok(self._cu.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64()
        self._ok(self._cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), POSIX_FD),
                 "importing GPU memory from its fd")
        return h.value

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self._ok(self._cu.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, 0), "exporting GPU memory as an fd")
        return fd.value

    def create(self, size: int, dev: int, exportable: bool = True, flags: AllocFlags = AllocFlags()) -> int:
        """New device memory; exportable: with the POSIX-fd handle type (the data plane's), else none; `flags`:
        those of the allocation it stands for (GPUDirect RDMA, compression, usage)."""
        prop = _AllocProp(type=_PINNED, requestedHandleTypes=POSIX_FD if exportable else 0,
                          location=_MemLocation(_DEVICE, dev),
                          allocFlags=_AllocFlags(flags.compression, flags.rdma, flags.usage))
        h = ctypes.c_uint64()
        self._ok(self._cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(prop), 0), f"making {size >> 20} MiB on GPU {dev}")
        return h.value

    def release(self, handle: int) -> None:
        self._ok(self._cu.cuMemRelease(handle), "cuMemRelease")

    def map(self, handle: int, size: int, dev: int, also: Iterable[int] = ()) -> int:
        """A fresh address range with the memory mapped read-write for `dev` (and the GPUs `also`, whose
        copy engines then reach it over their link: the server's routes through a neighbour GPU)."""
        va = self.reserve(size)
        try:
            self.map_at(va, handle, size)
        except DriverError:
            with suppress(DriverError):
                self.free_range(va, size)
            raise
        try:
            self.set_access(va, size, [dev, *also])
        except DriverError:
            with suppress(DriverError):
                self.unmap(va, size)
            raise
        return va

    def reserve(self, size: int) -> int:
        """An address range of `size` bytes, nothing mapped in it."""
        va = ctypes.c_uint64()
        self._ok(self._cu.cuMemAddressReserve(ctypes.byref(va), size, 0, 0, 0), "cuMemAddressReserve")
        return va.value

    def map_at(self, va: int, handle: int, size: int) -> None:
        """The memory mapped at `va` (in a reserved range), reachable only once set_access gives a GPU access."""
        self._ok(self._cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")

    def set_access(self, va: int, size: int, devs: list[int]) -> None:
        """Read-write access for `devs` to [va, va + size), which may span many mappings (one call for all)."""
        acc = (_AccessDesc * len(devs))(*[_AccessDesc(location=_MemLocation(_DEVICE, d), flags=_READ_WRITE) for d in devs])
        self._ok(self._cu.cuMemSetAccess(va, size, acc, len(devs)), "cuMemSetAccess")

    def unmap(self, va: int, size: int) -> None:
        """One mapping of map(): unmapped and its range freed."""
        self.unmap_only(va, size)
        self.free_range(va, size)

    def unmap_only(self, va: int, size: int) -> None:
        self._ok(self._cu.cuMemUnmap(va, size), "cuMemUnmap")

    def free_range(self, va: int, size: int) -> None:
        self._ok(self._cu.cuMemAddressFree(va, size), "cuMemAddressFree")

    def pin(self, addr: int, size: int) -> None:
        # portable: pinned for every context of this process, whichever GPU a copy runs on
        self._ok(self._cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), size, _HOST_REGISTER_PORTABLE),
                 f"pinning {size >> 20} MiB of staging")

    def unpin(self, addr: int) -> None:
        self._ok(self._cu.cuMemHostUnregister(ctypes.c_void_p(addr)), "cuMemHostUnregister")

    def d2h(self, host: int, va: int, size: int, stream: int) -> None:
        self._ok(self._cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(host), va, size, ctypes.c_void_p(stream)), "copying out")

    def h2d(self, va: int, host: int, size: int, stream: int) -> None:
        self._ok(self._cu.cuMemcpyHtoDAsync_v2(va, ctypes.c_void_p(host), size, ctypes.c_void_p(stream)), "copying in")

    def d2d(self, dst: int, src: int, size: int, stream: int) -> None:
        """GPU to GPU, either side on any GPU whose copy engine the stream's can reach (unified addressing)."""
        self._ok(self._cu.cuMemcpyAsync(dst, src, size, ctypes.c_void_p(stream)), "copying between GPUs")

    def memset(self, va: int, size: int, stream: int, value: int = 0) -> None:
        self._ok(self._cu.cuMemsetD8Async(va, value, size, ctypes.c_void_p(stream)), "cuMemsetD8Async")

    def alloc(self, size: int) -> int:
        """Plain device memory in the current context (the server's bounce slots on a neighbour GPU)."""
        p = ctypes.c_uint64()
        self._ok(self._cu.cuMemAlloc_v2(ctypes.byref(p), size), f"allocating {size >> 20} MiB")
        return p.value

    def free(self, ptr: int) -> None:
        self._ok(self._cu.cuMemFree_v2(ptr), "cuMemFree")

    def can_access_peer(self, dev: int, peer: int) -> bool:
        yes = ctypes.c_int(0)
        self._ok(self._cu.cuDeviceCanAccessPeer(ctypes.byref(yes), dev, peer), "cuDeviceCanAccessPeer")
        return yes.value == 1

    def event(self) -> int:
        e = ctypes.c_void_p()
        self._ok(self._cu.cuEventCreate(ctypes.byref(e), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return e.value or 0

    def record(self, event: int, stream: int) -> None:
        self._ok(self._cu.cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cuEventRecord")

    def wait_event(self, event: int) -> None:
        self._ok(self._cu.cuEventSynchronize(ctypes.c_void_p(event)), "cuEventSynchronize")

    def done(self, event: int) -> bool:
        """Whether the work `event` recorded is done, the host not waiting."""
        rc = self._cu.cuEventQuery(ctypes.c_void_p(event))
        if rc == _NOT_READY:
            return False
        self._ok(rc, "cuEventQuery")
        return True

    def wait_for(self, stream: int, event: int) -> None:
        """Work queued next on `stream` runs after what `event` recorded (on another stream), the host not waiting."""
        self._ok(self._cu.cuStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), 0), "cuStreamWaitEvent")

    def destroy_event(self, event: int) -> None:
        self._ok(self._cu.cuEventDestroy_v2(ctypes.c_void_p(event)), "cuEventDestroy")

    def host_alloc(self, size: int) -> int:
        """Pinned host memory for every context (a kernel's results copied back without waiting)."""
        h = ctypes.c_void_p()
        self._ok(self._cu.cuMemHostAlloc(ctypes.byref(h), size, _HOST_REGISTER_PORTABLE), "cuMemHostAlloc")
        return h.value or 0

    def mapped(self, host: int) -> int:
        """The GPU's address of pinned host memory made by host_alloc (unified addressing: the same one), where a
        kernel writes its results with no copy back queued behind other copies."""
        d = ctypes.c_uint64()
        self._ok(self._cu.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ctypes.c_void_p(host), 0),
                 "cuMemHostGetDevicePointer")
        return d.value

    def host_free(self, ptr: int) -> None:
        self._ok(self._cu.cuMemFreeHost(ctypes.c_void_p(ptr)), "cuMemFreeHost")

    def load_module(self, image: bytes) -> int:
        """A module (cubin, fatbin or PTX) loaded into the current context."""
        m = ctypes.c_void_p()
        self._ok(self._cu.cuModuleLoadData(ctypes.byref(m), image), "loading GPU kernels (cuModuleLoadData)")
        return m.value or 0

    def unload_module(self, module: int) -> None:
        self._ok(self._cu.cuModuleUnload(ctypes.c_void_p(module)), "cuModuleUnload")

    def function(self, module: int, name: str) -> int:
        f = ctypes.c_void_p()
        self._ok(self._cu.cuModuleGetFunction(ctypes.byref(f), ctypes.c_void_p(module), name.encode()),
                 f"finding the GPU kernel {name}")
        return f.value or 0

    def launch(self, func: int, grid: int, block: int, stream: int, args: list[ctypes.c_uint64]) -> None:
        """One launch of a 1-D grid; each argument a ctypes value (the driver copies them at the launch)."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self._ok(self._cu.cuLaunchKernel(ctypes.c_void_p(func), grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream),
                                         params, None), "launching a GPU kernel")
