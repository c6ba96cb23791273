"""The chunk the GPU kernels scan and digest (gpucr_kernels.cu): defined once, with no numpy, for the loader and the
mover; the digest's definition and its CPU reference are in digest.py."""
from __future__ import annotations

CHUNK = 2 << 20      # bytes per chunk: the GPU's VMM granule
DIGEST_BYTES = 16    # 128 bits a chunk


def chunk_count(nbytes: int) -> int:
    """Chunks of a range of nbytes: whole ones and a tail."""
    return -(-nbytes // CHUNK)
