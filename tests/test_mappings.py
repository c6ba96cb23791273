"""The server's mappings of a process's memory (gpucr.dataplane.mappings), on simcuda: a move maps each GPU's
allocations side by side into one address range and gives them access one batch at a time, so ~1,500 allocations
(torch's expandable segments) cost a few cuMemSetAccess calls, not one each; the bytes still go out and come back
whole, an allocation the range refuses is mapped alone, and nothing of ours stays mapped or reserved."""
from __future__ import annotations

import os

import pytest

from conftest import sim_driver
from test_server import _device_bytes, _exported_memory

MiB = 1 << 20


@pytest.fixture
def mover(monkeypatch):
    from gpucr.dataplane import mappings, mover as mv, pinned
    monkeypatch.setattr(mappings, "BATCH", 6 * MiB)
    monkeypatch.setattr(pinned, "file_page", lambda blksize: pinned.PAGE)   # whatever tmp's filesystem says
    m = mv.Mover(sim_driver())
    uuid, dev = next(iter(m.vmm.device_by_uuid().items()))
    ctx = m.vmm.retain_context(dev)
    m.vmm.use(ctx)
    m.test_gpu = (uuid, dev)
    yield m
    m.close()
    m.vmm.release_context(dev)


def _calls(monkeypatch, vmm, name: str) -> list[tuple]:
    seen: list[tuple] = []
    real = getattr(vmm, name)
    monkeypatch.setattr(vmm, name, lambda *a, **k: (seen.append(a), real(*a, **k))[1])
    return seen


def _cycle(mover, tmp_path, sizes: list[int], *spies: list) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A copy out and a fill of memory of `sizes` through `mover`: (the bytes, what staging got, what came back);
    each of `spies` (_calls) left holding only the calls of the two moves."""
    uuid, dev = mover.test_gpu
    vmm = mover.vmm
    memory, data = _exported_memory(vmm, dev, uuid, sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    layout = {"segments": [{"index": 0, "bytes": sum(sizes)}],
              "allocations": [{"index": i, "bytes": n, "segment": 0, "offset": o}
                              for i, (n, o) in enumerate(zip(sizes, offsets))]}
    (tmp_path / "seg").write_bytes(b"\0" * sum(sizes))
    seg_fd = os.open(tmp_path / "seg", os.O_RDWR)
    fds: list[tuple[int, int]] = []
    try:
        for spy in spies:
            spy.clear()
        mover.copy_out(1, layout, [seg_fd], memory)
        staged = (tmp_path / "seg").read_bytes()
        _st, fds = mover.fill(1, layout, [seg_fd], memory)
        moves = [list(spy) for spy in spies]
        assert [i for i, _fd in fds] == list(range(len(sizes))), "the fds come back in index order"
        back = [_device_bytes(vmm, fd, n, dev) for (_i, fd), n in zip(fds, sizes)]
        for spy, seen in zip(spies, moves):
            spy[:] = seen
        return data, [staged[o:o + n] for n, o in zip(sizes, offsets)], back
    finally:
        for fd in [fd for _i, fd in fds] + [m.fd for m in memory] + [seg_fd]:
            os.close(fd)


def test_allocations_get_access_one_batch_at_a_time_in_one_range(mover, tmp_path, monkeypatch):
    access = _calls(monkeypatch, mover.vmm, "set_access")
    reserved = _calls(monkeypatch, mover.vmm, "reserve")
    freed = _calls(monkeypatch, mover.vmm, "free_range")
    sizes = [2 * MiB] * 7 + [4 * MiB]   # 6 MiB batches: after the 3rd and 6th, then the 8th (the last)
    data, staged, back = _cycle(mover, tmp_path, sizes, access, reserved, freed)
    assert staged == data and back == data
    assert len(access) == 2 * 3, f"one cuMemSetAccess per batch, each way: {len(access)} for 2 x {len(sizes)}"
    assert [a[1] for a in access[:3]] == [6 * MiB, 6 * MiB, 6 * MiB]
    assert [a[0] for a in reserved] == [sum(sizes)] * 2, "one range for the GPU's allocations, each way"
    assert len(freed) == 2, "and each freed once the move is done"


def test_an_allocation_the_range_refuses_is_mapped_alone(mover, tmp_path, monkeypatch):
    from gpucr.driver import DriverError
    vmm = mover.vmm
    real_reserve, real_map_at = vmm.reserve, vmm.map_at
    alone_ranges: set[int] = set()   # ranges reserved for one mapping (Vmm.map's own)
    refused = []

    def reserve(size: int) -> int:
        va = real_reserve(size)
        if size == 4 * MiB:
            alone_ranges.add(va)
        return va

    def map_at(va: int, handle: int, size: int) -> None:
        if size == 4 * MiB and va not in alone_ranges and not refused:   # inside a move's range, once
            refused.append(va)
            raise DriverError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
        real_map_at(va, handle, size)
    monkeypatch.setattr(vmm, "reserve", reserve)
    monkeypatch.setattr(vmm, "map_at", map_at)
    alone = _calls(monkeypatch, vmm, "map")
    data, staged, back = _cycle(mover, tmp_path, [2 * MiB, 4 * MiB, 2 * MiB], alone)
    assert staged == data and back == data and refused
    assert [a[1] for a in alone] == [4 * MiB], "the refused one was mapped in a range of its own, the rest not"


def test_the_clis_ring_writes_the_staging_mapped_and_reads_it_by_file(tmp_path, monkeypatch):
    """The CLI's mover (a fresh process, its ring, not the staging, pinned): a copy out writes the staging mapped here
    (its file's writes would run one at a time: 5.4 GB/s from 12 threads on an H100), a fill reads it with pread and
    maps none of it."""
    from gpucr.dataplane import held, mover as mv, pinned
    maps = []
    real_open = pinned.open_segment
    monkeypatch.setattr(held, "open_segment", lambda *a: (maps.append(a), real_open(*a))[1])
    m = mv.Mover(sim_driver(), keep_context=False, pinned_staging=False)
    uuid, dev = next(iter(m.vmm.device_by_uuid().items()))
    ctx = m.vmm.retain_context(dev)
    m.vmm.use(ctx)
    m.test_gpu = (uuid, dev)
    try:
        data, staged, back = _cycle(m, tmp_path, [4 * MiB, 2 * MiB, 6 * MiB])
    finally:
        m.close()
        m.vmm.release_context(dev)
    assert staged == data and back == data
    assert len(maps) == 1, f"the staging's one segment mapped once, for the copy out only: {maps}"
