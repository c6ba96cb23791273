"""Checkpoint images on disk: the staged data of one process as one data file of 64 MiB chunks,
each with an xxh3 digest; all-zero chunks are recorded, not written. Writes and reads go several at
a time, with O_DIRECT where the filesystem allows it (buffered otherwise)."""
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


def write(idir: ImageDir, layout: dict[str, Any], fds: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Write the staged allocations under a temporary name, then name it data.bin (a failed write leaves
    nothing); returns their manifest records and the write statistics."""
    segs = layout["segments"]
    allocs, jobs, foff = [], [], 0
    for a in layout["allocations"]:
        rec = {"va": a["va"], "bytes": a["bytes"], "kind": a["kind"], "file_offset": foff, "chunks": []}
        for off in range(0, a["bytes"], CHUNK):
            n = min(CHUNK, a["bytes"] - off)
            chunk = {"offset": off, "bytes": n}
            rec["chunks"].append(chunk)
            jobs.append((chunk, a["segment"], a["offset"] + off, foff + off))
        foff += a["bytes"]
        allocs.append(rec)
    t0 = time.perf_counter()
    fd, tmp = idir.create(DATA)
    direct = try_direct(fd)
    written = 0
    try:
        with _mapped(fds, [s["bytes"] for s in segs], writable=False) as views, _progress("writing image", foff) as tick:
            def one(job: tuple) -> int:
                chunk, seg, soff, fo = job
                with views[seg][soff:soff + chunk["bytes"]] as src:
                    digest = xxhash.xxh3_64_hexdigest(src)
                    if _is_zero(src, digest):
                        chunk["zero"] = True
                        tick(chunk["bytes"])
                        return 0
                    chunk["xxh3_64"] = digest
                    done = 0
                    while done < chunk["bytes"]:
                        with src[done:] as rest:
                            done += os.pwrite(fd, rest, fo + done)
                tick(chunk["bytes"])
                return done
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                written = sum(pool.map(one, jobs))
        os.ftruncate(fd, foff)   # holes where zero chunks were skipped
        os.fsync(fd)
        os.close(fd)
        fd = -1
        idir.publish(tmp, DATA)
    except (OSError, GpucrError) as exc:
        idir.discard(tmp)
        why = (exc.strerror or exc) if isinstance(exc, OSError) else exc
        raise GpucrError(f"writing the image to {idir.path} failed: {why}; the process stays "
                         "checkpointed with its data in host memory") from exc
    finally:
        if fd >= 0:
            os.close(fd)
    secs = time.perf_counter() - t0
    return allocs, {"bytes": foff, "bytes_written": written, "transfer_s": secs, "direct_io": direct,
                    "gbps": foff / secs / 1e9 if secs else None}


def read(idir: ImageDir, allocs: list[dict[str, Any]], layout: dict[str, Any], fds: list[int],
         on_ready: Callable[[int], None] | None = None, fresh: bool = True,
         on_zero: Callable[[int, int], None] | None = None,
         on_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    """Read an image into staged memory, verifying every chunk's digest.

    `on_ready(va)` is called as soon as all of an allocation's chunks are in and verified, so the
    process can copy it to the device while the rest is read. Zero chunks are not read: with
    `on_zero(va, offset)` the process sets them on the device instead of copying them, and in `fresh`
    staging (new shared memory, already zero) they cost the host nothing either. `on_chunk()` is called
    after each chunk is in (the process's wait for the data is not idle); it may raise to stop the read.
    """
    check_coverage(allocs)
    where = {a["va"]: a for a in layout["allocations"]}
    missing = [hex(a["va"]) for a in allocs if a["va"] not in where or where[a["va"]]["bytes"] != a["bytes"]]
    if missing or len(allocs) != len(where):
        raise GpucrError(f"refused: the image's allocations do not match the process's ({len(allocs)} in the image, "
                         f"{len(where)} in the process)")
    need = sum(a["bytes"] for a in allocs)
    try:
        fd = idir.open_read(DATA)
    except FileNotFoundError:
        raise GpucrError("refused: the image's data file is missing") from None
    size = os.fstat(fd).st_size
    if size != need:
        os.close(fd)
        raise GpucrError(f"refused: the image's data file is {size} bytes, not {need} (truncated?)")
    jobs = [(a, c) for a in allocs for c in a["chunks"]]
    left = {a["va"]: len(a["chunks"]) for a in allocs}
    lock = threading.Lock()
    for a in allocs:
        if not a["chunks"] and on_ready:
            on_ready(a["va"])
    t0 = time.perf_counter()
    direct = try_direct(fd)
    try:
        with _mapped(fds, [s["bytes"] for s in layout["segments"]], writable=True) as views, \
                _progress("reading image", need) as tick:
            def one(job: tuple) -> None:
                a, c = job
                dst_alloc = where[a["va"]]
                off = dst_alloc["offset"] + c["offset"]
                with views[dst_alloc["segment"]][off:off + c["bytes"]] as dst:
                    if c.get("zero"):
                        if on_zero:
                            on_zero(a["va"], c["offset"])
                        elif not fresh:
                            dst[:] = memoryview(_ZERO)[:c["bytes"]]
                        got, ok = c["bytes"], True
                    else:
                        got = os.preadv(fd, [dst], a["file_offset"] + c["offset"])
                        ok = got == c["bytes"] and xxhash.xxh3_64_hexdigest(dst) == c.get("xxh3_64")
                if got != c["bytes"]:
                    raise GpucrError(f"refused: chunk {c['offset']:#x} of allocation {a['va']:#x} is truncated")
                if not ok:
                    raise GpucrError(f"refused: chunk {c['offset']:#x} of allocation {a['va']:#x} does not match "
                                     "its digest (the image is corrupt)")
                tick(c["bytes"])
                if on_chunk:
                    on_chunk()
                with lock:
                    left[a["va"]] -= 1
                    done = left[a["va"]] == 0
                if done and on_ready:
                    on_ready(a["va"])
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                list(pool.map(one, jobs))
    finally:
        os.close(fd)
    secs = time.perf_counter() - t0
    read = sum(c["bytes"] for a in allocs for c in a["chunks"] if not c.get("zero"))
    return {"bytes": need, "bytes_read": read, "transfer_s": secs, "direct_io": direct,
            "gbps": need / secs / 1e9 if secs else None}
