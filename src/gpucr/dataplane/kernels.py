"""gpucr's GPU kernels on device memory: the zero scan and the chunk digest of gpucr.dataplane.digest.

The kernels (native/kernels/gpucr_kernels.cu) ship built, as gpucr/_kernels/gpucr_kernels.fatbin: machine
code for sm_75 to sm_120 loads in under a millisecond; a newer GPU JITs the PTX (15-100 ms). So a Kernels
loads the module into each context when it is made or when a context is added (the server: when it
starts, or retains a context), never inside a copy.

Each scan is enqueued on a stream, so it runs beside copies on other streams, and read afterwards: the
enqueue_ forms give a Pending, whose read() waits for the scan's own event. zero_scan and digests do both.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..driver import Vmm
from ..errors import GpucrError
from .digest import DIGEST_BYTES, chunk_count

FATBIN = Path(__file__).resolve().parent.parent / "_kernels" / "gpucr_kernels.fatbin"
NAMES = {"zero": "gpucr_zero_scan", "digest": "gpucr_digest"}
RESULT_BYTES = {"zero": 1, "digest": DIGEST_BYTES}   # per chunk
THREADS = 512          # per block: a multiple of 32 (the kernels reduce by warps)
MAX_GRID = 1 << 16     # blocks; the kernels stride over any further chunks
ALIGN = 16             # the kernels read 16 bytes at a time


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


class Pending:
    """Results of scans enqueued on a stream; read() waits for them, gives them back and frees their buffers."""

    def __init__(self, vmm: Vmm, ctx: int, kind: str, counts: list[int]) -> None:
        self.vmm, self.ctx, self.kind, self.counts = vmm, ctx, kind, counts
        self.size = sum(counts) * RESULT_BYTES[kind]
        vmm.use(ctx)
        self.dev = vmm.alloc(max(self.size, ALIGN))
        self.host = self.event = 0
        try:
            self.host = vmm.host_alloc(max(self.size, ALIGN))
            self.event = vmm.event()
        except Exception:
            self.close()
            raise

    def read(self) -> list[list[bool]] | list[list[bytes]]:
        """Per range, its chunks' zero flags or 16-byte digests (in the order they were enqueued)."""
        try:
            self.vmm.wait_event(self.event)
            raw = ctypes.string_at(self.host, self.size)
        finally:
            self.close()
        out, off, each = [], 0, RESULT_BYTES[self.kind]
        for n in self.counts:
            part = raw[off:off + n * each]
            out.append([b == 1 for b in part] if self.kind == "zero" else
                       [part[k:k + each] for k in range(0, len(part), each)])
            off += n * each
        return out

    def close(self) -> None:
        """Frees the buffers (read() does); idempotent."""
        self.vmm.use(self.ctx)
        if self.event:
            self.vmm.destroy_event(self.event)
        if self.host:
            self.vmm.host_free(self.host)
        if self.dev:
            self.vmm.free(self.dev)
        self.dev = self.host = self.event = 0


class Kernels:
    """gpucr's kernels loaded into the contexts it was given; each scan names its context."""

    def __init__(self, vmm: Vmm, contexts: Sequence[int] = ()) -> None:
        self.vmm = vmm
        self._image = fatbin()
        self._modules: dict[int, _Module] = {}
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
        """Before the context is given back."""
        module = self._modules.pop(ctx, None)
        if module is not None:
            self.vmm.use(ctx)
            self.vmm.unload_module(module.handle)

    def close(self) -> None:
        for ctx in list(self._modules):
            self.unload(ctx)

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
        module = self._modules.get(ctx)
        if module is None:
            raise GpucrError(f"gpucr's kernels were not loaded into context {ctx:#x}: load them when the context is "
                             "retained (Kernels.load), never inside a copy")
        for dva, nbytes in ranges:
            if dva % ALIGN or nbytes < 0:
                raise GpucrError(f"a scan of {nbytes} bytes at {dva:#x}: the range must start {ALIGN}-byte aligned "
                                 "and not be negative")
        pending = Pending(self.vmm, ctx, kind, [chunk_count(n) for _, n in ranges])
        try:
            out = pending.dev
            for (dva, nbytes), n in zip(ranges, pending.counts):
                if n:
                    args = [ctypes.c_uint64(dva), ctypes.c_uint64(nbytes), ctypes.c_uint64(out)]
                    self.vmm.launch(module.functions[kind], min(n, MAX_GRID), THREADS, stream, args)
                out += n * RESULT_BYTES[kind]
            if pending.size:
                self.vmm.d2h(pending.host, pending.dev, pending.size, stream)
            self.vmm.record(pending.event, stream)
        except Exception:
            pending.close()
            raise
        return pending
