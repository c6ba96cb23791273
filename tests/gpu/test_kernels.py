"""gpucr's kernels from the checked-in fatbin on the real GPU, bit-equal to the CPU reference
(gpucr.dataplane.digest): random data, zero chunks, one byte at chunk edges, odd tails, many chunks, several
ranges in one enqueue; the data plane's table kernels (scan and check) likewise, the check ordered after copies. The CPU suite holds simcuda's C copy to the same reference (tests/test_kernels_sim.py)."""
from __future__ import annotations

import ctypes
import os
import time

import pytest

from gpucr.dataplane import digest
from gpucr.dataplane.chunks import chunk_count
from gpucr.dataplane.digest import CHUNK
from gpucr.dataplane.kernels import Kernels
from gpucr.dataplane.sweep import Sweep
from gpucr.driver import driver_for
from gpucr.vmm import Vmm

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


def test_the_table_kernels_agree_with_the_reference_and_find_a_changed_chunk(dev):
    """The data plane's kernels (sweep.py) over ranges with tails, in two launches: the scan's flags and digests are
    the reference's; the check of those digests finds nothing, and with one digest changed names that chunk."""
    vmm, ctx, stream, k, va, _ = dev
    data = bytearray(os.urandom(ROOM))
    data[3 * CHUNK:5 * CHUNK] = bytes(2 * CHUNK)
    put(vmm, stream, va, bytes(data))
    ranges = [(0, 7 * CHUNK + 100), (16, 100), (80 * CHUNK, 80 * CHUNK + 4096), (8 * CHUNK, CHUNK)]
    chunks = sum(chunk_count(n) for _a, n in ranges)
    scan, check = (Sweep(k, ctx, stream, kind, len(ranges), chunks) for kind in ("scan", "check"))
    try:
        for i, (at, n) in enumerate(ranges[:2]):
            scan.add(i, 0, va + at, n)
        first = scan.flush()
        for i, (at, n) in enumerate(ranges[2:], 2):
            scan.add(i, 0, va + at, n)
        got = scan.read(first) + scan.read(scan.flush())
        assert [z for _p, z, _d in got] == [digest.zero_chunks(data[a:a + n]) for a, n in ranges]
        assert [d for _p, _z, d in got] == [digest.digests(data[a:a + n]) for a, n in ranges]
        for i, ((at, n), (_p, _z, d)) in enumerate(zip(ranges, got)):
            wrong = b"".join(d)
            if i == 2:   # its chunk 5's digest, one bit off
                wrong = wrong[:5 * 16] + bytes([wrong[5 * 16] ^ 1]) + wrong[5 * 16 + 1:]
            check.add(i, 0, va + at, n, wrong)
            if i == 1:
                check.flush()
        assert check.verdict() == (1, (2, 5))
    finally:
        scan.close()
        check.close()


def test_a_check_waits_for_the_copies_of_its_memory_on_other_streams(dev):
    """As a fill checks: 256 MiB copied in on two streams, the check queued on the kernel stream after their events,
    before the host waits for anything: it sees every copied byte."""
    vmm, ctx, stream, k, va, _ = dev
    copies, n = [vmm.stream(), vmm.stream()], 128 * CHUNK
    data = os.urandom(n)
    host = vmm.host_alloc(n)
    try:
        ctypes.memmove(host, data, n)
        vmm.memset(va, n, stream)
        vmm.sync(stream)
        check = Sweep(k, ctx, stream, "check", 2, chunk_count(n))
        try:
            for j, at in enumerate((0, n // 2)):
                vmm.h2d(va + at, host + at, n // 2, copies[j])
                check.add(0, at // CHUNK, va + at, n // 2, b"".join(digest.digests(data[at:at + n // 2])))
            check.flush(copies)
            assert check.verdict() == (0, None)
        finally:
            check.close()
    finally:
        for s in copies:
            vmm.sync(s)
        vmm.host_free(host)
