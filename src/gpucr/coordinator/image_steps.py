"""A checkpoint written to an image directory, and a restore read from one (gpucr.image, gpucr.imagefs)."""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from .. import gpus, manifest
from .. import imagefs
from ..errors import GpucrError, note
from ..memory import Managed
from ..plane import Made
from .members import IMAGE_STAGE_MIN_S, IMAGE_STALL_MIN_S, STALL_GRACE_S, _Member, _test_kill_point, _watched_call
from .through_plane import _adopt, _close_made, _fillable_memory, _moved


def _write_image(m: _Member, level: str, epoch) -> dict:
    """Write the staged data and its manifest, then let the process give its staging back."""
    from .. import image as images   # needs xxhash: only image work pays for importing it
    layout, fds = m.agent.call_with_fds("layout", timeout=60.0)
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid), create=True) as idir:
            if idir.names():
                raise GpucrError(f"the image directory {m.image_dir} is no longer empty (someone else writes there); "
                                 "the process stays checkpointed with its data in host memory")
            allocs, stats = images.write(idir, layout, fds)
            man = manifest.build(pid=m.pid, start_time=m.t.start_time, generation=layout["generation"], level=level,
                                 gpus=gpus.process_gpus(m.status, gpus.machine_gpus(m.drv)),
                                 driver_version=m.drv.version(), status=m.status, allocations=allocs,
                                 epoch=epoch, simulated=m.drv.simulated)
            man["image"] = stats
            manifest.save(idir, man)
    finally:
        for fd in fds:
            os.close(fd)
    m.agent.call("drop", timeout=60.0)   # the data is safe on disk: free the host memory too
    if m.plane is not None:
        m.plane.forget(m.pid)   # its mapping and pins of the staging would keep that memory alive
    return {"dir": str(m.image_dir), "id": man["id"], **stats}


def _data_in_from_image(m: _Member, entry: dict, timeout: float, drop_staging: bool) -> bool:
    """The image read into new staging; through the server's plane (m.plane), which then fills new memory from
    it, True: the agent's own restore is still to finish (_data_in). Else the agent restores while the image is
    read (the in-process plane), False. A read that fails leaves the process checkpointed, the image its source."""
    if m.status.get("staged"):
        m.agent.call("drop", timeout=60.0)   # the image is the source now
    t0 = time.perf_counter()
    # staging is made before any data arrives; it reports no progress of its own, so its limit is wide.
    # lease=1: should this controller die before the staging is used, the agent drops what was read of it
    _watched_call(m, "stage", max(timeout, IMAGE_STAGE_MIN_S) + STALL_GRACE_S, lease=int(m.plane is not None))
    layout, fds = m.agent.call_with_fds("layout", timeout=60.0)
    m.result["phases_s"]["stage"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    limit = max(timeout, IMAGE_STALL_MIN_S) + STALL_GRACE_S
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid)) as idir:
            memory = _fillable_memory(m, timeout) if m.plane is not None else None
            if memory is not None:
                _read_then_fill(m, idir, entry, layout, fds, memory)
                return True
            m.plane = None
            out = _restore_reading(m, idir, entry, layout, fds, limit, drop_staging)
    finally:
        for fd in fds:
            os.close(fd)
    m.result["phases_s"]["image_read_and_data_in"] = time.perf_counter() - t0
    m.result["bytes_moved"] = out["last_cycle_ms"]["bytes_in"]
    m.result["image"]["bytes_zeroed"] = out["last_cycle_ms"].get("bytes_zeroed", 0)
    return False


def _read_then_fill(m: _Member, idir: imagefs.ImageDir, entry: dict, layout: dict[str, Any], seg_fds: list[int],
                    memory: list[Managed]) -> None:
    """The image read into staging, every chunk verified (the disk is the bound: the server's fill, at the
    link's speed, comes after); then the server makes new memory from it, zero chunks set on the GPU, and
    the agent adopts it. Should the read fail, the staging goes and the process stays checkpointed."""
    from .. import image as images
    t0 = time.perf_counter()
    try:
        # each zero chunk is also told to the agent: should the fill fail, its own restore sets them
        m.result["image"] = images.read(idir, entry["data"], layout, seg_fds,
                                        on_zero=lambda va, off: m.agent.call("zero", timeout=60.0, va=va, offset=off),
                                        on_chunk=lambda: _test_kill_point("during-image-read"))
    except GpucrError as exc:
        try:
            m.agent.call("drop", timeout=60.0)
        except GpucrError:
            pass   # its lease on the staging drops it once this connection ends
        raise GpucrError(f"{exc}; it stays checkpointed: restore it from an intact image") from exc
    m.result["phases_s"]["image_read"] = time.perf_counter() - t0
    try:
        made: Made | GpucrError = m.plane.fill(
            m.pid, layout, seg_fds, _moved(memory, m.gpu_moves), image=_zero_chunks(entry["data"], layout))
    except GpucrError as exc:
        made = exc
    if isinstance(made, GpucrError):
        m.result["image"]["bytes_zeroed"] = 0
        note(f"process {m.pid}: {made}; its agent's own restore from the staging read brings it back")
        return
    m.result["image"]["bytes_zeroed"] = made[0].zeroed
    try:
        _adopt(m, layout, *made)
    finally:
        _close_made({m.pid: made})


def _zero_chunks(allocs: list[dict[str, Any]], layout: dict[str, Any]) -> dict[int, list[tuple[int, int]]]:
    """{allocation index in the layout: [(offset, bytes)]} of the image's zero chunks (images.read matched the two)."""
    index = {int(a["va"]): int(a["index"]) for a in layout["allocations"]}
    return {index[int(a["va"])]: [(int(c["offset"]), int(c["bytes"])) for c in a["chunks"] if c.get("zero")]
            for a in allocs}


def _restore_reading(m: _Member, idir: imagefs.ImageDir, entry: dict, layout: dict, fds: list[int], limit: float,
                     drop_staging: bool) -> dict[str, Any]:
    """The restore, waiting on this connection, while a reader thread fills staging from the image and
    announces each allocation on a second connection as soon as its chunks are verified. Either side
    failing stops the other; the agent then drops what was read and stays checkpointed (the image is
    still the source)."""
    from .. import image as images
    read_error: list[GpucrError] = []
    stop = threading.Event()

    def chunk_read() -> None:
        if stop.is_set():
            raise GpucrError("the restore ended")
        notify.call("progress", timeout=60.0)
        if os.environ.get("GPUCR_TEST_KILL_AT") == "during-image-read":
            while not notify.call("status", timeout=10.0)["busy"]:   # the agent waits for the data now
                time.sleep(0.01)
            _test_kill_point("during-image-read")

    with m.t.connect() as notify:
        def read_all() -> None:
            try:
                m.result["image"] = images.read(
                    idir, entry["data"], layout, fds,
                    on_ready=lambda va: notify.call("ready", timeout=60.0, va=va),
                    on_zero=lambda va, off: notify.call("zero", timeout=60.0, va=va, offset=off),
                    on_chunk=chunk_read)
            except GpucrError as exc:
                read_error.append(exc)
                try:
                    notify.call("ready_abort", timeout=60.0)
                except GpucrError:
                    pass
        reader = threading.Thread(target=read_all, name="gpucr-image-read")
        reader.start()
        try:
            return _watched_call(m, "restore", limit, timeout_ms=int(limit * 1000), drop_staging=int(drop_staging),
                                 wait_ready=1, open_gate=0)
        except GpucrError as exc:
            stop.set()
            reader.join()
            cause = read_error[0] if read_error else exc
            raise GpucrError(f"{cause}; it stays checkpointed: restore it from an intact image") from exc
        finally:
            stop.set()
            reader.join()
