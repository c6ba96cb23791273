"""The chunk digest and the zero test, defined once: the CPU reference of the GPU kernels
(native/kernels/gpucr_kernels.cu) and of simcuda's (native/simcuda/gpucr_kernels.c), which must agree
with it bit for bit (tests/test_digest.py, tests/gpu/test_kernels.py).

A range of device memory (an allocation) is cut into chunks of CHUNK bytes from its start: 2 MiB, the GPU's
VMM granule, of which every allocation the mover maps is a whole number. The last chunk may be shorter (a
tail). Each chunk has

- a **zero flag**: every byte of it is zero;
- a **digest** of 128 bits (16 bytes), "gpucr-d128", computed as follows. All arithmetic is on unsigned
  64-bit integers, modulo 2**64.

  1. The chunk is read as little-endian 64-bit words w[0], w[1], ...; a tail whose length is not a
     multiple of 8 has its last word padded with zero bytes.
  2. Each word is a leaf. Its leaf hash mixes in its index i, so that the same word at another place
     hashes differently (order matters), and then goes through the lea64 mixer (the LXM generators'
     bijective finaliser, all of whose shifts are by 32: free on a GPU):

         mix(z)  = (z ^ (z >> 32)) * M
         x[i]    = lea64(w[i] ^ (i + 1) * K)      lea64(z) = mix(mix(z)) ^ (mix(mix(z)) >> 32)
         y[i]    = (x[i] * M2) ^ ((x[i] * M2) >> 32)

  3. The leaves combine by two sums, which a GPU takes in any order (a tree of warp shuffles):

         A = sum of x[i],   B = sum of y[i]

  4. The chunk's length n in bytes (CHUNK, or a tail's) is mixed in, and the two lanes with each other:

         h0 = lea64(A ^ n * L),   h1 = lea64(B + h0)
         digest = h0 as 8 little-endian bytes, then h1 as 8 little-endian bytes

  M = 0xDABA0B6EB09322E3, K = 0x9E3779B97F4A7C15, M2 = 0xBF58476D1CE4E5B9, L = 0x94D049BB133111EB.

Each leaf hash is a bijection of its word, so any change inside one 8-byte word changes A for certain;
changes in several words, or leaves swapped, change the digest except with a chance near 2**-128. The
length makes a tail differ from the same bytes with zeros after them. It guards against faults (bit flips,
lost, torn or misplaced copies), not against an attacker: it is not a cryptographic hash
(docs/security.md).
"""
from __future__ import annotations

import numpy as np   # the reference only: the package itself needs no numpy (chunks.py has the sizes)

from .chunks import CHUNK

WORDS = CHUNK // 8

M = np.uint64(0xDABA0B6EB09322E3)
K = np.uint64(0x9E3779B97F4A7C15)
M2 = np.uint64(0xBF58476D1CE4E5B9)
L = np.uint64(0x94D049BB133111EB)
_32 = np.uint64(32)

# (i + 1) * K for every word index of a chunk, made once: 2 MiB
_KEYS = np.arange(1, WORDS + 1, dtype=np.uint64) * K


def _mix_into(x: np.ndarray, t: np.ndarray) -> None:
    """x = (x ^ (x >> 32)) * M, in place; t is scratch of the same shape."""
    np.right_shift(x, _32, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, M, out=x)


def _lea64_into(x: np.ndarray, t: np.ndarray) -> None:
    _mix_into(x, t)
    _mix_into(x, t)
    np.right_shift(x, _32, out=t)
    np.bitwise_xor(x, t, out=x)


def _lea64(z: int) -> int:
    a = np.array([z], dtype=np.uint64)
    _lea64_into(a, np.empty_like(a))
    return int(a[0])


def _finish(a: int, b: int, n: int) -> bytes:
    mask = (1 << 64) - 1
    h0 = _lea64((a ^ (n * int(L))) & mask)
    h1 = _lea64((b + h0) & mask)
    return h0.to_bytes(8, "little") + h1.to_bytes(8, "little")


def _words(chunk: memoryview) -> np.ndarray:
    """The chunk as little-endian u64 words, a last partial word padded with zeros."""
    n = len(chunk)
    if n % 8 == 0:
        return np.frombuffer(chunk, dtype="<u8").astype(np.uint64, copy=True)
    padded = bytearray(-(-n // 8) * 8)
    padded[:n] = chunk
    return np.frombuffer(padded, dtype="<u8").astype(np.uint64)


def _chunk_digest(chunk: memoryview) -> bytes:
    x = _words(chunk)
    t = np.empty_like(x)
    np.bitwise_xor(x, _KEYS[:len(x)], out=x)
    _lea64_into(x, t)
    a = int(np.add.reduce(x, dtype=np.uint64))   # wraps modulo 2**64, as the GPU's sum does
    np.multiply(x, M2, out=x)
    np.right_shift(x, _32, out=t)
    np.bitwise_xor(x, t, out=x)
    b = int(np.add.reduce(x, dtype=np.uint64))
    return _finish(a, b, len(chunk))


def digests(buf) -> list[bytes]:
    """The 16-byte digest of each chunk of buf (any bytes-like object), as defined above."""
    view = memoryview(buf).cast("B")
    return [_chunk_digest(view[off:off + CHUNK]) for off in range(0, len(view), CHUNK)]


def zero_chunks(buf) -> list[bool]:
    """For each chunk of buf, whether all of its bytes are zero."""
    view = memoryview(buf).cast("B")
    whole = len(view) // CHUNK
    flags: list[bool] = []
    if whole:
        words = np.frombuffer(view[:whole * CHUNK], dtype=np.uint64).reshape(whole, WORDS)
        flags = (~words.any(axis=1)).tolist()
    if len(view) % CHUNK:
        flags.append(not np.frombuffer(view[whole * CHUNK:], dtype=np.uint8).any())
    return flags
