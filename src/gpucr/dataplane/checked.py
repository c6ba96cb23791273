"""What the mover keeps of a checkpoint for the fill (issue 26): each allocation's zero chunks, not copied out and
set by a memset at the fill, and each chunk's digest, compared with the new memory's before its fds are handed
back, so a resume whose bytes differ is refused naming the allocation and the chunk.

A zero chunk crosses the link only where the staging does not hold zeros there already from this mover's last
copy out of the process (Segment.zeroed, kept while the plan stays the same and forgotten when a copy fails): the
first cycle copies it, the next ones skip it. So the staging always holds the process's bytes: an image written
from it, a fill by another mover (the CLI's, a server started since) that has no record of the zero chunks, copy
zeros, never stale bytes; and the host never writes the staging itself (setting tens of GiB to zero on the host
costs more than the link does, and a `file:` staging shrunk under a mapping faults).
"""
from __future__ import annotations

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
    """What a copy out took: its plan, and per allocation its zero spans and its chunks' digests. scanned=False: a copy
    out asked not to scan (copy_out's scan=False): no zero chunks, no digests, so its fill copies all and checks nothing."""
    plan: Plan
    scans: dict[int, AllocationScan] = field(default_factory=dict)
    scanned: bool = True

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


def staged_zeros(g: Segment, at: int, n: int) -> bool:
    """Whether [at, at + n) of g holds zeros from this mover's last copy out of the process (Segment.zeroed): a zero
    chunk there need not cross the link again."""
    return all((k, min(CHUNK, at + n - k)) in g.zeroed for k in range(at, at + n, CHUNK))


def note_zero(g: Segment, at: int, n: int) -> None:
    """[at, at + n) of g is being copied into from memory the scan found all zero: it holds zeros once done."""
    for k in range(at, at + n, CHUNK):
        g.zeroed.add((k, min(CHUNK, at + n - k)))


def note_zeros(staged: dict[int, Segment], plan: Plan, zeros: Spans) -> None:
    """The zero spans of a copy out queued before its scan (all of it copied): the staging holds zeros there."""
    for idx, _size, seg, off in plan:
        for start, length in zeros.get(idx, []):
            note_zero(staged[seg], off + start, length)


def stage_data(g: Segment, at: int, n: int) -> None:
    """[at, at + n) of g is being copied into: no longer known to hold zeros."""
    if g.zeroed:
        for k in range(at, at + n, CHUNK):
            g.zeroed.discard((k, min(CHUNK, at + n - k)))
