"""The data plane of a request run in the CLI process, with no gpucr server (`--no-server`, or none running): the
server's Mover, made at the request's first copy and given back at its end (docs/server.md)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from ..driver import Driver, controller_driver
from ..plane import Stats
from .mover import Mover
from .staging_make import StagingMaker


class LaterPlane(StagingMaker):
    """The mover of one request run in the CLI process, with no server (`--no-server`, or none running): the same
    mover, with no routes, its staging mapped but not pinned (a fresh process cannot pin tens of GiB in time) and
    its copies through a small pinned ring (ring.py). Made at its first copy, after the coordinator's checks of
    the request, so that a request refused there (another user's process, a bad argument) loads no driver here;
    `drv`, else the controller's driver. Making staging needs no driver (StagingMaker): it makes no mover."""
    plane = "cli"

    def __init__(self, drv: Driver | None = None) -> None:
        self._drv = drv
        self._mover: Mover | None = None

    def _made(self) -> Mover:
        if self._mover is None:
            self._mover = Mover(self._drv or controller_driver(), routes=False, keep_context=False,
                                pinned_staging=False)
        return self._mover

    def copy_out(self, *args: Any, **kwargs: Any) -> Stats:
        return self._made().copy_out(*args, **kwargs)

    def fill(self, *args: Any, **kwargs: Any) -> tuple[Stats, list[tuple[int, int]]]:
        return self._made().fill(*args, **kwargs)

    def forget(self, pid: int) -> None:
        if self._mover is not None:
            self._mover.forget(pid)

    def settle(self) -> None:
        if self._mover is not None:
            self._mover.settle()

    def close(self) -> None:
        if self._mover is not None:
            self._mover.close()


@contextmanager
def cli_plane(drv: Driver | None = None) -> Iterator[LaterPlane]:
    """The CLI's mover for one request (LaterPlane), its contexts, ring and mappings given back at the end, so that
    the process is left as the server leaves it."""
    plane = LaterPlane(drv)
    try:
        yield plane
    finally:
        plane.close()
