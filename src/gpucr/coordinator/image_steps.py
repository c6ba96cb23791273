"""A checkpoint written to an image directory, and a restore read from one (gpucr.image, gpucr.imagefs)."""
from __future__ import annotations

import os
import time
from typing import Any

from .. import gpus, manifest
from .. import imagefs
from ..errors import GpucrError
from .members import IMAGE_STAGE_MIN_S, STALL_GRACE_S, _Member, _test_kill_point, _watched_call
from .staging_steps import provide_staging
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


def _data_in_from_image(m: _Member, entry: dict, timeout: float) -> None:
    """The image read into new staging, every chunk verified (the disk is the bound: the plane's fill, at the
    link's speed, comes after); then the plane makes new memory from it, zero chunks set on the GPU, and the agent
    adopts it (its restore finishes next: _data_in). A read or fill that fails leaves the process checkpointed,
    the image its source."""
    from .. import image as images   # needs xxhash: only image work pays for importing it
    status = m.status
    if status.get("staged"):
        m.agent.call("drop", timeout=60.0)   # the image is the source now
        status = m.agent.call("status", timeout=10.0)   # what it lacks now that it holds no staging
    t0 = time.perf_counter()
    # staging is made by the plane before any data arrives, then the agent places the data in it; it reports no
    # progress of its own, so its limit is wide. lease=1: should this controller die before the staging is used,
    # the agent drops what was read of it
    provide_staging(m, m.plane, status)
    _watched_call(m, "stage", max(timeout, IMAGE_STAGE_MIN_S) + STALL_GRACE_S, lease=1)
    layout, seg_fds = m.agent.call_with_fds("layout", timeout=60.0)
    m.result["phases_s"]["stage"] = time.perf_counter() - t0
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid)) as idir:
            memory = _fillable_memory(m, timeout)
            t0 = time.perf_counter()
            try:
                m.result["image"] = images.read(idir, entry["data"], layout, seg_fds,
                                                on_chunk=lambda: _test_kill_point("during-image-read"))
            except GpucrError as exc:
                _drop_quietly(m)
                raise GpucrError(f"{exc}; it stays checkpointed: restore it from an intact image") from exc
            m.result["phases_s"]["image_read"] = time.perf_counter() - t0
            made = m.plane.fill(m.pid, layout, seg_fds, _moved(memory, m.gpu_moves),
                                image=_zero_chunks(entry["data"], layout))
            m.result["image"]["bytes_zeroed"] = made[0].zeroed
            try:
                _adopt(m, layout, *made)
            finally:
                _close_made({m.pid: made})
    finally:
        for fd in seg_fds:
            os.close(fd)


def _drop_quietly(m: _Member) -> None:
    """Staging filled in part is never restored from: dropped (its lease drops it anyway once this connection ends)."""
    try:
        m.agent.call("drop", timeout=60.0)
    except GpucrError:
        pass


def _zero_chunks(allocs: list[dict[str, Any]], layout: dict[str, Any]) -> dict[int, list[tuple[int, int]]]:
    """{allocation index in the layout: [(offset, bytes)]} of the image's zero chunks (images.read matched the two)."""
    index = {int(a["va"]): int(a["index"]) for a in layout["allocations"]}
    return {index[int(a["va"])]: [(int(c["offset"]), int(c["bytes"])) for c in a["chunks"] if c.get("zero")]
            for a in allocs}
