"""Host memory moved whole to or from a file at an offset: the loops a short pwrite or pread needs, for the image's
data file (image.py) and the staging's files that the data plane's ring reads without mapping (dataplane/pinned.py)."""
from __future__ import annotations

import ctypes
import os


def view_at(addr: int, n: int) -> memoryview:
    """The n bytes of host memory at `addr` (a ring's pinned slot) as a writable byte view."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def write_all(fd: int, src: memoryview, at: int) -> None:
    """All of `src` written at file offset `at`; OSError as pwrite raises it."""
    done = 0
    while done < len(src):
        with src[done:] as rest:
            done += os.pwrite(fd, rest, at + done)


def read_full(fd: int, dst: memoryview, at: int) -> int:
    """`dst` filled from file offset `at`; the bytes read, fewer than its length only where the file ends first."""
    got = 0
    while got < len(dst):
        with dst[got:] as rest:
            k = os.preadv(fd, [rest], at + got)
        if k <= 0:
            break
        got += k
    return got
