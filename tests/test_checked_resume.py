"""Issue 26 on simcuda, through the server's mover and the CLI's: chunks all zero are not copied out, and a restore
compares the new memory's digests with the checkpoint's before the process gets it."""
from __future__ import annotations

import json
import os

import pytest

import gpucr
from gpucr.errors import GpucrError

from gpucr import memory as server_memory
from gpucr import paths
from gpucr.agent import AgentClient
from gpucr.dataplane.sweep import STEP_ENV
from gpucr.target import agent_socket_name
from conftest import RunningServer, gpucr_cli

MiB = 1 << 20


def staging_fds(pid: int) -> list[str]:
    """/proc paths of the process's staging memfds (the agent's), in fd order."""
    fd_dir = f"/proc/{pid}/fd"
    return [f"{fd_dir}/{n}" for n in sorted(os.listdir(fd_dir), key=int)
            if os.readlink(f"{fd_dir}/{n}").startswith("/memfd:gpucr-staging")]


def flip_byte(path: str, at: int) -> None:
    """One byte of the staging file changed in place: what a fault in host memory would do."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, at)
        assert os.pwrite(fd, bytes([old[0] ^ 0xFF]), at) == 1
    finally:
        os.close(fd)


def test_an_all_zero_buffer_is_copied_out_once_then_skipped_and_comes_back_byte_exact(plane, sim_app):
    app = sim_app("--sizes", "16M,8M,100K")
    app.ask("zero 0")   # 16 MiB all zero on the GPU: a KV cache never written
    before = app.ask("digest")
    for cycle in range(3):
        ck = gpucr.checkpoint(app.pid)
        assert ck.data_plane == plane, ck
        # the first copy carries the zeros into staging; the server's mover then knows the staging holds them there
        # and skips them; the CLI's mover, made anew per request, never knows it
        if cycle and plane == "server":
            assert ck.bytes_zero_skipped >= 16 * MiB, ck
            assert ck.bytes_moved - ck.bytes_zero_skipped <= 8 * MiB + 2 * MiB, "fewer bytes cross the link than it holds"
        else:
            assert ck.bytes_zero_skipped == 0, ck
        rs = gpucr.restore(app.pid)
        assert rs.state == "running" and app.ask("digest") == before, f"cycle {cycle}"
        # only the mover that took the checkpoint holds its digests: the server's; the CLI's ends with its request
        assert rs.checked == (plane == "server") and (rs.chunks_checked > 0) == rs.checked, rs


def test_a_restore_whose_staging_was_damaged_is_refused_then_accepted(reused_server, sim_app):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid)
    assert ck.data_plane == "server" and ck.bytes_zero_skipped == 0, ck
    [seg] = staging_fds(app.pid)
    flip_byte(seg, 3 * MiB + 5)   # inside the allocation's second chunk (its staging starts at 0)
    with pytest.raises(GpucrError) as refused:
        gpucr.restore(app.pid)
    said = str(refused.value)
    assert "chunk 1 " in said and "--accept-mismatch" in said, said
    assert gpucr.status(app.pid).state == "checkpointed", "refused: the process stays checkpointed"
    # the agent adopted nothing of the refused fill: released still, its data in staging
    with AgentClient(paths.runtime_dir() / agent_socket_name(app.pid), app.pid) as agent:
        listed = [e for e in server_memory.gather(agent, 10.0) if e.bytes == 8 * MiB]
    server_memory.close_all(listed)
    assert [e.released for e in listed] == [True], listed
    r = gpucr_cli("restore", "--accept-mismatch", "--json", str(app.pid))   # the command, through the server
    assert r.returncode == 0, r.stderr
    [rs] = json.loads(r.stdout)["processes"]
    assert rs["state"] == "running" and rs["data_plane"] == "server" and not rs["checked"], rs
    # the damaged byte is in the process now: the check compared real bytes
    assert app.ask("digest")["digest"] != before["digest"]
    ck = gpucr.checkpoint(app.pid)   # and the next cycle, with the staging as it is now, is checked and passes
    rs = gpucr.restore(app.pid)
    assert rs.checked and rs.chunks_checked == 4, rs


def test_no_scan_turns_both_parts_off_for_its_cycle(reused_server, sim_app):
    """`gpucr checkpoint --no-scan`: zero chunks cross the link like any other and no digests are taken, so a damaged
    staging byte gets through the restore unseen; the same damage after a checkpoint with the scan on is caught."""
    app = sim_app("--sizes", "16M,8M")
    app.ask("zero 0")   # 16 MiB never written
    before = app.ask("digest")
    for _ in range(2):   # the first cycle carries the zeros into staging, the second skips them
        ck = gpucr.checkpoint(app.pid)
        rs = gpucr.restore(app.pid)
    assert ck.scanned and ck.bytes_scanned == 24 * MiB and ck.bytes_zero_skipped == 16 * MiB, ck
    assert rs.checked and rs.bytes_zeroed == 16 * MiB and app.ask("digest") == before, rs
    r = gpucr_cli("checkpoint", "--no-scan", "--json", str(app.pid))   # the command, through the server
    assert r.returncode == 0, r.stderr
    [ck] = json.loads(r.stdout)["processes"]
    assert ck["data_plane"] == "server" and ck["scanned"] is False, ck
    assert ck["bytes_scanned"] == 0 and ck["bytes_zero_skipped"] == 0 and ck["bytes_moved"] == 24 * MiB, ck
    rs = gpucr.restore(app.pid)   # nothing known to be zero: every byte copied back, nothing compared
    assert rs.state == "running" and not rs.checked and rs.chunks_checked == 0 and rs.bytes_zeroed == 0, rs
    assert app.ask("digest") == before
    # off: one damaged byte of the 8 MiB of data (placed first in the staging) reaches the process
    gpucr.checkpoint(app.pid, scan=False)
    [seg] = staging_fds(app.pid)
    flip_byte(seg, 3 * MiB + 5)
    rs = gpucr.restore(app.pid)
    assert rs.state == "running" and not rs.checked, rs
    damaged = app.ask("digest")
    assert damaged["digest"] != before["digest"], "the damaged byte went through: nothing checked it"
    # on: the same damage is caught, naming the chunk, and the process stays checkpointed
    gpucr.checkpoint(app.pid)
    flip_byte(seg, 3 * MiB + 5)
    with pytest.raises(GpucrError, match="chunk 1 .*--accept-mismatch"):
        gpucr.restore(app.pid)
    assert gpucr.status(app.pid).state == "checkpointed"
    assert gpucr.restore(app.pid, accept_mismatch=True).state == "running"
    assert app.ask("digest")["digest"] == before["digest"], "flipped twice: the bytes it had before"


@pytest.fixture
def small_sweeps(monkeypatch, request):
    """A gpucr server whose scans and checks go in parts and batches of one 2 MiB chunk (GPUCR_TEST_SWEEP_BYTES)."""
    monkeypatch.setenv(STEP_ENV, str(2 * MiB))
    return request.getfixturevalue("server")


def test_scan_and_check_run_part_by_part_beside_the_copies(small_sweeps, sim_app):
    """Each part's copies out are queued once its scan comes back, the next parts scanned meanwhile, and a fill checks
    each part once its copies are queued, on the kernel stream after them (simcuda refuses a check its copies are not
    ordered before): byte-exact over cycles, the zero chunks skipped, every chunk checked, a damaged byte named."""
    app = sim_app("--sizes", "16M,8M,100K")
    app.ask("zero 0")
    before = app.ask("digest")
    for cycle in range(3):
        ck = gpucr.checkpoint(app.pid)
        assert ck.scanned and ck.bytes_zero_skipped == (16 * MiB if cycle else 0), ck
        rs = gpucr.restore(app.pid)
        assert rs.state == "running" and app.ask("digest") == before, f"cycle {cycle}"
        assert rs.checked and rs.chunks_checked == rs.bytes_moved // (2 * MiB) == 12 and rs.bytes_zeroed == 16 * MiB, rs
    gpucr.checkpoint(app.pid)
    [seg] = staging_fds(app.pid)
    flip_byte(seg, 5 * MiB + 3)   # the 8 MiB of data come first in the staging: its chunk 2
    with pytest.raises(GpucrError, match=r"in 1 chunk: allocation \d+ chunk 2 .*--accept-mismatch"):
        gpucr.restore(app.pid)
    assert gpucr.restore(app.pid, accept_mismatch=True).state == "running"


def test_by_default_every_chunk_not_all_zero_is_copied_out_at_every_cycle(reused_server, sim_app):
    """Without `gpucr serve --skip-unchanged` each cycle moves the same bytes, unchanged or not (what the bench's
    repeated cycles measure)."""
    app = sim_app("--sizes", "16M,8M")
    for _ in range(2):
        ck = gpucr.checkpoint(app.pid)
        assert ck.bytes_unchanged_skipped == 0 and ck.bytes_zero_skipped == 0, ck
        gpucr.restore(app.pid)


def test_with_skip_unchanged_chunks_unchanged_since_the_last_copy_out_are_not_copied_again_and_a_changed_one_is(sim_app):
    """`gpucr serve --skip-unchanged` (checked.py): a chunk whose digest on the GPU equals the one the server's last
    copy out left in the same place of the staging is not copied again (weights between two parks); one the app
    changed is, and the restore is byte-exact either way, checked."""
    srv = RunningServer(True, "--skip-unchanged")
    try:
        app = sim_app("--sizes", "16M,8M")   # random bytes: no zero chunk
        first = gpucr.checkpoint(app.pid)
        assert first.data_plane == "server" and first.bytes_unchanged_skipped == 0, first   # nothing known yet
        gpucr.restore(app.pid)
        before = app.ask("digest")
        again = gpucr.checkpoint(app.pid)   # nothing changed on the GPU since
        assert again.bytes_unchanged_skipped == 24 * MiB and again.bytes_zero_skipped == 0, again
        rs = gpucr.restore(app.pid)
        assert rs.checked and app.ask("digest") == before
        app.ask("work 1")   # every byte of both buffers changed (the driver app adds to each)
        changed = app.ask("digest")
        third = gpucr.checkpoint(app.pid)
        assert third.bytes_unchanged_skipped == 0, third
        rs = gpucr.restore(app.pid)
        assert rs.checked and app.ask("digest") == changed
        plain = gpucr.checkpoint(app.pid, scan=False)   # no digests taken: the staging's record goes
        gpucr.restore(app.pid)
        assert plain.bytes_unchanged_skipped == 0
        assert gpucr.checkpoint(app.pid).bytes_unchanged_skipped == 0, "after a copy out with no digests, all is copied"
        gpucr.restore(app.pid)
        assert app.ask("digest") == changed
    finally:
        srv.stop()


def test_the_staging_notes_only_what_a_later_copy_out_may_skip():
    """checked.note_held: by default only zero chunks are noted, so staging with no zero chunk keeps no record and the
    next copy out does not wait for its scan (mover.py's `early`); with --skip-unchanged every chunk is."""
    from gpucr.dataplane.checked import Taken, note_held
    from gpucr.dataplane.chunks import CHUNK
    from gpucr.dataplane.pinned import Segment
    from gpucr.dataplane.scan import AllocationScan
    plan = [(0, 3 * CHUNK, 0, 0)]
    scan = AllocationScan(zero=[False, True, False], digests=[b"a" * 16, b"z" * 16, b"c" * 16])
    for unchanged, noted in ((False, {(CHUNK, CHUNK): b"z" * 16}),
                             (True, {(0, CHUNK): b"a" * 16, (CHUNK, CHUNK): b"z" * 16, (2 * CHUNK, CHUNK): b"c" * 16})):
        g = Segment(ident=(0, 0), addr=0, declared=3 * CHUNK)
        note_held({0: g}, plan, Taken(plan, {0: scan}), unchanged)
        assert g.held == noted, unchanged
    g = Segment(ident=(0, 0), addr=0, declared=3 * CHUNK, held={(0, CHUNK): b"a" * 16})
    note_held({0: g}, plan, Taken(plan, scanned=False), True)
    assert g.held == {}, "a copy out with no digests leaves nothing known"
