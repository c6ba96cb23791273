"""Zero chunks and digests of a process's allocations, as the mover maps them (issue 26's two uses of the
kernels): which 2 MiB chunks are all zero, so a copy out skips them and a fill sets them with a memset;
and each chunk's digest, taken at the checkpoint and again after the restore's fill, so a resume whose
bytes differ is refused naming the allocation and the chunk.

Every GPU's scans are enqueued before any is read, so the GPUs scan at once, each on its own stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .chunks import CHUNK
from .kernels import Kernels, Pending


@dataclass(frozen=True)
class Mapped:
    """One allocation of the process as the mover has it mapped: in context ctx, at va, size bytes."""
    index: int
    ctx: int
    va: int
    size: int


@dataclass(frozen=True)
class AllocationScan:
    zero: list[bool]        # per chunk: all zero (empty when not asked for)
    digests: list[bytes]    # per chunk: its 16-byte digest (empty when not asked for)

    def zero_spans(self, size: int) -> list[tuple[int, int]]:
        """The zero chunks as [(offset, bytes)], neighbours joined: the mover's zero spans of an allocation."""
        spans: list[tuple[int, int]] = []
        for k, z in enumerate(self.zero):
            if not z:
                continue
            off, n = k * CHUNK, min(CHUNK, size - k * CHUNK)
            if spans and spans[-1][0] + spans[-1][1] == off:
                spans[-1] = (spans[-1][0], spans[-1][1] + n)
            else:
                spans.append((off, n))
        return spans


def scan(kernels: Kernels, mapped: Sequence[Mapped], stream_of: Callable[[int], int], zero: bool = True,
         digests: bool = True) -> dict[int, AllocationScan]:
    """{allocation index: its zero flags and digests}; stream_of(ctx) gives the stream each context's scans
    go on (a copy stream of the mover's, so they run in its order)."""
    by_ctx: dict[int, list[Mapped]] = {}
    for m in mapped:
        by_ctx.setdefault(m.ctx, []).append(m)
    pending: list[tuple[list[Mapped], Pending | None, Pending | None]] = []
    try:
        for ctx, ms in by_ctx.items():
            ranges, stream = [(m.va, m.size) for m in ms], stream_of(ctx)
            pending.append((ms, kernels.enqueue_zero_scan(ctx, ranges, stream) if zero else None,
                            kernels.enqueue_digests(ctx, ranges, stream) if digests else None))
        out: dict[int, AllocationScan] = {}
        for ms, pz, pd in pending:
            zs = pz.read() if pz else [[] for _ in ms]
            ds = pd.read() if pd else [[] for _ in ms]
            out.update({m.index: AllocationScan(z, d) for m, z, d in zip(ms, zs, ds)})
        return out
    finally:
        for _ms, pz, pd in pending:   # after a failure part way, what was not read is freed (those read are closed)
            for p in (pz, pd):
                if p is not None:
                    p.close(failed=True)


def mismatches(taken: dict[int, AllocationScan], now: dict[int, AllocationScan]) -> list[tuple[int, int]]:
    """(allocation index, chunk) of every chunk whose digest now differs from the one taken, in order; an
    allocation missing on either side, or of another length, counts from its first chunk that differs."""
    out = []
    for idx in sorted(set(taken) | set(now)):
        a = taken[idx].digests if idx in taken else []
        b = now[idx].digests if idx in now else []
        out += [(idx, k) for k in range(max(len(a), len(b))) if k >= len(a) or k >= len(b) or a[k] != b[k]]
    return out


def describe_mismatches(found: Sequence[tuple[int, int]], limit: int = 4) -> str:
    """The chunks whose bytes differ from their checkpoint, named for a refusal: allocation, chunk, bytes."""
    named = ", ".join(f"allocation {i} chunk {k} (bytes {k * CHUNK}-{(k + 1) * CHUNK - 1})" for i, k in found[:limit])
    return named + (f" and {len(found) - limit} more" if len(found) > limit else "")
