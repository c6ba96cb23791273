"""The chunk the GPU kernels scan and digest (gpucr_kernels.cu): defined once, with no numpy, for the loader and the
mover, with the spans of zero chunks a move skips; the digest's definition and its CPU reference are in digest.py."""
from __future__ import annotations

import bisect
from typing import Iterator

CHUNK = 2 << 20      # bytes per chunk: the GPU's VMM granule
DIGEST_BYTES = 16    # 128 bits a chunk
Spans = dict[int, list[tuple[int, int]]]   # allocation index -> [(offset, bytes)] in it


def chunk_count(nbytes: int) -> int:
    """Chunks of a range of nbytes: whole ones and a tail."""
    return -(-nbytes // CHUNK)


def spans(lo: int, hi: int, zero: list[tuple[int, int]]) -> Iterator[tuple[int, int, bool]]:
    """[lo, hi) as (start, bytes, zero) spans in order, `zero` ([(offset, bytes)], sorted) marking those to set to zero."""
    at = lo
    for off, n in zero:
        off, end = max(off, at), min(off + n, hi)
        if end <= off:
            continue
        if off > at:
            yield at, off - at, False
        yield off, end - off, True
        at = end
    if at < hi:
        yield at, hi - at, False


def zero_within(zero: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The spans of `zero` (sorted, not overlapping) that reach into [lo, hi): a part's, without a walk over them all."""
    first = max(bisect.bisect_right(zero, (lo, 1 << 62)) - 1, 0)
    return [z for z in zero[first:bisect.bisect_left(zero, (hi, 0))] if z[0] + z[1] > lo]
