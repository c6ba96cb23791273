"""gpucr's kernels through the driver API on simcuda (its C copy of them): the loader's calls as on a GPU,
and results bit-equal to the CPU reference, gpucr.dataplane.digest. tests/gpu/test_kernels.py holds the
GPU's fatbin to the same reference."""
from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpucr import paths
from gpucr.dataplane import digest, scan
from gpucr.dataplane.digest import CHUNK
from gpucr.dataplane.kernels import Kernels
from gpucr.driver import DriverError, Vmm, driver_for
from gpucr.errors import GpucrError

CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_ILLEGAL_ADDRESS = 200, 500, 700
ROOM = 8 * CHUNK + 4096


class Device:
    """simcuda's GPU 0 with gpucr's kernels loaded, and ROOM bytes of device memory to scan."""

    def __init__(self) -> None:
        self.vmm = Vmm(driver_for(str(paths.simcuda_dir() / "libcuda.so.1")))
        self.ctx = self.vmm.retain_context(0)
        self.vmm.use(self.ctx)
        self.stream = self.vmm.stream()
        self.kernels = Kernels(self.vmm, [self.ctx])
        self.va = self.vmm.alloc(ROOM)

    def put(self, data: bytes, at: int = 0) -> int:
        """data into the device memory at offset `at`; its address."""
        return self.write(self.va + at, data)

    def write(self, va: int, data: bytes) -> int:
        if data:
            self.vmm.use(self.ctx)
            host = ctypes.create_string_buffer(data, len(data))
            self.vmm.h2d(va, ctypes.addressof(host), len(data), self.stream)
            self.vmm.sync(self.stream)
        return va

    def close(self) -> None:
        self.kernels.close()
        self.vmm.use(self.ctx)
        self.vmm.free(self.va)
        self.vmm.release_context(0)


@pytest.fixture
def dev():
    d = Device()
    yield d
    d.close()


def both(dev: Device, data: bytes, at: int = 0) -> tuple[list[bool], list[bytes]]:
    va = dev.put(data, at)
    return dev.kernels.zero_scan(dev.ctx, va, len(data), dev.stream), dev.kernels.digests(dev.ctx, va, len(data), dev.stream)


def agrees(dev: Device, data: bytes, at: int = 0) -> None:
    zeros, digests = both(dev, data, at)
    assert zeros == digest.zero_chunks(data)
    assert digests == digest.digests(data)


_POOL = os.urandom(ROOM + 65536)
SIM = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SIM
@given(st.integers(0, ROOM), st.integers(0, len(_POOL) - ROOM), st.lists(st.booleans(), min_size=9, max_size=9))
def test_random_data_zero_chunks_and_odd_tails_agree_with_the_reference(dev, n, start, zeroed):
    data = bytearray(_POOL[start:start + n])
    for k, z in enumerate(zeroed):
        if z:
            data[k * CHUNK:(k + 1) * CHUNK] = bytes(len(data[k * CHUNK:(k + 1) * CHUNK]))
    agrees(dev, bytes(data))


@SIM
@given(st.integers(0, ROOM), st.sampled_from([0, 16, 32, 2 * CHUNK]))
def test_all_zero_ranges_agree_at_any_length_and_aligned_start(dev, n, at):
    agrees(dev, bytes(min(n, ROOM - at)), at)


@SIM
@given(st.integers(1, 7), st.sampled_from([-1, 0, 1]), st.integers(1, 255), st.integers(0, 5))
def test_one_byte_set_at_a_chunk_edge(dev, edge, side, value, extra):
    n = 8 * CHUNK - extra
    data = bytearray(n)
    where = min(edge * CHUNK + side, n - 1)
    data[where] = value
    agrees(dev, bytes(data))
    assert digest.zero_chunks(data).count(False) == 1


def test_many_chunks_in_one_scan_and_several_ranges_in_one_enqueue(dev):
    data = os.urandom(3 * CHUNK) + bytes(3 * CHUNK) + os.urandom(CHUNK + 77)
    agrees(dev, data)
    k, va = dev.kernels, dev.va
    ranges = [(va, CHUNK), (va + 3 * CHUNK, 2 * CHUNK + 16), (va, 0), (va + 16, 100)]
    zeros = k.enqueue_zero_scan(dev.ctx, ranges, dev.stream)
    digests = k.enqueue_digests(dev.ctx, ranges, dev.stream)
    assert zeros.read() == [digest.zero_chunks(data[a - va:a - va + n]) for a, n in ranges]
    assert digests.read() == [digest.digests(data[a - va:a - va + n]) for a, n in ranges]


def test_bad_ranges_and_unloaded_contexts_are_refused_in_one_line(dev):
    with pytest.raises(GpucrError, match="16-byte aligned"):
        dev.kernels.digests(dev.ctx, dev.va + 8, 64, dev.stream)
    with pytest.raises(GpucrError, match="were not loaded into context"):
        Kernels(dev.vmm).zero_scan(dev.ctx, dev.va, 64, dev.stream)
    with pytest.raises(DriverError) as exc:   # past the allocation: the kernel's own check, as on a GPU
        dev.kernels.digests(dev.ctx, dev.va, 64 * CHUNK, dev.stream)
    assert exc.value.rc == CUDA_ERROR_ILLEGAL_ADDRESS


def test_simcuda_refuses_other_modules_and_unknown_kernels(dev):
    fatbin = Kernels(dev.vmm)._image
    for other in (fatbin.replace(b"gpucr_digest\0", b"gpucr_digesT\0"), b"P\0", b"//PTX\0"):
        with pytest.raises(DriverError) as exc:
            dev.vmm.load_module(other)
        assert exc.value.rc == CUDA_ERROR_INVALID_IMAGE
    module = dev.vmm.load_module(fatbin)
    try:
        with pytest.raises(DriverError) as exc:
            dev.vmm.function(module, "fill_u32")   # a builtin of simcuda's own pseudo-image, not of this one
        assert exc.value.rc == CUDA_ERROR_NOT_FOUND
    finally:
        dev.vmm.unload_module(module)


def test_a_process_s_allocations_scanned_as_the_mover_maps_them(dev):
    """scan.scan over VMM mappings (as the mover makes them): per allocation its zero chunks as the mover's
    zero spans, and digests that name the one chunk a corrupted byte is in."""
    vmm, sizes = dev.vmm, [3 * CHUNK, CHUNK, 2 * CHUNK]
    handles = [vmm.create(z, 0) for z in sizes]
    vas = [vmm.map(h, z, 0) for h, z in zip(handles, sizes)]
    try:
        contents = [bytes(CHUNK) + os.urandom(CHUNK) + bytes(CHUNK), bytes(CHUNK), os.urandom(2 * CHUNK)]
        for va, data in zip(vas, contents):
            dev.write(va, data)
        mapped = [scan.Mapped(i, dev.ctx, va, z) for i, (va, z) in enumerate(zip(vas, sizes))]
        taken = scan.scan(dev.kernels, mapped, lambda ctx: dev.stream)
        assert [taken[i].zero_spans(z) for i, z in enumerate(sizes)] == [[(0, CHUNK), (2 * CHUNK, CHUNK)], [(0, CHUNK)], []]
        assert [taken[i].digests for i in range(3)] == [digest.digests(c) for c in contents]
        # the byte's complement: a fixed value equals the random byte there once in 256 runs (and changes nothing)
        dev.write(vas[2] + CHUNK + 12345, bytes([contents[2][CHUNK + 12345] ^ 0xFF]))
        now = scan.scan(dev.kernels, mapped, lambda ctx: dev.stream, zero=False)
        assert scan.mismatches(taken, now) == [(2, 1)]
        assert scan.describe_mismatches([(2, 1)]) == f"allocation 2 chunk 1 (bytes {CHUNK}-{2 * CHUNK - 1})"
    finally:
        for h, va, z in zip(handles, vas, sizes):
            vmm.unmap(va, z)
            vmm.release(h)


def test_result_buffers_are_kept_for_the_next_scan_and_a_result_is_read_once(dev):
    k = dev.kernels
    first = k.enqueue_digests(dev.ctx, [(dev.va, 3 * CHUNK)], dev.stream)
    buf = first.buf
    first.read()
    second = k.enqueue_zero_scan(dev.ctx, [(dev.va, 100 * CHUNK // 64)], dev.stream)
    assert second.buf == buf   # no cuMemFree between scans: it may wait for every copy on the device
    second.read()
    with pytest.raises(GpucrError, match="read once"):
        second.read()
