"""The chunk digest and zero test (gpucr.dataplane.digest): the numpy reference against a plain reading of
its definition, the properties a fault check needs, and simcuda's kernels bit-equal to the reference."""
from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, given, settings, strategies as st

from gpucr.dataplane import digest
from gpucr.dataplane.digest import CHUNK
from gpucr.dataplane.chunks import chunk_count

MASK = (1 << 64) - 1
M, K, M2, L = 0xDABA0B6EB09322E3, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(z: int) -> int:
    return ((z ^ (z >> 32)) * M) & MASK


def _lea64(z: int) -> int:
    z = _mix(_mix(z))
    return z ^ (z >> 32)


def plain_digest(chunk: bytes) -> bytes:
    """The docstring's definition read word by word, without numpy: slow, for small chunks only."""
    padded = chunk + bytes(-len(chunk) % 8)
    a = b = 0
    for i in range(len(padded) // 8):
        x = _lea64(int.from_bytes(padded[8 * i:8 * i + 8], "little") ^ ((i + 1) * K & MASK))
        y = (x * M2) & MASK
        a, b = (a + x) & MASK, (b + (y ^ (y >> 32))) & MASK
    h0 = _lea64((a ^ (len(chunk) * L)) & MASK)
    h1 = _lea64((b + h0) & MASK)
    return h0.to_bytes(8, "little") + h1.to_bytes(8, "little")


@given(st.binary(max_size=300))
def test_the_reference_is_its_definition(data):
    assert digest.digests(data) == ([plain_digest(data)] if data else [])


def test_a_whole_chunk_is_its_definition():
    data = os.urandom(CHUNK)
    assert digest.digests(data) == [plain_digest(data)]


def test_chunks_and_tail_are_cut_at_2_mib():
    data = os.urandom(2 * CHUNK + 5)
    got = digest.digests(data)
    assert len(got) == 3 == chunk_count(len(data))
    assert got[2] == plain_digest(data[2 * CHUNK:])
    assert got[0] == digest.digests(data[:CHUNK])[0]


def test_the_length_of_a_tail_is_mixed_in():
    """Zero bytes after a tail make another digest, though the words it sums are the same."""
    assert len({d for n in range(1, 17) for d in digest.digests(bytes(n))}) == 16
    assert digest.digests(b"\x01")[0] != digest.digests(b"\x01\x00")[0]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3 * CHUNK - 1), st.integers(1, 255), st.integers(3 * CHUNK - 64, 3 * CHUNK))
def test_one_flipped_byte_changes_its_chunk_and_only_that_one(where, flip, size):
    where %= size
    data = bytearray(_RANDOM[:size])
    before = digest.digests(data)
    data[where] ^= flip
    after = digest.digests(data)
    changed = [k for k, (x, y) in enumerate(zip(before, after)) if x != y]
    assert changed == [where // CHUNK]


@settings(max_examples=20)
@given(st.sampled_from([8, 64, 4096]), st.data())
def test_swapping_two_leaves_changes_the_digest(leaf, draw):
    """Two distinct pieces of a chunk swapped (8-byte words, or 4 KiB of them): the digest changes."""
    a = draw.draw(st.integers(0, CHUNK // leaf - 1)) * leaf
    b = draw.draw(st.integers(0, CHUNK // leaf - 1).filter(lambda k: k * leaf != a)) * leaf
    data = bytearray(_RANDOM[:CHUNK])
    data[a:a + leaf], data[b:b + leaf] = data[b:b + leaf], data[a:a + leaf]
    assert digest.digests(data) != digest.digests(_RANDOM[:CHUNK])


def test_zero_chunks():
    data = bytearray(3 * CHUNK + 100)
    assert digest.zero_chunks(data) == [True] * 4
    data[2 * CHUNK - 1] = 1
    data[3 * CHUNK + 99] = 7
    assert digest.zero_chunks(data) == [True, False, True, False]
    assert digest.zero_chunks(b"") == []


def test_the_reference_hashes_64_mib_well_under_a_second():
    data = _RANDOM[:32 * CHUNK]
    t0 = time.perf_counter()
    digest.digests(data)
    digest.zero_chunks(data)
    assert time.perf_counter() - t0 < 1.0   # about 0.1 s on an idle core


_RANDOM = os.urandom(32 * CHUNK)
