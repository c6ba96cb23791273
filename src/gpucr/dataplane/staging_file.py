"""A process's staging file as the gpucr server receives it, checked before the server maps it.

The process is not trusted, and a file it shrinks under the server's mapping makes a CPU access past the new
end a SIGBUS in the server. The agent seals its staging memfds against shrinking (native/agent/staging.c), so
a memfd that is not sealed so did not come from gpucr's agent: it is refused. A `file:DIR` staging cannot be
sealed; it is checked to be as long as it says when mapped (pinned.open_segment), and after that the server
touches it only through the driver, which copies from the pages it pinned: a truncation does not take those
from it (simcuda, which cannot keep them, fails such a copy with an error).
"""
from __future__ import annotations

import fcntl
import os

from ..errors import GpucrError


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


def refuse_unsealed_memfd(fd: int, i: int) -> None:
    """Raise GpucrError if segment i's file `fd` is a memfd that can still be shrunk (no F_SEAL_SHRINK)."""
    try:
        sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return   # a file of a filesystem without seals: never a memfd
    if not sealed and _is_memfd(fd):
        raise GpucrError(f"the process's staging segment {i} is a memfd not sealed against shrinking "
                         "(F_SEAL_SHRINK), as gpucr's agent seals it: gpucr's data plane will not copy into it")
