"""A checkpointed process's data moved from host memory to an image on disk (the swap service's host budget, issue
27): its data is in staging already, so the image is written from it with its certificate (the manifest, a digest
per chunk), and only then is the staging given back. A write that fails leaves the process as it was: checkpointed,
its data in host memory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import imagefs
from .. import target as targets
from ..driver import ProcessState
from ..errors import GpucrError
from ..plane import DataPlane
from .image_steps import _write_image
from .members import _driver_state, _Member, _need_cuda
from .steps import _check_image_dir


def write_image_of_checkpointed(pid: int, image_dir: Path, plane: DataPlane, timeout: float = 30.0) -> dict[str, Any]:
    """Write the image of process `pid`, checkpointed with its data in host memory, to the new or empty `image_dir`,
    then free its staging (and `plane`'s hold on it). Returns the image's statistics; GpucrError, the process
    untouched, when it is not so checkpointed or the write fails. `gpucr restore --image DIR PID` brings it back."""
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = t.driver()
    _check_image_dir(image_dir, imagefs.owner_for(t.uid, pid))
    m = _Member(t, drv, image_dir=image_dir, result={"pid": pid, "phases_s": {}}, plane=plane)
    try:
        m.agent = t.connect()
        m.status = m.agent.call("status", timeout=timeout)
        if m.status.get("state") != "checkpointed" or not m.status.get("staged") or m.status.get("busy"):
            raise GpucrError(f"process {pid} holds no checkpoint in host memory to write to an image "
                             f"(it is {m.status.get('state')}{', busy' if m.status.get('busy') else ''})")
        level = "full" if _driver_state(drv, pid) == ProcessState.CHECKPOINTED else "data"
        return _write_image(m, level, epoch=None)
    finally:
        m.close()
