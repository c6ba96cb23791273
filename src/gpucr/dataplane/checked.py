"""What the mover keeps of a checkpoint for the fill (issue 26): each allocation's zero chunks, not copied out and
set by a memset at the fill, and each chunk's digest, compared with the new memory's before its fds are handed
back, so a resume whose bytes differ is refused naming the allocation and the chunk.

A zero chunk is not carried over the link, but its place in staging is set to zero on the host, where the staging
does not hold zeros there already from this mover's last copy out of the process (Segment.zeroed). So the
staging always holds the process's bytes: an image written from it, a fill by another mover (the CLI's, a server
started since) that has no record of the zero chunks, copy zeros, never stale bytes. Setting a range on the host
costs host memory bandwidth once; the cycles after the first, with the same plan, skip it.

The CPU writes the staging only where it cannot fault: through the mapping of a memfd sealed against shrinking
(the agent's, staging_file.py), else through the file (pwrite: a `file:` staging its process shrank since is
written, not a SIGBUS in the server). A file that takes no pwrite (hugetlbfs) has its zero chunks copied.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import GpucrError
from .chunks import CHUNK
from .kernels import Kernels
from .pinned import Segment
from .scan import AllocationScan, Mapped, describe_mismatches, mismatches, scan

Plan = list[tuple[int, int, int, int]]   # [(index, bytes, segment, offset)]
Spans = dict[int, list[tuple[int, int]]]   # allocation index -> [(offset, bytes)] in it


@dataclass
class Taken:
    """What a copy out took: its plan, and per allocation its zero spans and its chunks' digests."""
    plan: Plan
    scans: dict[int, AllocationScan] = field(default_factory=dict)

    def zeros(self) -> Spans:
        sizes = {idx: size for idx, size, _seg, _off in self.plan}
        return {idx: s.zero_spans(sizes[idx]) for idx, s in self.scans.items() if idx in sizes}

    def digest_count(self) -> int:
        return sum(len(s.digests) for s in self.scans.values())


def scan_taken(kernels: Kernels, mapped: Sequence[Mapped], stream_of: Callable[[int], int]) -> dict[int, AllocationScan]:
    """Zero flags and digests of every allocation the copy out mapped, before any of it is copied."""
    return scan(kernels, mapped, stream_of, zero=True, digests=True)


def check_filled(kernels: Kernels, mapped: Sequence[Mapped], stream_of: Callable[[int], int], taken: Taken) -> int:
    """The new memory's digests compared with those taken at the checkpoint (its copies synchronised); returns
    the chunks compared. GpucrError naming each chunk that differs."""
    now = scan(kernels, mapped, stream_of, zero=False, digests=True)
    found = mismatches({i: s for i, s in taken.scans.items() if i in now}, now)
    if found:
        raise GpucrError(f"the restored memory differs from its checkpoint in {describe_mismatches(found)}: the "
                         "staging was damaged after the checkpoint; the process stays checkpointed. Restore it from "
                         "an image if one was written, or accept its bytes as they are: gpucr restore "
                         "--accept-mismatch PID")
    return sum(len(s.digests) for s in now.values())


def forget_zeroed(segments: Sequence[Segment]) -> None:
    """What the segments hold is no longer known (another plan, or another writer): every zero range forgotten."""
    for g in segments:
        g.zeroed.clear()


_ZEROS = bytes(CHUNK)


def _cannot_shrink(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


def stage_zero(g: Segment, fd: int, at: int, n: int) -> int | None:
    """[at, at + n) of staging segment g (its file `fd`) set to zero on the host, chunk by chunk, except where this
    mover's last copy out of the process left zeros already; returns the bytes set, None where the file takes no
    write (the range is then to be copied)."""
    done, mapped = 0, _cannot_shrink(fd)
    for k in range(at, at + n, CHUNK):
        piece = (k, min(CHUNK, at + n - k))
        if piece in g.zeroed:
            continue
        if mapped:
            ctypes.memset(g.addr + k, 0, piece[1])
        else:
            try:
                if os.pwrite(fd, _ZEROS[:piece[1]], k) != piece[1]:
                    return None
            except OSError:
                return None
        g.zeroed.add(piece)
        done += piece[1]
    return done


def stage_data(g: Segment, at: int, n: int) -> None:
    """[at, at + n) of g is being copied into: no longer known to hold zeros."""
    if g.zeroed:
        for k in range(at, at + n, CHUNK):
            g.zeroed.discard((k, min(CHUNK, at + n - k)))
