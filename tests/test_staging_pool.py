"""Staging prepared ahead by the server (issue 28 item 2; gpucr.dataplane.staging_pool), on simcuda with real
processes and a real `gpucr serve --prepare-staging`: an app's first checkpoint right after a server start gets its
staging from the pool and pins nothing then; the pool, what it lent and what was made never pass --host-budget; a
killed app's segments come back; a stopped server frees its pool."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import gpucr
from gpucr import paths
from gpucr.dataplane import budget
from gpucr.proc import held_files

from conftest import RunningServer

MiB = 1 << 20
SEG = 16 * MiB


@pytest.fixture(autouse=True)
def _segments(monkeypatch):
    """Pool segments and the apps' segment target of 16 MiB (2 GiB by default: too much for CI), alike."""
    monkeypatch.setenv("GPUCR_STAGING_SEGMENT_MIB", str(SEG // MiB))
    monkeypatch.setenv("GPUCR_STAGING", "shm")


def wait_for(cond, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)


def pool(server: RunningServer) -> dict:
    info = server.info()
    assert info is not None and info["staging_pool"] is not None, info
    return info["staging_pool"]


def ledger_total() -> int:
    """Every live entry of the ledger, the pool's among them, read under the ledger's lock (as admission reads it)."""
    with budget.locked(paths.runtime_dir()) as dirfd:
        return budget.others(dirfd, "", reap=False)


def entries() -> list[str]:
    return sorted(p.name for p in paths.runtime_dir().iterdir() if p.name.endswith(budget.SUFFIX))


def shmem() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no Shmem in /proc/meminfo")


def started(*extra: str) -> RunningServer:
    s = RunningServer(True, *extra)
    try:
        wait_for(lambda: pool(s)["making_bytes"] == 0 and pool(s)["free_bytes"] > 0, what="the pool to be ready")
    except BaseException:
        s.stop()
        raise
    return s


def test_a_first_checkpoint_after_a_server_start_is_lent_its_staging_and_pins_nothing(sim_app):
    srv = started("--prepare-staging", "64M")
    try:
        assert pool(srv)["free_bytes"] == 64 * MiB and pool(srv)["pinned_bytes"] == 64 * MiB, pool(srv)
        app = sim_app("--sizes", "8M,8M,8M,6M")   # 30 MiB: two segments of 16 MiB in the agent's plan (first fit)
        before = app.ask("digest")
        ck = gpucr.checkpoint(app.pid)
        assert ck.data_plane == "server", ck
        assert ck.staging_lent_bytes == 32 * MiB and ck.staging_made_bytes == 0, ck
        assert "server_pin" not in ck.phases_s and "staging" in ck.phases_s, ck.phases_s
        assert gpucr.status(app.pid).staging_bytes == 32 * MiB
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
        # lent counts once: in the app's entry, no more in the pool's, which refills beside it
        wait_for(lambda: pool(srv)["free_bytes"] == 64 * MiB, what="the pool to refill")
        p = pool(srv)
        assert p["lent_bytes"] == 32 * MiB and p["lent_total_bytes"] == 32 * MiB and p["made_total_bytes"] == 96 * MiB, p
        assert ledger_total() == 96 * MiB, entries()
        # the next cycle uses the same staging: nothing asked, nothing pinned
        again = gpucr.checkpoint(app.pid)
        assert again.staging_lent_bytes == 0 and "staging" not in again.phases_s and "server_pin" not in again.phases_s
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
    finally:
        srv.stop()


def test_the_pool_what_it_lent_and_what_was_made_never_pass_the_host_budget(sim_app):
    limit = 96 * MiB
    srv = started("--host-budget", "96M", "--prepare-staging", "auto")   # as much as the budget allows
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(ledger_total())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_for(lambda: pool(srv)["free_bytes"] == limit, what="the pool to fill the budget")
        small = sim_app("--sizes", "10M,10M")   # two segments of 16 MiB in the agent's plan: lent
        ck = gpucr.checkpoint(small.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (32 * MiB, 0), ck
        big = sim_app("--sizes", "40M")        # one allocation past a segment: its 40 MiB segment is made
        big_before = big.ask("digest")
        ck = gpucr.checkpoint(big.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (0, 40 * MiB), ck
        assert "server_pin" in ck.phases_s, ck.phases_s
        # the pool gave back what the made segment needed: 96 - 32 lent - 40 made leaves one segment
        assert pool(srv)["free_bytes"] == SEG, pool(srv)
        gpucr.restore(big.pid)
        assert big.ask("digest") == big_before
    finally:
        stop.set()
        watcher.join()
        srv.stop()
    assert seen and max(seen) <= limit, max(seen)
    assert max(seen) == limit   # it was full, to the byte


def staging_files(pid: int) -> set[int]:
    """The staging memfds a process holds or maps, by inode."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:   # an fd closed between the listing and its look is not held
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:gpucr-staging"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except FileNotFoundError:
            pass
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        if len(f) >= 6 and f[5].startswith("/memfd:gpucr-staging"):
            out.add(int(f[4]))
    return out


def test_a_killed_apps_segments_come_back_and_a_stopped_server_frees_its_pool(sim_app):
    srv = started("--prepare-staging", "128M")
    try:
        app = sim_app("--sizes", "8M,8M,8M,6M")
        ck = gpucr.checkpoint(app.pid)
        assert ck.staging_lent_bytes == 32 * MiB, ck
        wait_for(lambda: pool(srv)["free_bytes"] == 128 * MiB, what="the pool to refill")
        lent = staging_files(app.pid)
        assert len(lent) == 2 and lent <= staging_files(srv.pid) and len(staging_files(srv.pid)) == 10
        os.kill(app.pid, signal.SIGKILL)
        app.proc.wait()
        # the server lets go of a dead app's staging at its next look, and the pool (full) frees those segments
        wait_for(lambda: pool(srv)["lent_bytes"] == 0, what="the killed app's segments to come back")
        assert pool(srv)["free_bytes"] == 128 * MiB and not [h for h in srv.info()["staging"] if h["pid"] == app.pid]
        assert len(staging_files(srv.pid)) == 8 and not lent & staging_files(srv.pid)
        wait_for(lambda: ledger_total() == 128 * MiB, what="the killed app's entry to be reaped")
        # an app keeps what it was lent when the server stops: its data, and its entry in the budget
        other = sim_app("--sizes", "8M")
        before = other.ask("digest")
        assert gpucr.checkpoint(other.pid).staging_lent_bytes == SEG
        wait_for(lambda: pool(srv)["free_bytes"] == 128 * MiB, what="the pool to refill")
    finally:
        srv.stop()
    assert [e for e in entries() if e.startswith("pool-")] == []
    assert "freed 128 MiB of staging made ahead" in srv.log.read_text()
    assert ledger_total() == SEG and len(staging_files(other.pid)) == 1
    assert gpucr.status(other.pid).staging_bytes == SEG
    gpucr.restore(other.pid)   # with no server: the CLI's own mover, from the staging the app kept
    assert other.ask("digest") == before


def test_a_killed_apps_segments_go_back_to_the_pool_and_to_the_next_app(sim_app):
    srv = started("--host-budget", "64M", "--prepare-staging", "auto")
    try:
        wait_for(lambda: pool(srv)["free_bytes"] == 64 * MiB, what="the pool to fill the budget")
        first = sim_app("--sizes", "8M,8M,8M,6M")
        assert gpucr.checkpoint(first.pid).staging_lent_bytes == 32 * MiB
        lent = staging_files(first.pid)
        time.sleep(0.5)
        assert pool(srv)["free_bytes"] == 32 * MiB, pool(srv)   # the budget holds it to what is not lent
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait()
        wait_for(lambda: pool(srv)["lent_bytes"] == 0, what="the killed app's segments to come back")
        assert pool(srv)["returned_total_bytes"] == 32 * MiB and pool(srv)["free_bytes"] == 64 * MiB, pool(srv)
        assert lent <= staging_files(srv.pid)   # the same files, still pinned, not made again
        assert pool(srv)["made_total_bytes"] == 64 * MiB
        second = sim_app("--sizes", "8M,8M,8M,8M,8M,8M")   # 48 MiB: three of the pool's four segments
        before = second.ask("digest")
        ck = gpucr.checkpoint(second.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (48 * MiB, 0) and "server_pin" not in ck.phases_s
        assert len(staging_files(second.pid) & lent) >= 1, "a returned segment is lent again"
        gpucr.restore(second.pid)
        assert second.ask("digest") == before
        assert ledger_total() == 64 * MiB
    finally:
        srv.stop()


def test_staging_a_live_app_gives_back_goes_back_to_the_pool_and_to_the_next_app(sim_app):
    """`restore --drop-staging` (the drop policy, the swap service's drop of a resumed app's staging): the app's agent
    closes and unmaps the segments it was lent, so they go back to the pool, pinned still, and the next app is lent
    them: its park pins nothing (a swap bench's parks each faulted and pinned theirs anew before)."""
    srv = started("--prepare-staging", "64M")
    try:
        app = sim_app("--sizes", "8M,8M,8M,6M")
        before = app.ask("digest")
        assert gpucr.checkpoint(app.pid).staging_lent_bytes == 32 * MiB
        lent = staging_files(app.pid)
        gpucr.restore(app.pid, drop_staging=True)
        assert app.ask("digest") == before
        assert gpucr.status(app.pid).staging_bytes == 0 and not staging_files(app.pid)
        wait_for(lambda: pool(srv)["lent_bytes"] == 0 and pool(srv)["free_bytes"] == 64 * MiB,
                 what="the given-back segments to come back to the pool")
        assert pool(srv)["returned_total_bytes"] == 32 * MiB and lent <= staging_files(srv.pid), pool(srv)
        assert pool(srv)["made_total_bytes"] == 64 * MiB, "nothing made again"
        other = sim_app("--sizes", ",".join(["8M"] * 8))   # 64 MiB: the whole pool, the returned segments too
        before = other.ask("digest")
        ck = gpucr.checkpoint(other.pid)
        assert ck.staging_lent_bytes == 64 * MiB and "server_pin" not in ck.phases_s, ck.phases_s
        assert staging_files(other.pid) & lent, "a returned segment is lent again"
        gpucr.restore(other.pid)
        assert other.ask("digest") == before
        wait_for(lambda: pool(srv)["free_bytes"] == 64 * MiB, what="the pool to refill")
        assert ledger_total() == 128 * MiB, entries()   # the pool's 64 and the app's 64 lent
    finally:
        srv.stop()


def test_a_file_a_process_or_its_child_holds_open_or_mapped_is_held_and_one_let_go_is_not():
    """What decides whether a segment given back may be lent again: any process's fd or mapping of it (an agent that
    closed its fd but still maps it holds it; a child forked after the lend holds it too), none once all let go."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import mmap, os, signal, sys
        fd = os.memfd_create("seg")
        os.ftruncate(fd, 1 << 20)
        st = os.fstat(fd)
        print(st.st_dev, st.st_ino, flush=True)
        m = mmap.mmap(fd, 1 << 20)
        kid = 0
        for step in sys.stdin:
            step = step.strip()
            if step == "fork":
                kid = os.fork()
                if kid == 0:   # holds the fd and the mapping until killed (reading nothing of the steps)
                    signal.pause()
            elif step == "close":
                os.close(fd)
            elif step == "unmap":
                m.close()
            elif step == "reap":
                os.kill(kid, 9)
                os.waitpid(kid, 0)
            print("done", flush=True)
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    me = os.getpid()
    try:
        ident = tuple(map(int, child.stdout.readline().split()))
        assert ident in held_files(me), "open and mapped"
        for step, held in (("fork", True), ("close", True), ("unmap", True), ("reap", False)):
            child.stdin.write(step + "\n")
            child.stdin.flush()
            child.stdout.readline()
            assert (ident in held_files(me)) == held, step
    finally:
        child.kill()
        child.wait()


def test_an_app_with_smaller_segments_is_lent_at_most_a_segment_more_than_it_asks(sim_app):
    """An app whose segment target (4 MiB) is below the pool's (16 MiB) asks for four segments of 4 MiB: one pool
    segment is lent (12 MiB more than asked, one segment's worth at most), the other three are made, in one step."""
    srv = started("--prepare-staging", "64M")
    try:
        app = sim_app("--sizes", "3M,3M,3M,3M", env={**os.environ, "GPUCR_STAGING_SEGMENT_MIB": "4"})
        before = app.ask("digest")
        ck = gpucr.checkpoint(app.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (SEG, 12 * MiB), ck
        assert gpucr.status(app.pid).staging_bytes == SEG + 12 * MiB
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
        wait_for(lambda: pool(srv)["free_bytes"] == 64 * MiB, what="the pool to refill")
        assert ledger_total() == 64 * MiB + SEG + 12 * MiB, entries()
    finally:
        srv.stop()


def test_a_size_past_a_segment_is_learned_and_made_ahead_for_the_next_app_of_that_shape(sim_app):
    """An allocation larger than a segment is placed whole: the first app's two segments of 40 MiB (the agent's plan:
    each at least its largest allocation) are made at its checkpoint, and the pool makes two of that size ahead,
    plain segments making way within its size, so the next app of that shape is lent all of its staging."""
    srv = started("--prepare-staging", "128M")
    try:
        first = sim_app("--sizes", "40M,8M")
        ck = gpucr.checkpoint(first.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (0, 80 * MiB), ck
        assert "server_pin" in ck.phases_s, ck.phases_s
        wait_for(lambda: pool(srv)["free_bytes"] == 128 * MiB and pool(srv)["making_bytes"] == 0
                 and pool(srv)["made_total_bytes"] > 128 * MiB, what="the pool to make the learned sizes")
        p = pool(srv)
        assert p["learned_sizes"] == {str(40 * MiB): 2}, p   # (JSON keys are strings)
        assert p["made_total_bytes"] == 128 * MiB + 80 * MiB, p
        second = sim_app("--sizes", "40M,8M")
        before = second.ask("digest")
        ck = gpucr.checkpoint(second.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (80 * MiB, 0), ck
        assert "server_pin" not in ck.phases_s, ck.phases_s
        gpucr.restore(second.pid)
        assert second.ask("digest") == before
        assert ledger_total() <= 128 * MiB + 160 * MiB
    finally:
        srv.stop()


def test_a_learned_size_past_the_pool_does_not_stop_its_refill(sim_app):
    """A size larger than the pool itself is remembered but not made: the plain segments lent are made again."""
    srv = started("--prepare-staging", "48M")
    try:
        app = sim_app("--sizes", "8M,8M,8M,8M,64M")   # (placed in reverse: the 64 MiB one first, in its own)
        ck = gpucr.checkpoint(app.pid)
        assert (ck.staging_lent_bytes, ck.staging_made_bytes) == (32 * MiB, 64 * MiB), ck
        wait_for(lambda: pool(srv)["free_bytes"] == 48 * MiB and pool(srv)["making_bytes"] == 0,
                 what="the pool to refill")
        assert pool(srv)["learned_sizes"] == {str(64 * MiB): 1} and pool(srv)["made_total_bytes"] == 80 * MiB, pool(srv)
    finally:
        srv.stop()
