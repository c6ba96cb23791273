"""Zero chunks and digests of a copy out's allocations, as the mover maps them (issue 26's first use of the kernels):
which 2 MiB chunks are all zero, so a copy out skips them and a fill sets them with a memset; and each chunk's digest,
compared on the GPU with the new memory's after the restore's fill (checked.py).

The scan runs in parts (sweep.py) while the allocations are mapped, one launch per batch on each GPU's kernel stream,
each chunk read once for both. A copy out that waits for the scan (it may skip zero chunks) queues a part's copies as
soon as its batch is read, so its first copies wait for the first batch, not for the whole scan; one that does not
wait runs its copies beside the scan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .chunks import CHUNK, chunk_count
from .kernels import Kernels
from .sweep import Batch, Part, Sweep, Sweeps, room


@dataclass(frozen=True)
class AllocationScan:
    zero: list[bool]        # per chunk: all zero
    digests: list[bytes]    # per chunk: its 16-byte digest

    def zero_spans(self, size: int, at: int = 0, n: int | None = None) -> list[tuple[int, int]]:
        """The zero chunks of [at, at + n) (a part; default the whole allocation of `size` bytes) as [(offset, bytes)]
        in the allocation, neighbours joined: the mover's zero spans."""
        end = size if n is None else at + n
        spans: list[tuple[int, int]] = []
        for k in range(at // CHUNK, chunk_count(end)):
            if not self.zero[k]:
                continue
            off, length = k * CHUNK, min(CHUNK, size - k * CHUNK)
            if spans and spans[-1][0] + spans[-1][1] == off:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            else:
                spans.append((off, length))
        return spans


class Scanner:
    """One copy out's scan of its allocations, given as (index, GPU, bytes), added in parts of at most `step` bytes and
    launched once `step` bytes are added on a GPU; stream_of(ctx): the kernel stream of a context. wait_s: the seconds
    spent waiting for a batch's results."""

    def __init__(self, kernels: Kernels, stream_of: Callable[[int], int], sizes: Sequence[tuple[int, int, int]],
                 step: int) -> None:
        self.step = step
        self.sweeps = Sweeps(kernels, "scan", stream_of, room([(dev, size) for _i, dev, size in sizes], step))
        self.scans = {i: AllocationScan([False] * chunk_count(size), [b""] * chunk_count(size)) for i, _dev, size in sizes}
        self._launched: list[tuple[Sweep, Batch]] = []
        self.wait_s = 0.0

    def add(self, dev: int, ctx: int, index: int, va: int, at: int, size: int) -> None:
        """Bytes [at, at + size) of allocation `index`, mapped at va (its start) in ctx on GPU dev."""
        sweep = self.sweeps.of(dev, ctx)
        sweep.add(index, at // CHUNK, va + at, size)
        if sweep.queued() >= self.step:
            self._launch(sweep)

    def _launch(self, sweep: Sweep) -> None:
        batch = sweep.flush()
        if batch is not None:
            self._launched.append((sweep, batch))

    def ready(self, every: bool = False) -> list[Part]:
        """The parts whose results came back since the last call, in the order added: those of every batch launched
        but the newest, waited for, and the newest too if it is done (else it runs while the next allocations are
        mapped); every: all, the rest launched first."""
        if every:
            for sweep in self.sweeps.by_dev.values():
                self._launch(sweep)
        keep = 0 if every or not self._launched or self._launched[-1][0].done(self._launched[-1][1]) else 1
        todo, self._launched = self._launched[:len(self._launched) - keep], self._launched[len(self._launched) - keep:]
        t0, out = time.perf_counter(), []
        for sweep, batch in todo:
            for part, zero, digests in sweep.read(batch):
                s, k = self.scans[part.index], part.chunk
                s.zero[k:k + part.chunks], s.digests[k:k + part.chunks] = zero, digests
                out.append(part)
        self.wait_s += time.perf_counter() - t0
        return out

    def close(self, failed: bool = False) -> None:
        self.sweeps.close(failed)
