"""Two processes on one (simulated) GPU sharing a buffer through an exported POSIX-fd handle:
checkpointed together, the exporter's data saved once, both see the same memory after restore. Each test
runs through the gpucr server's data plane and through the agents' own (the `plane` fixture)."""
from __future__ import annotations

import os

import pytest

import gpucr
from gpucr import checkpoint_many, restore_many   # through the module's gpucr server when one runs
from gpucr import target as targets
from gpucr.driver import gpu_memory

from conftest import moved_by, server_gpu_bytes, sim_driver

MiB = 1 << 20


def used() -> int:
    """The simulated GPU's memory in use, apart from the gpucr server's own context."""
    return gpu_memory(sim_driver()).used - server_gpu_bytes()


@pytest.fixture
def pair(plane, sim_app):
    idle = used()
    env = dict(os.environ, GPUCR_GROUP="shared")
    exp = sim_app("--sizes", "8M", env=env)
    imp = sim_app("--sizes", "4M", env=env)
    fd = exp.ask("share 32")["fd"]
    imp.ask(f"import pidfd:{exp.pid}:{fd} 32")
    exp.fd = fd
    return exp, imp, idle


def test_shared_buffer_checkpointed_together(plane, pair):
    exp, imp, idle = pair
    exp.ask("write-shared 7")
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
    imp.ask("write-shared 9")   # both read and write it
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]
    before = [exp.ask("digest"), imp.ask("digest")]
    va = [exp.ask("read-shared")["va"], imp.ask("read-shared")["va"]]

    res = moved_by(plane, checkpoint_many([exp.pid, imp.pid])).processes
    # the exporter still holds the exported fd: as on the driver, that keeps the shared buffer on the
    # GPU (simcuda models it); everything else is given back
    assert used() == idle + 32 * MiB
    moved = {r.pid: r.bytes_moved for r in res}
    assert moved[exp.pid] >= (8 + 32) * MiB and moved[imp.pid] < 32 * MiB, "the exporter's data is stored once"
    # the exporter still holds the exported fd, which keeps real GPU memory allocated: it is said
    warned = {r.pid: r.warnings for r in res}
    assert len(warned[exp.pid]) == 1 and "open file descriptor" in warned[exp.pid][0] and warned[imp.pid] == []

    moved_by(plane, restore_many([exp.pid, imp.pid]))
    assert [exp.ask("digest"), imp.ask("digest")] == before
    assert [exp.ask("read-shared")["va"], imp.ask("read-shared")["va"]] == va
    exp.ask("write-shared 11")   # still one buffer, not two copies
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
    imp.ask("write-shared 12")
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]
    # and again, with the fd closed as NCCL does: nothing to warn about, nothing left on the GPU
    exp.ask(f"close-fd {exp.fd}")
    assert all(r.warnings == [] for r in moved_by(plane, checkpoint_many([exp.pid, imp.pid])).processes)
    assert used() == idle
    moved_by(plane, restore_many([exp.pid, imp.pid]))
    assert all(r.warnings == [] for r in moved_by(plane, checkpoint_many([exp.pid, imp.pid], level="data")).processes)
    moved_by(plane, restore_many([exp.pid, imp.pid]))
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]


def test_processes_sharing_memory_written_to_images_come_back_from_them(plane, pair, tmp_path):
    """Each process to its own image: the exporter's holds the shared buffer, the importer's only its own memory
    (its import is unlinked, and relinked from the exporter at the restore). Read back from the images, both
    run on with one buffer between them, every byte back at the same addresses."""
    exp, imp, _ = pair
    exp.ask(f"close-fd {exp.fd}")
    exp.ask("write-shared 7")
    before = [exp.ask("digest"), imp.ask("digest"), imp.ask("read-shared")]
    images = {exp.pid: tmp_path / "exp", imp.pid: tmp_path / "imp"}
    moved_by(plane, checkpoint_many([exp.pid, imp.pid], images=images))
    moved_by(plane, restore_many([exp.pid, imp.pid], images=images))
    assert [exp.ask("digest"), imp.ask("digest"), imp.ask("read-shared")] == before
    exp.ask("write-shared 11")   # still one buffer, not two copies
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]


def test_an_importer_with_nothing_of_its_own_to_move(plane, sim_app):
    """An importer whose only movable memory is its exporter's (its own buffer is below a granule: the
    driver's): it is handed over (unlinked) or released with nothing to copy, and relinked at restore."""
    env = dict(os.environ, GPUCR_GROUP="shared")
    exp, imp = sim_app("--sizes", "8M", env=env), sim_app("--sizes", "1000", env=env)
    fd = exp.ask("share 32")["fd"]
    imp.ask(f"import pidfd:{exp.pid}:{fd} 32")
    exp.ask(f"close-fd {fd}")
    for i in range(2):
        exp.ask(f"write-shared {5 + i}")
        before = [exp.ask("digest"), imp.ask("digest")]
        ck = moved_by(plane, checkpoint_many([exp.pid, imp.pid]))
        assert [p.bytes_moved for p in ck.processes] == [40 * MiB, 0], ck
        moved_by(plane, restore_many([exp.pid, imp.pid]))
        assert [exp.ask("digest"), imp.ask("digest")] == before


def test_sharing_process_alone_is_refused(pair):
    exp, imp, _ = pair
    with pytest.raises(gpucr.GpucrError, match="not in this checkpoint"):
        gpucr.checkpoint(imp.pid)
    with pytest.raises(gpucr.GpucrError, match="not in this checkpoint"):
        gpucr.checkpoint(exp.pid)
    assert gpucr.status(exp.pid).state == gpucr.status(imp.pid).state == "running"


def test_two_processes_sharing_several_buffers_both_ways(plane, sim_app):
    """As two NCCL ranks do: each exports several buffers and imports the other's, closing every fd
    once imported. On the real driver every exported fd looks the same to fstat (one inode of
    /dev/nvidiactl), and simcuda's exports do too: the buffers are told apart by the open file
    description each agent kept, and every importer relinks the right buffer at its old address."""
    idle = used()
    env = dict(os.environ, GPUCR_GROUP="ranks")
    a, b = sim_app("--sizes", "8M", env=env), sim_app("--sizes", "4M", env=env)
    for exp, imp in ((a, b), (b, a)):
        for mib in (4, 6, 8):
            fd = exp.ask(f"share {mib}")["fd"]
            imp.ask(f"import pidfd:{exp.pid}:{fd} {mib}")
            exp.ask(f"close-fd {fd}")
    # a's buffers 0-2 are its exports, b's 0-2 its imports of them; b's 3-5 its exports, a's 3-5 its imports
    pairs = [(a, i, b, i) for i in range(3)] + [(b, 3 + i, a, 3 + i) for i in range(3)]
    for k, (exp, i, imp, j) in enumerate(pairs):
        exp.ask(f"write-shared {100 + k} {i}")
        assert imp.ask(f"read-shared {j}")["sha256"] == exp.ask(f"read-shared {i}")["sha256"]
    vas = [(exp.ask(f"read-shared {i}")["va"], imp.ask(f"read-shared {j}")["va"]) for exp, i, imp, j in pairs]
    digests = [a.ask("digest"), b.ask("digest")]

    for level in ("full", "data", "full"):
        res = moved_by(plane, checkpoint_many([a.pid, b.pid], level=level))
        assert all(r.warnings == [] for r in res.processes), res
        if level == "full":
            assert used() == idle, "every buffer is given back: no fd keeps one on the GPU"
        moved_by(plane, restore_many([a.pid, b.pid]))
        assert [a.ask("digest"), b.ask("digest")] == digests
        for k, (exp, i, imp, j) in enumerate(pairs):
            assert (exp.ask(f"read-shared {i}")["va"], imp.ask(f"read-shared {j}")["va"]) == vas[k]
            imp.ask(f"write-shared {200 + k} {j}")   # still one buffer, and the right one
            assert exp.ask(f"read-shared {i}")["sha256"] == imp.ask(f"read-shared {j}")["sha256"], (level, k)
        digests = [a.ask("digest"), b.ask("digest")]


def test_unreachable_process_on_the_same_gpu_refuses_a_sharing_checkpoint(pair, sim_app):
    """Only processes on the same GPU are asked, and one that cannot answer refuses the checkpoint
    of processes that share memory (it could be importing it): fail closed, naming it, at once.
    A checkpoint that shares nothing asks no one."""
    import signal
    import time
    exp, imp, _ = pair
    other = sim_app("--sizes", "4M")
    lone = sim_app("--sizes", "4M")
    os.kill(other.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(gpucr.GpucrError, match=f"process {other.pid} .*stopped"):
            checkpoint_many([exp.pid, imp.pid])
        assert time.monotonic() - t0 < 3
        assert gpucr.status(exp.pid).state == gpucr.status(imp.pid).state == "running"
        t0 = time.monotonic()
        gpucr.checkpoint(lone.pid)
        assert time.monotonic() - t0 < 3, "a checkpoint sharing nothing does not wait for the stopped process"
        gpucr.restore(lone.pid)
    finally:
        os.kill(other.pid, signal.SIGCONT)
    checkpoint_many([exp.pid, imp.pid])
    restore_many([exp.pid, imp.pid])


def test_a_stopped_process_holding_no_gpu_is_not_asked(pair):
    """The candidates are the processes that hold the GPU's device node open (what every process with
    a context there does): a stopped process under gpucr that only initialised the driver (as
    torchrun's launcher does) holds none, so a checkpoint of processes sharing memory goes ahead at
    once without asking it (before: every process under gpucr was asked, and this one refused it)."""
    import signal
    import subprocess
    import sys
    import time
    from gpucr import paths
    exp, imp, _ = pair
    idle = subprocess.Popen([sys.executable, "-c", "import ctypes, sys; cu = ctypes.CDLL('libcuda.so.1');"
                             "assert cu.cuInit(0) == 0; print('ready', flush=True); sys.stdin.read()"],
                            env=paths.run_env(simulate=True), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "ready"
        assert idle.pid in [p for p, _ in targets.list_sockets()], "it runs under gpucr"
        os.kill(idle.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        checkpoint_many([exp.pid, imp.pid])
        assert time.monotonic() - t0 < 3
        restore_many([exp.pid, imp.pid])
    finally:
        idle.kill()
        idle.wait()


def test_exporter_killed_during_data_out_leaves_the_importer_running(pair, monkeypatch):
    """A rank killed mid-checkpoint, before anyone gave memory back (processes that share memory
    release only once all are copied): the other is aborted and runs with every byte, even what it
    imported from the dead one (its import still holds that memory)."""
    exp, imp, _ = pair
    exp.ask(f"close-fd {exp.fd}")
    exp.ask("write-shared 7")
    shared = imp.ask("read-shared")["sha256"]
    own = imp.ask("digest")
    monkeypatch.setenv("GPUCR_TEST_KILL_TARGET", f"data-out:{exp.pid}")
    with pytest.raises(gpucr.GpucrError, match=f"process {exp.pid}"):
        checkpoint_many([exp.pid, imp.pid])
    exp.proc.wait(timeout=30)
    st = gpucr.status(imp.pid)
    assert st.state == "running" and not st.gate_closed and st.checkpoint_phase == ""
    assert imp.ask("read-shared")["sha256"] == shared and imp.ask("digest") == own
    # alone, it holds memory whose exporter is gone, which no restore could relink: refused, clearly
    with pytest.raises(gpucr.GpucrError, match="imported from a process gpucr cannot find"):
        gpucr.checkpoint(imp.pid)


def test_exporter_killed_at_the_driver_lock(plane, pair, monkeypatch):
    """Killed at the driver lock. Through the mover (the server's, or the command's own with no server) the
    driver's steps run beside the copies, before any agent lets go of its fds: the importer's fd of the shared
    memory still holds it, so it is mapped again as it was, every byte intact; alone, it is then refused, as
    any importer of a dead exporter. (The agent's own plane, which gave the memory back before the driver's
    steps and put zeroed memory in its place, no longer runs for a group the mover can take.)"""
    exp, imp, _ = pair
    exp.ask(f"close-fd {exp.fd}")
    exp.ask("write-shared 7")
    shared = imp.ask("read-shared")["sha256"]
    monkeypatch.setenv("GPUCR_TEST_KILL_TARGET", f"driver-lock:{exp.pid}")
    with pytest.raises(gpucr.GpucrError, match=f"process {exp.pid}") as failed:
        checkpoint_many([exp.pid, imp.pid])
    exp.proc.wait(timeout=30)
    st = gpucr.status(imp.pid)
    assert st.state == "running" and not st.gate_closed
    assert "zeroed" not in str(failed.value), failed.value
    assert imp.ask("read-shared")["sha256"] == shared
    with pytest.raises(gpucr.GpucrError, match="imported from a process gpucr cannot find"):
        gpucr.checkpoint(imp.pid)


def test_a_process_that_does_not_drain_aborts_the_others_before_anything_is_released(pair):
    """Processes that share memory go through quiesce, copy and release together: when one cannot be
    made still in time (a kernel running past the deadline, as a rank in a collective its peer never
    joins), the others are aborted having released nothing, so shared memory is never split."""
    import time
    exp, imp, _ = pair
    exp.ask("write-shared 3")
    before = [exp.ask("digest"), imp.ask("digest")]
    gens = [gpucr.status(p).generation for p in (exp.pid, imp.pid)]
    imp.ask("spin 4000")   # the importer's kernel runs for 4 s
    time.sleep(0.2)
    with pytest.raises(gpucr.GpucrError, match=f"process {imp.pid} failed at quiesce.*all 2 processes run on"):
        checkpoint_many([exp.pid, imp.pid], timeout=1)
    for p in (exp.pid, imp.pid):
        st = gpucr.status(p)
        assert st.state == "running" and not st.gate_closed and st.checkpoint_phase == ""
    assert [gpucr.status(p).generation for p in (exp.pid, imp.pid)] == gens, "nothing was checkpointed"
    time.sleep(4)
    assert [exp.ask("digest"), imp.ask("digest")] == before
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
    checkpoint_many([exp.pid, imp.pid])
    restore_many([exp.pid, imp.pid])
    assert [exp.ask("digest"), imp.ask("digest")] == before


@pytest.mark.parametrize("point", ["after-driver-lock", "after-driver-checkpoint"])
def test_recover_brings_back_processes_that_share_memory(pair, point):
    """A controller killed with both processes held by the driver: each agent's lease rolls its own
    process back once the driver lets go, which an importer cannot do alone (its memory is the
    exporter's); `gpucr recover` restores them together and relinks from wherever the exporter is."""
    from conftest import gpucr_cli
    exp, imp, _ = pair
    exp.ask(f"close-fd {exp.fd}")
    exp.ask("write-shared 9")
    before = [exp.ask("digest"), imp.ask("digest")]
    r = gpucr_cli("checkpoint", str(exp.pid), str(imp.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    assert r.returncode != 0
    r = gpucr_cli("recover", str(exp.pid), str(imp.pid), env=dict(os.environ, GPUCR_NO_SERVER="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    for p in (exp.pid, imp.pid):
        st = gpucr.status(p)
        assert st.state == "running" and not st.gate_closed, st
    assert [exp.ask("digest"), imp.ask("digest")] == before
    imp.ask("write-shared 4")
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"], "still one buffer"
