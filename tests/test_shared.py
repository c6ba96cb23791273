"""Two processes on one (simulated) GPU sharing a buffer through an exported POSIX-fd handle:
checkpointed together, the exporter's data saved once, both see the same memory after restore."""
from __future__ import annotations

import os

import pytest

import gpucr
from gpucr.coordinator import checkpoint_many, restore_many
from gpucr.driver import gpu_memory

from conftest import sim_driver

MiB = 1 << 20


def used() -> int:
    return gpu_memory(sim_driver()).used


@pytest.fixture
def pair(sim_app):
    idle = used()
    env = dict(os.environ, GPUCR_GROUP="shared")
    exp = sim_app("--sizes", "8M", env=env)
    imp = sim_app("--sizes", "4M", env=env)
    fd = exp.ask("share 32")["fd"]
    imp.ask(f"import pidfd:{exp.pid}:{fd} 32")
    exp.fd = fd
    return exp, imp, idle


def test_shared_buffer_checkpointed_together(pair):
    exp, imp, idle = pair
    exp.ask("write-shared 7")
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
    imp.ask("write-shared 9")   # both read and write it
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]
    before = [exp.ask("digest"), imp.ask("digest")]
    va = [exp.ask("read-shared")["va"], imp.ask("read-shared")["va"]]

    res = checkpoint_many([exp.pid, imp.pid])
    assert used() == idle, "the shared memory and everything else is given back"
    moved = {r["pid"]: r["bytes_moved"] for r in res}
    assert moved[exp.pid] >= (8 + 32) * MiB and moved[imp.pid] < 32 * MiB, "the exporter's data is stored once"
    # the exporter still holds the exported fd, which keeps real GPU memory allocated: it is said
    warned = {r["pid"]: r["warnings"] for r in res}
    assert len(warned[exp.pid]) == 1 and "open file descriptor" in warned[exp.pid][0] and warned[imp.pid] == []

    restore_many([exp.pid, imp.pid])
    assert [exp.ask("digest"), imp.ask("digest")] == before
    assert [exp.ask("read-shared")["va"], imp.ask("read-shared")["va"]] == va
    exp.ask("write-shared 11")   # still one buffer, not two copies
    assert imp.ask("read-shared")["sha256"] == exp.ask("read-shared")["sha256"]
    imp.ask("write-shared 12")
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]
    # and again, with the fd closed as NCCL does: nothing to warn about
    exp.ask(f"close-fd {exp.fd}")
    assert all(r["warnings"] == [] for r in checkpoint_many([exp.pid, imp.pid], level="data"))
    restore_many([exp.pid, imp.pid])
    assert exp.ask("read-shared")["sha256"] == imp.ask("read-shared")["sha256"]


def test_sharing_process_alone_is_refused(pair):
    exp, imp, _ = pair
    with pytest.raises(gpucr.GpucrError, match="not in this checkpoint"):
        gpucr.checkpoint(imp.pid)
    with pytest.raises(gpucr.GpucrError, match="not in this checkpoint"):
        gpucr.checkpoint(exp.pid)
    assert gpucr.status(exp.pid)["state"] == gpucr.status(imp.pid)["state"] == "running"
