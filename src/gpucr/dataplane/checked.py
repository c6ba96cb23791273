"""What the mover keeps of a checkpoint for the fill (issue 26): each allocation's zero chunks, not copied out and
set by a memset at the fill, and each chunk's digest, compared on the GPU with the new memory's (under the fill's
copies) before its fds are handed back, so a resume whose bytes differ is refused naming the allocation and the chunk.

A chunk crosses the link at a copy out only where the staging does not hold the same bytes there already from this
mover's last copy out of the process (Segment.held: each chunk's digest, kept while the plan stays the same and
forgotten when a copy fails or takes no digests): the first cycle copies everything, the next ones skip each chunk
whose digest on the GPU is unchanged: the zero chunks of a KV cache never written, and weights that never change. So
the staging always holds the process's bytes: an image written from it, a fill by another mover (the CLI's, a server
started since) that has no record of them, copy them all, never stale bytes; and the host never writes the staging
itself (setting tens of GiB to zero on the host costs more than the link does, and a `file:` staging shrunk under a
mapping faults). A staging changed behind the mover's back since (a fault in host memory) is what the fill's check
finds: the GPU's digest was taken at the copy out, not from the staging.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import GpucrError
from .chunks import CHUNK, Spans, chunk_count
from .kernels import Kernels
from .pinned import Segment
from .scan import AllocationScan
from .sweep import Sweeps, room

Plan = list[tuple[int, int, int, int]]   # [(index, bytes, segment, offset)]


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


class Checker:
    """A fill's check: each part's new memory hashed on the GPU once its copies have landed and compared there with the
    digests taken at the checkpoint, on each GPU's kernel stream, so the check runs under the copies and only its last
    batch after them. Only a mismatch count and the first mismatching chunk come back. Allocations given as (index, GPU,
    bytes), in parts of at most `step` bytes, a check due once `step` bytes are added on a GPU; those `taken` has no
    digests of are not checked."""

    def __init__(self, kernels: Kernels, stream_of: Callable[[int], int], sizes: Sequence[tuple[int, int, int]],
                 taken: Taken, step: int) -> None:
        self.taken, self.step = taken.scans, step
        self.sweeps = Sweeps(kernels, "check", stream_of, room([(dev, n) for i, dev, n in sizes if i in self.taken], step))

    def add(self, dev: int, ctx: int, index: int, va: int, at: int, size: int) -> None:
        """Bytes [at, at + size) of allocation `index`, mapped at va (its start) in ctx on GPU dev, whose copies (and
        memsets) are queued: checked after them."""
        if index in self.taken:
            k = at // CHUNK
            self.sweeps.of(dev, ctx).add(index, k, va + at, size, b"".join(self.taken[index].digests[k:k + chunk_count(size)]))

    def due(self, dev: int) -> bool:
        sweep = self.sweeps.by_dev.get(dev)
        return sweep is not None and sweep.queued() >= self.step

    def launch(self, dev: int, copies: Sequence[int]) -> None:
        """A check of what was added on GPU dev since the last, after the work queued so far on the streams `copies`."""
        self.sweeps.by_dev[dev].flush(copies)

    def finish(self) -> int:
        """What is left checked (every copy done: the caller synchronised them) and the verdict: the chunks compared;
        GpucrError naming the first chunk that differs on each GPU."""
        found, count = [], 0
        for sweep in self.sweeps.by_dev.values():
            n, first = sweep.verdict()
            count += n
            found += [first] if first else []
        if count:
            raise GpucrError(f"the restored memory differs from its checkpoint in {describe_mismatches(found, count)}: the "
                             "staging was damaged after the checkpoint; the process stays checkpointed. Restore it from "
                             "an image if one was written, or accept its bytes as they are: gpucr restore "
                             "--accept-mismatch PID")
        return sum(sweep.chunks for sweep in self.sweeps.by_dev.values())

    def close(self, failed: bool = False) -> None:
        self.sweeps.close(failed)


def describe_mismatches(first: Sequence[tuple[int, int]], count: int) -> str:
    """The chunks whose bytes differ from their checkpoint, named for a refusal: the first of each GPU as allocation,
    chunk and bytes, and how many more."""
    named = ", ".join(f"allocation {i} chunk {k} (bytes {k * CHUNK}-{(k + 1) * CHUNK - 1})" for i, k in first)
    more = count - len(first)
    return f"{count} chunk{'s' if count > 1 else ''}: {named}" + (f" and {more} more" if more > 0 else "")


def forget_held(segments: Sequence[Segment]) -> None:
    """What the segments hold is no longer known (another plan, another writer, a copy that failed or took no
    digests): every chunk will be copied again."""
    for g in segments:
        g.held.clear()


def out_runs(g: Segment, off: int, lo: int, hi: int, scan: AllocationScan) -> list[tuple[int, int, bool, bool]]:
    """A copy out's bytes [lo, hi) of an allocation staged at `off` in g, scanned, as runs of chunks (start, bytes,
    held, zero): held where g holds the same bytes already (the digest note_held left there equals the GPU's), which
    need not cross the link again; zero where the chunk is all zero."""
    assert lo % CHUNK == 0, lo
    runs: list[tuple[int, int, bool, bool]] = []
    for k in range(lo // CHUNK, chunk_count(hi)):
        at = k * CHUNK
        n = min(CHUNK, hi - at)
        kind = (bool(scan.digests[k]) and g.held.get((off + at, n)) == scan.digests[k], scan.zero[k])
        if runs and runs[-1][2:] == kind:
            runs[-1] = (runs[-1][0], runs[-1][1] + n, *kind)
        else:
            runs.append((at, n, *kind))
    return runs


def note_held(staged: dict[int, Segment], plan: Plan, taken: Taken, unchanged: bool) -> None:
    """A copy out done and drained: the staging holds, chunk by chunk, the bytes whose digests its scan took. Noted
    are those a later copy out may skip: the zero chunks, and with `unchanged` (gpucr serve --skip-unchanged) every
    chunk; so where nothing may be skipped nothing is noted, and a copy out does not wait for its scan (mover.py's
    `early`). One that took no digests (`--no-scan`) leaves nothing known."""
    if not taken.scanned:
        forget_held(list(staged.values()))
    for idx, size, seg, off in plan:
        scan = taken.scans.get(idx)
        if scan is not None:
            g = staged[seg]
            for k, digest in enumerate(scan.digests):
                if digest and (unchanged or scan.zero[k]):
                    g.held[(off + k * CHUNK, min(CHUNK, size - k * CHUNK))] = digest
