"""A checkpoint written to an image directory, and a restore read from one (gpucr.image, gpucr.imagefs)."""
from __future__ import annotations

import os
import time

from .. import gpus, manifest
from .. import imagefs
from ..errors import GpucrError
from .members import _Member, _test_kill_point
from .through_plane import _adopt, _close_made, _fillable_memory, _moved


def _finish_image(m: _Member, level: str, epoch) -> dict:
    """checkpoint --image: the image its data out wrote (m.sink) synced, named data.bin and given its manifest,
    before the commit lets the memory leave the GPU: a failure here leaves the checkpoint uncommitted, undone by
    the agent (its lease), with nothing of the image left."""
    from ..image import DATA
    sink, m.sink = m.sink, None
    named = False
    try:
        allocs, stats = sink.finish()
        named = True
        man = _manifest(m, level, epoch, m.result["generation"], allocs)   # as its data out's status said
        man["image"] = stats
        manifest.save(sink.idir, man)
    except BaseException:
        sink.discard()
        if named:
            sink.idir.discard(DATA)
        raise
    finally:
        sink.idir.close()
    return {"dir": str(m.image_dir), "id": man["id"], **stats}


def _manifest(m: _Member, level: str, epoch, generation: int, allocs: list) -> dict:
    return manifest.build(pid=m.pid, start_time=m.t.start_time, generation=generation, level=level,
                          gpus=gpus.process_gpus(m.status, gpus.machine_gpus(m.drv)), driver_version=m.drv.version(),
                          status=m.status, allocations=allocs, epoch=epoch, simulated=m.drv.simulated)


def _let_go_of_staging(m: _Member) -> None:
    """The data is safe on disk: the process gives back its staging (host memory), and the plane what it held of it."""
    m.agent.call("drop", timeout=60.0)
    if m.plane is not None:
        m.plane.forget(m.pid)   # its mapping and pins of the staging would keep that memory alive


def _write_image(m: _Member, level: str, epoch) -> dict:
    """Write the staged data of a checkpointed process (gpucr's swap to disk) and its manifest, then let the
    process give its staging back."""
    from .. import image as images   # needs xxhash: only image work pays for importing it
    layout, fds = m.agent.call_with_fds("layout", timeout=60.0)
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid), create=True) as idir:
            if idir.names():
                raise GpucrError(f"the image directory {m.image_dir} is no longer empty (someone else writes there); "
                                 "the process stays checkpointed with its data in host memory")
            allocs, stats = images.write(idir, layout, fds)
            man = _manifest(m, level, epoch, layout["generation"], allocs)
            man["image"] = stats
            manifest.save(idir, man)
    finally:
        for fd in fds:
            os.close(fd)
    _let_go_of_staging(m)
    return {"dir": str(m.image_dir), "id": man["id"], **stats}


def _data_in_from_image(m: _Member, entry: dict, timeout: float) -> None:
    """The plane makes new memory and fills it straight from the image's data file, through its pinned ring, every
    chunk checked in the ring before it goes to the GPU and zero chunks set there (the disk is the bound); then the
    agent adopts it (its restore finishes next: _data_in). No staging is made: a read or fill that fails leaves the
    process checkpointed, the image its source, and nothing of the image in host memory."""
    from .. import image as images   # needs xxhash: only image work pays for importing it
    if m.status.get("staged"):
        m.agent.call("drop", timeout=60.0)   # the image is the source now
    process = m.agent.call("layout", timeout=60.0)   # on disk: what the image must hold, in no staging
    memory = _fillable_memory(m, timeout)
    t0 = time.perf_counter()
    with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid)) as idir, \
            images._progress("reading image", sum(int(a["bytes"]) for a in entry["data"])) as tick:
        def on_chunk(n: int) -> None:
            tick(n)
            _test_kill_point("during-image-read")
        source = images.ImageSource(idir, entry["data"], process, on_chunk)
        try:
            made = m.plane.fill(m.pid, source.layout, [], _moved(memory, m.gpu_moves), image=source)
        except GpucrError as exc:
            raise GpucrError(f"{exc}; it stays checkpointed: restore it from an intact image") from exc
        finally:
            source.close()
    m.result["image"] = {**source.stats(), "bytes_zeroed": made[0].zeroed}
    m.result["phases_s"]["image_read"] = time.perf_counter() - t0
    try:
        _adopt(m, source.layout, *made)
    finally:
        _close_made({m.pid: made})
