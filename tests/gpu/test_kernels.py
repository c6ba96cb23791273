"""gpucr's kernels from the checked-in fatbin on the real GPU, bit-equal to the CPU reference
(gpucr.dataplane.digest): random data, zero chunks, one byte at chunk edges, odd tails, many chunks, several
ranges in one enqueue. The CPU suite holds simcuda's C copy to the same reference (tests/test_kernels_sim.py)."""
from __future__ import annotations

import ctypes
import os
import time

import pytest

from gpucr.dataplane import digest
from gpucr.dataplane.digest import CHUNK
from gpucr.dataplane.kernels import Kernels
from gpucr.driver import Vmm, driver_for

from conftest import gpu

pytestmark = [gpu, pytest.mark.gpu]
ROOM = 160 * CHUNK + 4096


@pytest.fixture(scope="module")
def dev():
    vmm = Vmm(driver_for("libcuda.so.1"))
    ctx = vmm.retain_context(0)
    vmm.use(ctx)
    t0 = time.perf_counter()
    kernels = Kernels(vmm, [ctx])
    load_s = time.perf_counter() - t0
    va = vmm.alloc(ROOM)
    yield vmm, ctx, vmm.stream(), kernels, va, load_s
    vmm.use(ctx)
    vmm.free(va)
    kernels.close()
    vmm.release_context(0)


def put(vmm: Vmm, stream: int, va: int, data: bytes) -> None:
    host = ctypes.create_string_buffer(data, len(data))
    vmm.h2d(va, ctypes.addressof(host), len(data), stream)
    vmm.sync(stream)


def agrees(dev, data: bytes, at: int = 0) -> None:
    vmm, ctx, stream, k, va, _ = dev
    if data:
        put(vmm, stream, va + at, data)
    assert k.zero_scan(ctx, va + at, len(data), stream) == digest.zero_chunks(data)
    assert k.digests(ctx, va + at, len(data), stream) == digest.digests(data)


def test_the_fatbin_loads_from_machine_code(dev):
    """This GPU's SASS is in the fatbin: loading takes milliseconds, not a PTX JIT."""
    assert dev[5] < 0.05, f"loading the kernels took {dev[5]:.3f} s"


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4095, CHUNK - 1, CHUNK, CHUNK + 8, 3 * CHUNK + 13])
def test_random_data_and_odd_tails(dev, n):
    agrees(dev, os.urandom(n))


def test_zero_chunks_between_data_at_odd_lengths(dev):
    data = bytearray(os.urandom(9 * CHUNK + 1000))
    for k in (0, 3, 4, 8):
        data[k * CHUNK:(k + 1) * CHUNK] = bytes(CHUNK)
    agrees(dev, bytes(data))
    agrees(dev, bytes(5 * CHUNK + 31), at=16)


@pytest.mark.parametrize("where", [0, CHUNK - 1, CHUNK, 2 * CHUNK - 8, 5 * CHUNK + 7, 6 * CHUNK - 1])
def test_one_byte_set_at_a_chunk_edge(dev, where):
    data = bytearray(6 * CHUNK)
    data[where] = 0x80
    agrees(dev, bytes(data))


def test_many_chunks_and_several_ranges(dev):
    vmm, ctx, stream, k, va, _ = dev
    data = os.urandom(ROOM)
    agrees(dev, data)
    ranges = [(va, 64 * CHUNK), (va + 16, 100), (va + 80 * CHUNK, 80 * CHUNK + 4096), (va, 0)]
    zeros, digests = k.enqueue_zero_scan(ctx, ranges, stream), k.enqueue_digests(ctx, ranges, stream)
    assert digests.read() == [digest.digests(data[a - va:a - va + n]) for a, n in ranges]
    assert zeros.read() == [digest.zero_chunks(data[a - va:a - va + n]) for a, n in ranges]
