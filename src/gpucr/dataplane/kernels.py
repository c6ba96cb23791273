"""gpucr's GPU kernels on device memory: the zero scan and the chunk digest of gpucr.dataplane.digest.

The kernels (native/kernels/gpucr_kernels.cu) ship built, as gpucr/_kernels/gpucr_kernels.fatbin: machine
code for sm_75 to sm_120 loads in under a millisecond; a newer GPU JITs the PTX (15-100 ms). So a Kernels
loads the module into each context when it is made or when a context is added (the server: when it
starts, or retains a context), never inside a copy.

Each scan is enqueued on a stream, so it runs beside copies on other streams, and read afterwards: the
enqueue_ forms give a Pending, whose read() waits for the scan's own event. zero_scan and digests do both.
The data plane runs the table kernels instead, one launch over many allocations (sweep.py); it takes its
buffers here and its functions by kind.
The small result buffers are kept per context and reused, never freed while copies run (cuMemFree may wait
for the whole device); unload() frees them.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..vmm import Vmm
from ..errors import GpucrError
from .chunks import DIGEST_BYTES, chunk_count

FATBIN = Path(__file__).resolve().parent.parent / "_kernels" / "gpucr_kernels.fatbin"
NAMES = {"zero": "gpucr_zero_scan", "digest": "gpucr_digest",   # over one range (a launch each)
         "scan": "gpucr_scan_table", "check": "gpucr_check_table"}   # over a table of ranges (sweep.py)
RESULT_BYTES = {"zero": 1, "digest": DIGEST_BYTES}   # per chunk
THREADS = 512          # per block: a multiple of 32 (the kernels reduce by warps)
MAX_GRID = 1 << 16     # blocks; the kernels stride over any further chunks
ALIGN = 16             # the kernels read 16 bytes at a time
MIN_BUFFER = 4096      # bytes of results kept per buffer at least: 256 digests, 4096 zero flags


def fatbin() -> bytes:
    try:
        return FATBIN.read_bytes()
    except OSError as exc:
        raise GpucrError(f"gpucr's GPU kernels cannot be read ({exc}): reinstall gpucr, or in a checkout run "
                         "scripts/build-kernels") from None


@dataclass(frozen=True)
class _Module:
    handle: int
    functions: dict[str, int]   # kind -> CUfunction


@dataclass(frozen=True)
class _Buffer:
    dev: int    # the kernels' results on the device
    host: int   # pinned, where they are copied back
    size: int


class _Buffers:
    """Result buffers kept per context for the next scan: freeing device memory (cuMemFree) may wait for the
    whole device, copies included, which a scan read beside copies must not."""

    def __init__(self, vmm: Vmm) -> None:
        self.vmm = vmm
        self._free: dict[int, list[_Buffer]] = {}
        self._lock = threading.Lock()

    def take(self, ctx: int, size: int) -> _Buffer:
        with self._lock:
            kept = self._free.get(ctx, [])
            for i, b in enumerate(kept):
                if b.size >= size:
                    return kept.pop(i)
        size = max(MIN_BUFFER, 1 << (size - 1).bit_length())
        self.vmm.use(ctx)
        dev = self.vmm.alloc(size)
        try:
            return _Buffer(dev, self.vmm.host_alloc(size), size)
        except Exception:
            self.vmm.free(dev)
            raise

    def give_back(self, ctx: int, b: _Buffer) -> None:
        with self._lock:
            self._free.setdefault(ctx, []).append(b)

    def free(self, ctx: int, bufs: list[_Buffer] | None = None) -> None:
        """bufs (else every buffer kept for ctx) freed: at unload, or after a failure (work may still write them)."""
        if bufs is None:
            with self._lock:
                bufs = self._free.pop(ctx, [])
        self.vmm.use(ctx)
        for b in bufs:
            self.vmm.host_free(b.host)
            self.vmm.free(b.dev)


class Pending:
    """Results of scans enqueued on a stream; read() waits for them and gives them back, once."""

    def __init__(self, buffers: _Buffers, ctx: int, kind: str, counts: list[int]) -> None:
        self.buffers, self.vmm, self.ctx, self.kind, self.counts = buffers, buffers.vmm, ctx, kind, counts
        self.size = sum(counts) * RESULT_BYTES[kind]
        self.buf: _Buffer | None = buffers.take(ctx, self.size)
        self.event = 0
        try:
            self.vmm.use(ctx)
            self.event = self.vmm.event()
        except Exception:
            self.close(failed=True)
            raise

    def read(self) -> list[list[bool]] | list[list[bytes]]:
        """Per range, its chunks' zero flags or 16-byte digests (in the order they were enqueued)."""
        if self.buf is None:
            raise GpucrError("a scan's results are read once; this one's were read already")
        try:
            self.vmm.wait_event(self.event)
        except Exception:
            self.close(failed=True)
            raise
        raw = ctypes.string_at(self.buf.host, self.size)
        self.close()
        out, off, each = [], 0, RESULT_BYTES[self.kind]
        for n in self.counts:
            part = raw[off:off + n * each]
            out.append([b == 1 for b in part] if self.kind == "zero" else
                       [part[k:k + each] for k in range(0, len(part), each)])
            off += n * each
        return out

    def close(self, failed: bool = False) -> None:
        """Done with it (read() closes it); failed: its buffer is freed, not kept, as work may still write it."""
        if self.event:
            self.vmm.use(self.ctx)
            self.vmm.destroy_event(self.event)
            self.event = 0
        if self.buf is not None:
            self.buffers.free(self.ctx, [self.buf]) if failed else self.buffers.give_back(self.ctx, self.buf)
            self.buf = None


class Kernels:
    """gpucr's kernels loaded into the contexts it was given; each scan names its context."""

    def __init__(self, vmm: Vmm, contexts: Sequence[int] = ()) -> None:
        self.vmm = vmm
        self._image = fatbin()
        self._modules: dict[int, _Module] = {}
        self._buffers = _Buffers(vmm)
        try:
            for ctx in contexts:
                self.load(ctx)
        except Exception:
            self.close()
            raise

    def load(self, ctx: int) -> None:
        """Loads the kernels into ctx (once; again is a no-op)."""
        if ctx in self._modules:
            return
        self.vmm.use(ctx)
        handle = self.vmm.load_module(self._image)
        try:
            functions = {kind: self.vmm.function(handle, name) for kind, name in NAMES.items()}
        except Exception:
            self.vmm.unload_module(handle)
            raise
        self._modules[ctx] = _Module(handle, functions)

    def unload(self, ctx: int) -> None:
        """Before the context is given back: its module and the result buffers kept in it."""
        module = self._modules.pop(ctx, None)
        if module is not None:
            self._buffers.free(ctx)
            self.vmm.use(ctx)
            self.vmm.unload_module(module.handle)

    def trim(self) -> None:
        """The result buffers kept in every context freed (the mover's copies done): between requests the server
        holds its contexts and nothing more on the GPUs."""
        for ctx in list(self._modules):
            self._buffers.free(ctx)

    def close(self) -> None:
        for ctx in list(self._modules):
            self.unload(ctx)

    @property
    def buffers(self) -> _Buffers:
        """The result buffers kept per context (a sweep takes its one buffer here)."""
        return self._buffers

    def function(self, ctx: int, kind: str) -> int:
        """The kernel `kind` (a key of NAMES) as loaded into ctx."""
        module = self._modules.get(ctx)
        if module is None:
            raise GpucrError(f"gpucr's kernels were not loaded into context {ctx:#x}: load them when the context is "
                             "retained (Kernels.load), never inside a copy")
        return module.functions[kind]

    def enqueue_zero_scan(self, ctx: int, ranges: Sequence[tuple[int, int]], stream: int) -> Pending:
        """For each (device address, bytes) in ranges, one flag per 2 MiB chunk: all zero."""
        return self._enqueue(ctx, "zero", ranges, stream)

    def enqueue_digests(self, ctx: int, ranges: Sequence[tuple[int, int]], stream: int) -> Pending:
        """For each (device address, bytes) in ranges, the 16-byte digest of each 2 MiB chunk."""
        return self._enqueue(ctx, "digest", ranges, stream)

    def zero_scan(self, ctx: int, dva: int, nbytes: int, stream: int) -> list[bool]:
        return self.enqueue_zero_scan(ctx, [(dva, nbytes)], stream).read()[0]

    def digests(self, ctx: int, dva: int, nbytes: int, stream: int) -> list[bytes]:
        return self.enqueue_digests(ctx, [(dva, nbytes)], stream).read()[0]

    def _enqueue(self, ctx: int, kind: str, ranges: Sequence[tuple[int, int]], stream: int) -> Pending:
        function = self.function(ctx, kind)
        for dva, nbytes in ranges:
            if dva % ALIGN or nbytes < 0:
                raise GpucrError(f"a scan of {nbytes} bytes at {dva:#x}: the range must start {ALIGN}-byte aligned "
                                 "and not be negative")
        pending = Pending(self._buffers, ctx, kind, [chunk_count(n) for _, n in ranges])
        try:
            out = pending.buf.dev
            for (dva, nbytes), n in zip(ranges, pending.counts):
                if n:
                    args = [ctypes.c_uint64(dva), ctypes.c_uint64(nbytes), ctypes.c_uint64(out)]
                    self.vmm.launch(function, min(n, MAX_GRID), THREADS, stream, args)
                out += n * RESULT_BYTES[kind]
            if pending.size:
                self.vmm.d2h(pending.buf.host, pending.buf.dev, pending.size, stream)
            self.vmm.record(pending.event, stream)
        except Exception:
            pending.close(failed=True)
            raise
        return pending
