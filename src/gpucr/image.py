"""Checkpoint images on disk: the staged data of one process as one data file of 64 MiB chunks,
each with an xxh3 digest; all-zero chunks are recorded, not written. Writes go several at a time from
staging, reads straight into the data plane's ring (ImageSource), both with O_DIRECT where the
filesystem allows it (buffered otherwise)."""
from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import xxhash

from .errors import GpucrError
from .fileio import read_full, view_at, write_all
from .imagefs import ImageDir, try_direct
from .manifest import check_coverage

CHUNK = 64 << 20   # the data plane's copies go in pieces of the same size (dataplane/mover.py)
DATA = "data.bin"
IN_FLIGHT = 4
_ZERO = bytes(CHUNK)
_ZERO_DIGEST: dict[int, str] = {}


def _is_zero(buf: memoryview, digest: str) -> bool:
    """Exact all-zero test, run only on chunks whose digest is that of zeros (cheap for the rest)."""
    n = len(buf)
    if n not in _ZERO_DIGEST:
        _ZERO_DIGEST[n] = xxhash.xxh3_64_hexdigest(memoryview(_ZERO)[:n])
    if digest != _ZERO_DIGEST[n]:
        return False
    try:
        import numpy as np
        return not np.frombuffer(buf, dtype=np.uint8).any()
    except ImportError:
        return buf == memoryview(_ZERO)[:n]


@contextmanager
def _mapped(fds: list[int], sizes: list[int], writable: bool) -> Iterator[list[memoryview]]:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, prot) for fd, size in zip(fds, sizes)]
    views = [memoryview(m) for m in maps]
    try:
        yield views
    finally:
        for v in views:
            v.release()
        for m in maps:
            try:
                m.close()
            except BufferError:   # a slice still held by an exception's traceback: the GC unmaps it
                pass


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal; nothing otherwise."""
    if not sys.stderr.isatty() or total < (1 << 30):
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.update(task, advance=n)


class ImageSink:
    """A new image's data file, written chunk by chunk as the data comes: from staging (write), or straight from the
    data plane's pinned ring at a checkpoint --image (gpucr.plane.ImageFile: move), with no staging. Each 64 MiB
    chunk of each allocation is digested (xxh3); one all zero is recorded as such and not written (the file keeps a
    hole there), any other is written at its place. finish() names the file data.bin; discard() removes it.
    `allocations`: the agent's layout's (index, va, bytes, kind), placed in the file one after another."""

    def __init__(self, idir: ImageDir, allocations: list[dict[str, Any]],
                 on_chunk: Callable[[int], None] | None = None) -> None:
        self.idir, self._on_chunk = idir, on_chunk
        self.allocs: list[dict[str, Any]] = []
        self._chunks: dict[int, dict[str, Any]] = {}   # file offset -> its chunk's record
        places, foff = [], 0
        for a in allocations:
            rec = {"va": a["va"], "bytes": a["bytes"], "kind": a["kind"], "file_offset": foff, "chunks": []}
            for off in range(0, a["bytes"], CHUNK):
                rec["chunks"].append({"offset": off, "bytes": min(CHUNK, a["bytes"] - off)})
                self._chunks[foff + off] = rec["chunks"][-1]
            places.append({"index": a["index"], "va": a["va"], "bytes": a["bytes"], "segment": 0, "offset": foff})
            foff += a["bytes"]
            self.allocs.append(rec)
        self.size, self.zeros = foff, {}
        self.layout = {"segments": [{"index": 0, "bytes": foff}], "allocations": places}   # the data plane's
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.fd, self._tmp = idir.create(DATA)
        self.direct_io = try_direct(self.fd)

    def move(self, slot: int, at: int, n: int) -> None:
        """ImageFile.move: the chunk at file offset `at`, in host memory at `slot`, written (one of the ring's threads)."""
        try:
            self.put(view_at(slot, n), at)
        except OSError as exc:
            raise GpucrError(f"writing the image to {self.idir.path} failed: {exc.strerror or exc}; the checkpoint "
                             "is undone, the process runs on") from exc

    def put(self, src: memoryview, at: int) -> None:
        """The chunk at file offset `at` from `src`: recorded as zero, or digested and written."""
        chunk = self._chunks.get(at)
        if chunk is None or chunk["bytes"] != len(src):
            raise GpucrError(f"{len(src)} bytes at {at:#x} of the image's data file are no chunk of it: gpucr's own "
                             "mistake")
        digest = xxhash.xxh3_64_hexdigest(src)
        if _is_zero(src, digest):
            chunk["zero"] = True
        else:
            chunk["xxh3_64"] = digest
            write_all(self.fd, src, at)
            with self._lock:
                self.bytes_written += len(src)
        if self._on_chunk:
            self._on_chunk(len(src))

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The file made whole (holes where zero chunks were), synced and named data.bin; the allocations' manifest
        records and the write's statistics."""
        os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        self.idir.publish(self._tmp, DATA)
        secs = time.perf_counter() - self._t0
        return self.allocs, {"bytes": self.size, "bytes_written": self.bytes_written, "transfer_s": secs,
                             "direct_io": self.direct_io, "gbps": self.size / secs / 1e9 if secs else None}

    def discard(self) -> None:
        """Nothing of an unfinished file left (safe after finish, and again)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.idir.discard(self._tmp)


def write(idir: ImageDir, layout: dict[str, Any], fds: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Write the staged allocations (a checkpointed process's staging: gpucr's swap to disk) under a temporary
    name, then name it data.bin (a failed write leaves nothing); returns their manifest records and the write's
    statistics."""
    sink = None
    try:
        with _mapped(fds, [s["bytes"] for s in layout["segments"]], writable=False) as views, \
                _progress("writing image", sum(a["bytes"] for a in layout["allocations"])) as tick:
            sink = ImageSink(idir, layout["allocations"], on_chunk=tick)
            jobs = [(views[a["segment"]], a["offset"] + c["offset"], c["bytes"], rec["file_offset"] + c["offset"])
                    for a, rec in zip(layout["allocations"], sink.allocs) for c in rec["chunks"]]

            def one(job: tuple) -> None:
                view, soff, n, at = job
                with view[soff:soff + n] as src:
                    sink.put(src, at)
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                list(pool.map(one, jobs))
        return sink.finish()
    except (OSError, GpucrError) as exc:
        if sink is not None:
            sink.discard()
        why = (exc.strerror or exc) if isinstance(exc, OSError) else exc
        raise GpucrError(f"writing the image to {idir.path} failed: {why}; the process stays "
                         "checkpointed with its data in host memory") from exc


class ImageSource:
    """An image's data file as a restore's fill reads it (gpucr.plane.ImageFile): straight into the data plane's
    pinned ring, each chunk checked against its digest in the slot it lands in, then copied to the GPU; zero chunks
    are set on the GPU, not read. No staging is made for it (it used to be read whole into new staging first, which
    took 6 of a 27 GiB restore's 28 s on the H200, before the fill could start).

    Made against the process's own list of what the image must hold (its agent's layout while its data is on disk:
    index, va, bytes of each allocation), and refused, before anything is read, when the two differ. `layout` is
    then the fill's: one segment, the file, with each allocation at its place in it."""

    def __init__(self, idir: ImageDir, allocs: list[dict[str, Any]], process: dict[str, Any],
                 on_chunk: Callable[[int], None] | None = None) -> None:
        check_coverage(allocs)
        where = {int(a["va"]): a for a in process["allocations"]}
        if len(allocs) != len(where) or any(a["va"] not in where or int(where[a["va"]]["bytes"]) != a["bytes"]
                                            for a in allocs):
            raise GpucrError(f"refused: the image's allocations do not match the process's ({len(allocs)} in the "
                             f"image, {len(where)} in the process)")
        for a in allocs:
            for c in a["chunks"]:
                if c["offset"] % CHUNK or c["bytes"] != min(CHUNK, a["bytes"] - c["offset"]):
                    raise GpucrError(f"refused: the image's chunk {c['offset']:#x} of allocation {a['va']:#x} is not one "
                                     f"of its {CHUNK >> 20} MiB pieces (not an image gpucr wrote)")
        self.size = sum(a["bytes"] for a in allocs)
        self.layout = {"segments": [{"index": 0, "bytes": self.size}],
                       "allocations": [{"index": int(where[a["va"]]["index"]), "va": a["va"], "bytes": a["bytes"],
                                        "segment": 0, "offset": a["file_offset"]} for a in allocs]}
        self.zeros = {int(where[a["va"]]["index"]): [(c["offset"], c["bytes"]) for c in a["chunks"] if c.get("zero")]
                      for a in allocs}
        # file offset -> (bytes, digest, allocation, offset in it) of each chunk read from disk
        self._chunks = {a["file_offset"] + c["offset"]: (c["bytes"], c.get("xxh3_64"), a["va"], c["offset"])
                        for a in allocs for c in a["chunks"] if not c.get("zero")}
        self._on_chunk = on_chunk
        self._lock = threading.Lock()
        self.bytes_read = 0
        try:
            self.fd = idir.open_read(DATA)
        except FileNotFoundError:
            raise GpucrError("refused: the image's data file is missing") from None
        size = os.fstat(self.fd).st_size
        if size != self.size:
            os.close(self.fd)
            raise GpucrError(f"refused: the image's data file is {size} bytes, not {self.size} (truncated?)")
        self.direct_io = try_direct(self.fd)
        self._t0 = time.perf_counter()

    def move(self, slot: int, at: int, n: int) -> None:
        """ImageFile.move: the chunk at file offset `at` read into the slot, checked (one of the ring's threads)."""
        chunk = self._chunks.get(at)
        if chunk is None or chunk[0] != n:
            raise GpucrError(f"the fill asked for {n} bytes at {at:#x} of the image's data file, which is no chunk "
                             "of it: gpucr's own mistake")
        _, digest, va, off = chunk
        view = view_at(slot, n)
        if read_full(self.fd, view, at) < n:
            raise GpucrError(f"refused: chunk {off:#x} of allocation {va:#x} is truncated")
        if xxhash.xxh3_64_hexdigest(view) != digest:
            raise GpucrError(f"refused: chunk {off:#x} of allocation {va:#x} does not match its digest (the image "
                             "is corrupt)")
        with self._lock:
            self.bytes_read += n
        if self._on_chunk:
            self._on_chunk(n)

    def stats(self) -> dict[str, Any]:
        """As image.write's: the bytes the image holds, those read from disk, and the time since it was opened."""
        secs = time.perf_counter() - self._t0
        return {"bytes": self.size, "bytes_read": self.bytes_read, "transfer_s": secs, "direct_io": self.direct_io,
                "gbps": self.size / secs / 1e9 if secs else None}

    def close(self) -> None:
        os.close(self.fd)
