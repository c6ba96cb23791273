"""gpucr's kernels through the driver API on simcuda (its C copy of them): the loader's calls as on a GPU,
and results bit-equal to the CPU reference, gpucr.dataplane.digest. tests/gpu/test_kernels.py holds the
GPU's fatbin to the same reference."""
from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpucr import paths
from gpucr.dataplane import digest
from gpucr.dataplane.checked import Checker, Taken
from gpucr.dataplane.chunks import chunk_count
from gpucr.dataplane.digest import CHUNK
from gpucr.dataplane.kernels import Kernels
from gpucr.dataplane.scan import Scanner
from gpucr.dataplane.sweep import Sweep, parts_of
from gpucr.driver import DriverError, driver_for
from gpucr.vmm import Vmm
from gpucr.errors import GpucrError

CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_ILLEGAL_ADDRESS = 200, 401, 500, 700
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


class Mapped:
    """Allocations made and mapped as the mover maps them (VMM), with their contents written: `copies` streams
    write them asynchronously (a fill's copies), else they are written and synchronised."""

    def __init__(self, dev: Device, contents: list[bytes], copies: list[int] | None = None) -> None:
        self.vmm, self.sizes = dev.vmm, [len(c) for c in contents]
        self.handles = [self.vmm.create(z, 0) for z in self.sizes]
        self.vas = [self.vmm.map(h, z, 0) for h, z in zip(self.handles, self.sizes)]
        self.hosts = []
        for k, (va, data) in enumerate(zip(self.vas, contents)):
            if copies is None:
                dev.write(va, data)
                continue
            host = self.vmm.host_alloc(len(data))   # pinned: the copy is asynchronous, as the mover's are
            ctypes.memmove(host, data, len(data))
            self.hosts.append(host)
            self.vmm.h2d(va, host, len(data), copies[k % len(copies)])

    def close(self, dev: Device, copies: list[int]) -> None:
        for s in copies:
            self.vmm.sync(s)
        for h, va, z in zip(self.handles, self.vas, self.sizes):
            self.vmm.unmap(va, z)
            self.vmm.release(h)
        for host in self.hosts:
            self.vmm.host_free(host)


def scanned(dev: Device, m: Mapped, step: int, log: list[list[tuple[int, int]]] | None = None) -> Scanner:
    """A copy out's scan of m as the mover runs it: parts of `step` bytes added as each allocation is mapped, the
    results read as they come; log gets (allocation, chunk) of the parts each read gave."""
    scanner = Scanner(dev.kernels, lambda ctx: dev.stream, [(i, 0, z) for i, z in enumerate(m.sizes)], step)
    for i, (va, z) in enumerate(zip(m.vas, m.sizes)):
        for at, n in parts_of(z, step):
            scanner.add(0, dev.ctx, i, va, at, n)
            got = scanner.ready()
            if log is not None and got:
                log.append([(p.index, p.chunk) for p in got])
    got = scanner.ready(every=True)
    if log is not None:
        log.append([(p.index, p.chunk) for p in got])
    return scanner


CONTENTS = [bytes(CHUNK) + os.urandom(CHUNK) + bytes(2 * CHUNK) + os.urandom(CHUNK), bytes(CHUNK), os.urandom(3 * CHUNK)]


def test_a_copy_out_s_scan_comes_back_part_by_part_equal_to_the_reference(dev):
    """The table kernel's scan in parts of two chunks, a batch per part: zero flags and digests bit-equal to the
    reference, each batch's parts given back while the next is scanned, the zero spans of one part its own."""
    m = Mapped(dev, CONTENTS)
    try:
        log: list[list[tuple[int, int]]] = []
        scanner = scanned(dev, m, 2 * CHUNK, log)
        try:
            assert [scanner.scans[i].zero for i in range(3)] == [digest.zero_chunks(c) for c in CONTENTS]
            assert [scanner.scans[i].digests for i in range(3)] == [digest.digests(c) for c in CONTENTS]
            # the parts, in order, came back one batch behind those added: the first before the last was added
            assert sum(log, []) == [(0, 0), (0, 2), (0, 4), (1, 0), (2, 0), (2, 2)] and len(log) > 2, log
            assert scanner.scans[0].zero_spans(5 * CHUNK) == [(0, CHUNK), (2 * CHUNK, 2 * CHUNK)]
            assert scanner.scans[0].zero_spans(5 * CHUNK, 2 * CHUNK, 2 * CHUNK) == [(2 * CHUNK, 2 * CHUNK)]
            assert scanner.scans[0].zero_spans(5 * CHUNK, 4 * CHUNK, CHUNK) == []
        finally:
            scanner.close()
    finally:
        m.close(dev, [])


def checked(dev: Device, m: Mapped, taken: Taken, copies: list[int], step: int) -> int:
    """A fill's check of m as the mover runs it: each part added once its copies are queued, launched after them."""
    checker = Checker(dev.kernels, lambda ctx: dev.stream, [(i, 0, z) for i, z in enumerate(m.sizes)], taken, step)
    try:
        for i, (va, z) in enumerate(zip(m.vas, m.sizes)):
            for at, n in parts_of(z, step):
                checker.add(0, dev.ctx, i, va, at, n)
                if checker.due(0):
                    checker.launch(0, copies)
        for s in copies:
            dev.vmm.sync(s)
        return checker.finish()
    finally:
        checker.close()


def test_a_fill_s_check_runs_after_its_copies_and_names_the_first_chunk_that_differs(dev):
    copies = [dev.vmm.stream(), dev.vmm.stream()]
    m = Mapped(dev, CONTENTS)
    try:
        scanner = scanned(dev, m, 3 * CHUNK)
        scanner.close()
        taken = Taken([(i, z, 0, 0) for i, z in enumerate(m.sizes)], scanner.scans)
    finally:
        m.close(dev, [])
    same = Mapped(dev, CONTENTS, copies)   # written by copies still queued: the check waits for them
    try:
        assert checked(dev, same, taken, copies, 2 * CHUNK) == 9
    finally:
        same.close(dev, copies)
    damaged = [bytearray(c) for c in CONTENTS]
    damaged[0][3 * CHUNK + 7] ^= 0xFF    # a byte of a chunk that was all zero
    damaged[2][2 * CHUNK] ^= 0x01
    bad = Mapped(dev, [bytes(d) for d in damaged], copies)
    try:
        with pytest.raises(GpucrError) as refused:
            checked(dev, bad, taken, copies, 2 * CHUNK)
        said = str(refused.value)
        assert f"in 2 chunks: allocation 0 chunk 3 (bytes {3 * CHUNK}-{4 * CHUNK - 1}) and 1 more" in said, said
        assert "--accept-mismatch" in said
    finally:
        bad.close(dev, copies)


def test_simcuda_refuses_a_check_not_ordered_after_the_copies_it_reads(dev):
    """On a GPU a check launched beside copies it does not wait for may hash bytes not landed yet, only sometimes:
    simcuda refuses it every time (CUDA_ERROR_ILLEGAL_STATE), and takes it once the kernel stream waits."""
    copies = [dev.vmm.stream()]
    m = Mapped(dev, CONTENTS[2:])
    try:
        scanner = scanned(dev, m, CHUNK)
        scanner.close()
        taken = Taken([(0, 3 * CHUNK, 0, 0)], scanner.scans)
    finally:
        m.close(dev, [])
    again = Mapped(dev, CONTENTS[2:], copies)
    try:
        checker = Checker(dev.kernels, lambda ctx: dev.stream, [(0, 0, 3 * CHUNK)], taken, 3 * CHUNK)
        checker.add(0, dev.ctx, 0, again.vas[0], 0, 3 * CHUNK)
        with pytest.raises(DriverError) as exc:
            checker.launch(0, [])
        assert exc.value.rc == CUDA_ERROR_ILLEGAL_STATE
        checker.close(failed=True)
        assert checked(dev, again, taken, copies, 3 * CHUNK) == 3
    finally:
        again.close(dev, copies)


def test_simcuda_still_refuses_after_many_contexts_and_streams_came_and_went():
    """A context given back takes its streams' order with it: a long suite (or server) that made hundreds of
    streams in contexts since released still has streams told apart, so the refusal above still happens (it once
    stopped, every stream past the 256th sharing one order). So does one with 300 streams alive: a CI worker that
    had run other files holds that many (their threads' per-thread streams, movers' streams), and the refusal
    stopped there too while 256 was the most told apart."""
    for _ in range(3):
        d = Device()
        for _ in range(120):
            d.vmm.sync(d.vmm.stream())   # a stream takes an order id once used
        d.close()
    alive = Device()
    for _ in range(300):
        alive.vmm.sync(alive.vmm.stream())
    d = Device()
    try:
        test_simcuda_refuses_a_check_not_ordered_after_the_copies_it_reads(d)
    finally:
        d.close()
        alive.close()


@SIM
@given(st.lists(st.tuples(st.integers(0, ROOM // 16 - 1), st.integers(1, 3 * CHUNK)), min_size=1, max_size=5))
def test_the_table_kernels_agree_with_the_reference_on_any_ranges(dev, ranges):
    """Ranges anywhere in the room, of any length (tails too), in one launch each kind: the scan's flags and digests
    are the reference's, and the check of those digests finds nothing; a digest changed is found."""
    data = _POOL[:ROOM]
    dev.put(data)
    ranges = [(16 * k, min(n, ROOM - 16 * k)) for k, n in ranges]
    scan_, check = (Sweep(dev.kernels, dev.ctx, dev.stream, kind, len(ranges), sum(chunk_count(n) for _a, n in ranges))
                    for kind in ("scan", "check"))
    try:
        for i, (at, n) in enumerate(ranges):
            scan_.add(i, 0, dev.va + at, n)
        got = scan_.read(scan_.flush())
        assert [(z, d) for _p, z, d in got] == [(digest.zero_chunks(data[a:a + n]), digest.digests(data[a:a + n]))
                                                for a, n in ranges]
        for i, ((at, n), (_p, _z, d)) in enumerate(zip(ranges, got)):
            wrong = i == len(ranges) - 1
            check.add(i, 0, dev.va + at, n, b"".join(d)[:-1] + bytes([d[-1][-1] ^ 1]) if wrong else b"".join(d))
        assert check.verdict() == (1, (len(ranges) - 1, chunk_count(ranges[-1][1]) - 1))
    finally:
        scan_.close()
        check.close()


def test_a_sweep_refuses_what_it_was_not_made_for(dev):
    sweep = Sweep(dev.kernels, dev.ctx, dev.stream, "check", 1, 2)
    try:
        with pytest.raises(GpucrError, match="2 chunks but 1 digests"):
            sweep.add(0, 0, dev.va, 2 * CHUNK, bytes(16))
        sweep.add(0, 0, dev.va, 2 * CHUNK, bytes(32))
        with pytest.raises(GpucrError, match="made for 1 parts of 2 chunks"):
            sweep.add(1, 0, dev.va, 16, bytes(16))
        with pytest.raises(GpucrError, match="16-byte aligned"):
            sweep.add(1, 0, dev.va + 8, 16, bytes(16))
        assert sweep.place(1) == (0, 1)
    finally:
        sweep.close()


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
