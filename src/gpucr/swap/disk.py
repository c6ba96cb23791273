"""Host memory, then disk (issue 27 item 5): parked apps live in host memory within the server's budget
(`gpucr serve --host-budget`); when parking one more would pass it, the least recently used parked app goes to disk
as an image (today's format, with its certificate: gpucr.coordinator.spill) and its staging is freed. It comes back
from the image when needed. budget.py decides who goes; this module keeps the count, the park dir and the moves.

A move to disk that cannot be made (a bad park dir, a write the disk refuses) is said in one log line and leaves the
app parked in host memory; the park that needed the room is then refused (that app stays resident), so the budget
holds and nothing is lost.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable

from .. import paths
from .. import target as targets
from ..errors import GpucrError
from .apps import ON_DISK, PARKED, Apps, SwapApp
from .budget import InHost, to_disk

MOVED, BUSY, FAILED = "moved", "busy", "failed"


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, GpucrError) else f"{type(exc).__name__}: {exc}"


class ParkDir:
    """Where images of parked apps go: `--park-dir`, which must exist, or by default gpucr/parked under the user's
    state dir, made at first use. Either must be a directory of the server's user, mode 0700, not a link."""

    def __init__(self, given: str | None) -> None:
        self.given = given is not None
        self.path = Path(given).absolute() if given is not None else paths.state_dir() / "parked"

    def problem(self) -> str | None:
        """Why images cannot go there now (one line with the way out), or None."""
        if not self.given:
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.path.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                return f"cannot make the park dir {self.path}: {exc.strerror}; give one with 'gpucr serve --park-dir DIR'"
        why = paths.dir_problem(self.path, os.getuid())
        if why is None:
            return None
        fix = "make it (mkdir -m 700)" if not self.path.exists() else "give a directory of yours with mode 0700"
        return f"the park dir is not usable: {why}; {fix}, or name another with 'gpucr serve --park-dir DIR'"

    def new_image_dir(self, app: SwapApp) -> Path:
        """A new, empty directory (0700) for the app's image, named by its process (pid and start time). One there
        already is never reused: it may hold the only copy of a parked app's data, left by a server that ended."""
        image = self.path / f"app-{app.pid}-{app.start_time}"
        try:
            image.mkdir(mode=0o700)
        except OSError as exc:
            raise GpucrError(f"cannot make {image}: {exc.strerror}" + (
                " (left by an earlier server? 'gpucr restore --image' it, or remove it)"
                if exc.errno == errno.EEXIST else "")) from None
        return image

    @staticmethod
    def remove(image: Path) -> None:
        """An image directory and the files in it (never through a link: each name is taken from the directory's fd,
        and only regular files are removed)."""
        fd = os.open(image, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in os.listdir(fd):
                if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(image)


class HostThenDisk:
    """The host budget across parked apps, and their moves to disk and back. `write_image(pid, dir)`: the server's
    spill of a checkpointed process (raises on failure); `turn(pid)`: the app's lock for one move at a time."""

    def __init__(self, budget: int | None, park_dir: ParkDir, apps: Apps, turn: Callable[[int], threading.Lock],
                 write_image: Callable[[int, Path], Any], log: Callable[[str], None]) -> None:
        self.budget, self.park_dir, self.apps = budget, park_dir, apps
        self._turn, self._write_image, self._log = turn, write_image, log
        self._lock = threading.Lock()   # one budget decision at a time: each reserves what its park will hold

    @property
    def drops_staging(self) -> bool:
        """With a budget, a resumed app gives its staging back: host memory is then held only by parked apps."""
        return self.budget is not None

    # ---- before and after a park ----

    def room_for(self, app: SwapApp) -> bool:
        """Room in host memory for the app's park (what it holds in VMM memory, all of which its park copies), moving
        the least recently used parked apps to disk as needed; the park's staging is reserved. False (said in the log) when there is none: the app is not parked."""
        if self.budget is None:
            return True
        with self._lock:
            need = max(app.vmm_bytes, app.host_bytes)
            skipped: set[str] = set()
            while True:
                others = [a for a in self.apps.all() if a.pid != app.pid and a.host_bytes > 0]
                plan = to_disk([InHost(a.name, a.host_bytes, a.last_submit, a.state == PARKED and a.name not in skipped)
                                for a in others], need, self.budget)
                if not plan.suffices:
                    return self._refuse(app, plan.why_not)
                if not plan.order:
                    app.host_bytes = need   # reserved until the park says what it holds (parked)
                    return True
                if not skipped and (problem := self.park_dir.problem()):
                    return self._refuse(app, problem)
                victim = next(a for a in others if a.name == plan.order[0])
                moved = self.to_disk(victim)
                if moved == FAILED:
                    return self._refuse(app, f"{victim.name} could not go to disk")
                if moved == BUSY:
                    skipped.add(victim.name)

    def _refuse(self, app: SwapApp, why: str) -> bool:
        """Said once while the reason stays the same (an idle app is tried again each idle period)."""
        if app.why != (said := f"not parked: host budget: {why}"):
            app.why = said
            self._log(f"parking swap app {app.name} (pid {app.pid}) would pass --host-budget {self.budget}: {why}; "
                      "it stays resident")
        return False

    def parked(self, app: SwapApp, ok: bool) -> None:
        """The park's outcome: what its staging holds now (as its agent says), or the reservation given back."""
        if self.budget is None:
            return
        app.host_bytes = _staging_bytes(app.pid, app.host_bytes) if ok else 0

    # ---- the moves ----

    def to_disk(self, app: SwapApp) -> str:
        """Move a parked app's data to an image in the park dir and free its staging: MOVED; BUSY when it is being
        moved by someone else now (skipped, never waited for: its mover may wait on us); FAILED, said in the log,
        when the image could not be written (it stays parked in host memory)."""
        turn = self._turn(app.pid)
        if not turn.acquire(blocking=False):
            return BUSY
        try:
            if app.state != PARKED or app.image:
                return BUSY
            try:
                image = self.park_dir.new_image_dir(app)
            except GpucrError as exc:
                return self._not_moved(app, exc)
            try:
                self._write_image(app.pid, image)
            except Exception as exc:   # noqa: BLE001 - whatever failed, the app stays parked in host memory...
                staged = _status(app.pid).get("staged")
                if staged is not False:   # (unknown: the image is kept, it may hold the only copy)
                    if staged:
                        self._remove_quietly(image)
                    return self._not_moved(app, exc)
                # ...unless its staging was freed before the failure: then the image holds its only copy, and is kept
                self._log(f"moving parked swap app {app.name} (pid {app.pid}) to disk: {_reason(exc)}; its staging "
                          "was freed, its data is in the image")
            freed, app.host_bytes, app.image = app.host_bytes, 0, str(image)
            self.apps.set_state(app.pid, ON_DISK)
            self._log(f"moved parked swap app {app.name} (pid {app.pid}) to disk: {image} ({freed} bytes of host memory "
                      f"freed); should this server end, bring it back with 'gpucr restore --image {image} {app.pid}'")
            return MOVED
        finally:
            turn.release()

    def _not_moved(self, app: SwapApp, exc: Exception) -> str:
        """Said once per reason (the parks that need the room try again): the app stays parked in host memory."""
        if app.why != (said := f"stays in host memory: {_reason(exc)}"):
            app.why = said
            self._log(f"moving parked swap app {app.name} (pid {app.pid}) to disk failed, it stays parked in host "
                      f"memory: {_reason(exc)}")
        return FAILED

    def resumed(self, app: SwapApp) -> None:
        """The app is resident again: its image, if it came from one, is removed; with a budget its staging was given
        back by the restore."""
        if self.drops_staging:
            app.host_bytes = 0
        if app.image:
            image, app.image = Path(app.image), None
            self._remove_quietly(image)

    def forget(self, app: SwapApp) -> None:
        """The app ended: its image can restore nothing any more."""
        if app.image:
            image, app.image = Path(app.image), None
            self._remove_quietly(image)

    def _remove_quietly(self, image: Path) -> None:
        try:
            self.park_dir.remove(image)
        except OSError as exc:
            self._log(f"cannot remove the image {image}: {exc.strerror}; remove it by hand")

    def info(self) -> dict[str, Any]:
        """What `gpucr ps` and `serve --status --json` show: the budget, what parked apps hold of it, the park dir."""
        apps = self.apps.all()
        return {"host_budget_bytes": self.budget, "host_bytes": sum(a.host_bytes for a in apps),
                "on_disk": sum(1 for a in apps if a.image), "park_dir": str(self.park_dir.path)}


def _status(pid: int) -> dict[str, Any]:
    """Its agent's status now; {} when it cannot be read."""
    try:
        with targets.resolve(pid).connect() as agent:
            return agent.call("status", timeout=5.0)
    except (OSError, GpucrError):
        return {}


def _staging_bytes(pid: int, otherwise: int) -> int:
    """The staging its agent holds now; `otherwise` when it cannot be read."""
    held = _status(pid).get("staging_bytes")
    return held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else otherwise
