"""The checkpoint of one or many processes, all or nothing, and its roll-back."""
from __future__ import annotations

import time
from pathlib import Path

from .. import shape
from .. import proc
from ..errors import GpucrError
from ..results import SCHEMA_VERSION, CheckpointResult
from ..levels import LEVELS
from ..plane import DataPlane
from .members import PhaseError, _Member, _app_resume, _check_request, _each, _lap, _run_all, _usage, _usage_at_end
from .steps import _abort_held, _prepare, _roll_back_driver, _vet_for_checkpoint, _warnings
from .through_plane import _data_out_by_server
from .image_steps import _finish_image, _let_go_of_staging
from .staging_steps import provide_staging
from .relink import _check_sharing


def _commit(m: _Member, level: str) -> None:
    """The agent lets go of the memory. An image its data out wrote is finished first, while the memory is still
    on the GPU: an image that cannot be finished leaves the checkpoint undone, not the data lost."""
    epoch = None
    if m.app is not None:   # the application's own epoch, for the image's manifest and the result
        try:
            epoch = m.app.ask("epoch", 5.0).get("epoch")
        except (OSError, ValueError):
            epoch = None
    if m.sink is not None:
        m.result["image"] = _finish_image(m, level, epoch)
    m.agent.call("commit", timeout=10.0, full=int(level == "full"))
    m.held = False   # the agent let go of the memory: not undone any more
    if m.app is not None:
        m.app.close()
        m.app = None
    m.result["state"] = "checkpointed"
    m.result["level"] = level
    m.result["warnings"] = m.result.get("warnings", []) + _warnings(m)
    if m.image_dir is not None:
        _let_go_of_staging(m)   # what it kept from an earlier cycle: its data is on disk now


def _roll_back(members: list[_Member]) -> None:
    """Undo a partial checkpoint of these processes, last step first: the driver's steps, then each agent takes
    its memory back from its own fds, which kept it on the GPU until the commit (no copy). A process that cannot
    be undone is left as its agent and the driver leave it (their own roll-back); only a mistake of ours (not a
    GpucrError) is raised, once every step has been tried for every process."""
    # each step catches what a process's failure raises: anything else came back from the threads (_run_all)
    bugs = [exc for step in (_roll_back_driver, _abort_held) for _m, exc in _run_all(members, step)
            if not isinstance(exc, GpucrError)]
    for m in members:
        _app_resume(m.app)
        m.app = None
    if bugs:
        raise bugs[0]


def checkpoint_many(pids: list[int], mover: DataPlane, level: str = "full", timeout: float = 30.0,
                    images: dict[int, str | Path] | None = None, scan: bool = True) -> CheckpointResult:
    """Checkpoint several processes together, all or nothing (see the module's doc). `mover`: gpucr's data
    plane (the server's, or the CLI's own: gpucr.dataplane.mover), which copies the data while the driver takes
    the control state. scan=False (`--no-scan`): the plane neither skips zero chunks nor takes digests, so the
    restore of this checkpoint copies every byte and checks nothing (each result says so: `scanned`, `checked`)."""
    if level not in LEVELS:
        raise GpucrError(f"unknown level '{level}': use one of {', '.join(LEVELS)}")
    _check_request(pids, timeout)
    images = images or {}
    members: list[_Member] = []
    t0 = time.perf_counter()
    try:
        for pid in pids:   # vet everyone before touching anyone
            img = images.get(pid)
            members.append(_vet_for_checkpoint(pid, Path(img) if img is not None else None, timeout))
        _check_sharing(members, timeout)
        # made by the plane, held by each agent, where it must grow: a refusal (the host budget) touches nothing.
        # None for an image: its data goes from the GPU straight to the image's file, through the plane's ring
        _each("staging", [m for m in members if m.image_dir is None], lambda m: provide_staging(m, mover))
        for m in members:
            m.gpu_before = _usage(m, m.status, mover)
        t0 = _lap(members, "vet", t0)
        try:
            _each("prepare", members, lambda m: _prepare(m, timeout))
            t0 = _lap(members, "prepare", t0)
            _data_out_by_server(members, timeout, level, mover, scan)   # the control state too, side by side
        except PhaseError as exc:
            _roll_back(members)
            held = [m for m in members if m.left_held]
            if held:   # its memory stays safe on the GPU behind the agent's fds, its control state with the driver
                pids = " ".join(str(m.pid) for m in held)
                raise GpucrError(f"{exc}; the driver holds process {pids}, with every byte safe: {held[0].left_held}, "
                                 f"'gpucr recover {pids}' brings it back") from exc
            if len(members) > 1:
                alive = [m for m in members if not proc.process_ended(m.pid)]
                lost = "".join(f"; process {m.pid}: {w}" for m in alive for w in m.result.get("warnings", []))
                ended = [str(m.pid) for m in members if m not in alive]
                who = (f"all {len(members)} processes run on" if not ended else
                       f"{len(alive)} of {len(members)} processes run on (process {', '.join(ended)} ended)")
                raise GpucrError(f"{exc}; rolled back: {who} with their data intact{lost}") from exc
            if proc.process_ended(exc.pid):   # killed meanwhile: nothing runs on (it was said to)
                raise GpucrError(f"{exc}; process {exc.pid} ended during the checkpoint") from exc
            if exc.phase in ("prepare", "data out"):
                raise GpucrError(str(exc)) from exc   # nothing was released: its own words say it runs on
            raise GpucrError(f"{exc}; rolled back, process {exc.pid} runs on with its data intact") from exc
        t0 = time.perf_counter()
        _each("commit", members, lambda m: _commit(m, level))
        t0 = _lap(members, "commit", t0)
        mover.settle()   # the server's context given back first, when it does not keep it
        changes = [shape.gpu_changes(m.gpu_before, _usage_at_end(m, mover)) for m in members]
        _lap(members, "settle", t0)
        return CheckpointResult(SCHEMA_VERSION, "checkpoint", [shape.checkpoint(m.result, c) for m, c in zip(members, changes)])
    finally:
        for m in members:
            m.close()
