"""What the CLI and `import gpucr` call: each request goes to the user's gpucr server when one runs,
else it runs here, in-process, as it always could: a checkpoint or restore then with the same data plane as
the server's, run in this process (gpucr.dataplane.cli_plane.LaterPlane), never the application's.

In-process is chosen, silently, when no server was started, or when told (`--no-server`,
GPUCR_NO_SERVER=1); with a one-line note on stderr when a server is named but cannot be used (killed,
of another install). A server that dies during a checkpoint or a restore leaves the process as a killed
in-process controller would (docs/faults.md): the error says so and what to do; reads (status, ps) are
simply asked again in-process.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

from ..driver import controller_simulated
from ..errors import GpucrError, note
from ..results import (CheckpointResult, ProcessCheckpoint, ProcessRestore, ProcessStatus, RestoreResult,
                       StatusResult, Stuck, from_json)
from . import client, wire

NO_SERVER_ENV = "GPUCR_NO_SERVER"
T = TypeVar("T")
# The coordinator is imported only when a request runs here: a request sent to the server does not
# pay for its imports (tens of ms).


def server_wanted() -> bool:
    return os.environ.get(NO_SERVER_ENV, "") != "1"


def _ask(op: str, args: dict[str, Any]) -> tuple[bool, Any]:
    """(True, result) when the server answered, (False, None) to go on in-process."""
    if not server_wanted():
        return False, None
    try:
        conn = client.connect(controller_simulated())
    except client.Unavailable as exc:
        note(f"{exc}; acting in-process")
        return False, None
    if conn is None:
        return False, None
    env = {k: os.environ[k] for k in wire.REQUEST_ENV if k in os.environ}
    try:
        return True, conn.ask(op, args, env)
    except client.Unavailable as exc:
        note(f"{exc}; acting in-process")
        return False, None


def _changing(op: str, pids: list[int], args: dict[str, Any]) -> tuple[bool, Any]:
    """A checkpoint or restore through the server: its death mid-way is the end of this request."""
    try:
        return _ask(op, args)
    except client.ServerDied as exc:
        who = ", ".join(map(str, pids))
        if not pids:
            raise GpucrError(f"{exc}; run it again (in-process until a server runs again)") from exc
        raise GpucrError(f"{exc} of process {who}; it is left as a killed controller leaves it: its agent rolls back "
                         f"a checkpoint not yet committed, and 'gpucr restore {who}' completes one the driver holds "
                         f"(see 'gpucr status'); gpucr acts in-process until a server runs again") from exc


def _reading(op: str, args: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return _ask(op, args)
    except client.ServerDied as exc:
        note(f"{exc}; acting in-process")
        return False, None


def _abs_images(images: dict[int, str | Path] | None) -> dict[str, str] | None:
    # the server's cwd is not the client's: an image dir travels as an absolute path
    return {str(k): os.path.abspath(str(v)) for k, v in images.items()} if images else None


def _typed(cls: type[T], out: Any) -> T:
    """A result from the server, read back strictly (gpucr.results.from_json): one that does not parse
    is the server's fault, said in one line."""
    try:
        return from_json(cls, out)
    except ValueError as exc:
        raise GpucrError(f"the gpucr server sent a malformed {cls.__name__} ({exc}); stop it with "
                         "'gpucr serve --stop' and retry") from exc


def checkpoint_many(pids: list[int], level: str = "full", timeout: float = 30.0,
                    images: dict[int, str | Path] | None = None, scan: bool = True) -> CheckpointResult:
    """Checkpoint several processes together, all or nothing (coordinator.checkpoint_many; scan=False: --no-scan)."""
    done, out = _changing("checkpoint", pids, {"pids": list(pids), "level": level, "timeout": timeout,
                                               "images": _abs_images(images), "scan": scan})
    if done:
        return _typed(CheckpointResult, out)
    from .. import coordinator
    from ..dataplane.cli_plane import cli_plane
    with cli_plane() as mover:
        return coordinator.checkpoint_many(pids, mover, level, timeout, images, scan)


def restore_many(pids: list[int], timeout: float = 30.0, drop_staging: bool = False,
                 images: dict[int, str | Path] | None = None, force: bool = False,
                 gpu_map: dict[str, str] | None = None, accept_mismatch: bool = False) -> RestoreResult:
    """Restore several processes together (coordinator.restore_many)."""
    done, out = _changing("restore", pids, {"pids": list(pids), "timeout": timeout, "drop_staging": drop_staging,
                                            "images": _abs_images(images), "force": force, "gpu_map": gpu_map or {},
                                            "accept_mismatch": accept_mismatch})
    if done:
        return _typed(RestoreResult, out)
    from .. import coordinator
    from ..dataplane.cli_plane import cli_plane
    with cli_plane() as mover:
        return coordinator.restore_many(pids, mover, timeout, drop_staging, images, force, gpu_map, accept_mismatch)


def checkpoint(pid: int, level: str = "full", timeout: float = 30.0, image: str | Path | None = None,
               scan: bool = True) -> ProcessCheckpoint:
    """Save the process's GPU memory and give it back; the process stays alive, parked (coordinator.checkpoint_many)."""
    return checkpoint_many([pid], level, timeout, {pid: image} if image is not None else None, scan).processes[0]


def restore(pid: int, timeout: float = 30.0, drop_staging: bool = False, image: str | Path | None = None,
            force: bool = False, gpu_map: dict[str, str] | None = None, accept_mismatch: bool = False) -> ProcessRestore:
    """Put every byte back at the same address and let the process carry on (coordinator.restore_many)."""
    return restore_many([pid], timeout, drop_staging, {pid: image} if image is not None else None, force,
                        gpu_map, accept_mismatch).processes[0]


def _server_only(op: str, args: dict[str, Any], simulated: bool, needs: str, timeout: float | None) -> dict[str, Any]:
    """A request only the server can answer (its swap service): GpucrError when none runs."""
    conn = client.connect(simulated)
    if conn is None:
        raise GpucrError(f"{needs} needs the gpucr server, and none runs: start one with 'gpucr serve'")
    out = conn.ask(op, args, timeout=timeout)
    if not isinstance(out, dict):
        raise GpucrError(f"the gpucr server sent a malformed {op} answer; stop it with 'gpucr serve --stop'")
    return out


def register_swap(simulated: bool, args: dict[str, Any]) -> dict[str, Any]:
    """Register an app with the server's swap service (`gpucr run --swap`): there is no in-process way."""
    return _server_only("swap_register", args, simulated, "--swap", 10.0)


def swap(op: str, args: dict[str, Any], needs: str, timeout: float | None = None) -> dict[str, Any]:
    """The swap service's view (`swap_view`) or an app parked, resumed or changed by hand (`swap_park`, `swap_resume`,
    `swap_set`; server/swap_ops.py), on the server of this controller's driver kind. `needs`: who asks, for the error
    when no server runs. No deadline by default: the server bounds a park by the app's --park-deadline."""
    return _server_only(op, args, controller_simulated(), needs, timeout)


def status(pid: int) -> ProcessStatus:
    """The live state of a process under gpucr (reading.status)."""
    done, out = _reading("status", {"pid": pid})
    if done:
        return _typed(ProcessStatus, out)
    from .. import reading
    return reading.status(pid)


def ps() -> StatusResult:
    """Every live process under gpucr that this user can see (reading.ps)."""
    done, out = _reading("ps", {})
    if done:
        return _typed(StatusResult, out)
    from .. import reading
    return reading.ps()


def recover(list_only: bool, timeout: float) -> list[Stuck]:
    """`gpucr recover`: each process left stuck (recover.find / recover.recover)."""
    done, out = _changing("recover", [], {"list": list_only, "timeout": timeout})
    if done:
        if not isinstance(out, list):
            raise GpucrError("the gpucr server sent a malformed recover answer; stop it with 'gpucr serve --stop'")
        return [_typed(Stuck, s) for s in out]
    from .. import recover as recovery
    return recovery.find() if list_only else recovery.recover(timeout=timeout)
