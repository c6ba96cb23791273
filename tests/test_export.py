"""The agent makes the GPU memory it manages exportable and keeps one fd of each allocation (for the
gpucr server to import and copy), on simcuda, which keeps exported memory alive as the driver does: an
open fd holds the memory on the GPU. Real processes under LD_PRELOAD, real sockets and fds."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpucr
from gpucr.driver import gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20
HELPER = Path(__file__).parent / "apps" / "import_memory.py"


def used() -> int:
    return gpu_memory(sim_driver()).used


def ctl_fds(pid: int) -> int:
    """How many of pid's fds are opens of simcuda's control file (as /dev/nvidiactl: every exported fd is one)."""
    d, n = f"/proc/{pid}/fd", 0
    for f in os.listdir(d):
        try:
            n += os.readlink(f"{d}/{f}").endswith("/nvidiactl")
        except FileNotFoundError:   # closed since the listing (a fork child closes the agent's fds as it starts)
            pass
    return n


def import_in_controller(pid: int, want: dict[int, int]) -> dict:
    """Run a controller process that gathers pid's memory fds, imports them through simcuda and hashes them."""
    r = subprocess.run([sys.executable, str(HELPER), str(pid), json.dumps(want)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_controller_imports_every_managed_allocation_through_the_agents_fds(sim_app):
    app = sim_app("--sizes", "8M,3M,64K", "--vmm-mib", "4")
    assert app.ask("vmm-export 2")["rc"] == 0   # the application's own VMM, made without any handle type
    bufs = app.ask("buffers")["buffers"]
    got = import_in_controller(app.pid, {b["va"]: b["bytes"] for b in bufs})
    kinds = sorted(m["kind"] for m in got["memory"])
    # 8M and 3M made VMM by the agent; the 4 MiB range in two 2 MiB handles and the 2 MiB export: its own
    assert kinds == ["app_vmm"] * 3 + ["converted"] * 2
    assert all(m["fd"] and not m["released"] and not m["not_exportable"] for m in got["memory"])
    # every buffer but the 64 KiB one (left native, to the driver) read in the controller, byte-exact
    expect = {str(b["va"]): b["sha256"] for b in bufs if b["bytes"] >= 2 * MiB}
    assert got["digests"] == expect
    # the controller's import and fds are gone with it: nothing stays on the GPU for them
    before = used()
    app.ask("free 0")
    assert used() == before - 8 * MiB


def test_application_export_is_answered_from_the_agents_fd_even_for_imported_memory(sim_app):
    a, b, c = sim_app("--sizes", "4M"), sim_app("--sizes", "4M"), sim_app("--sizes", "4M")
    exp = a.ask("vmm-export 2")   # the driver would refuse: the application asked for no handle type
    assert exp["rc"] == 0 and exp["fd"] >= 0
    b.ask(f"import pidfd:{a.pid}:{exp['fd']} 2")
    a.ask(f"close-fd {exp['fd']}")
    again = b.ask("export-shared 0")   # memory b imported: the driver never exports such a handle again
    assert again["rc"] == 0
    c.ask(f"import pidfd:{b.pid}:{again['fd']} 2")
    b.ask(f"close-fd {again['fd']}")
    a.ask("write-shared 4242")
    assert a.ask("read-shared")["sha256"] == b.ask("read-shared")["sha256"] == c.ask("read-shared")["sha256"]
    c.ask("write-shared 17")   # one buffer in three processes
    assert a.ask("read-shared")["sha256"] == c.ask("read-shared")["sha256"]


def test_free_gives_gpu_memory_back_at_once_even_with_a_fork_child(sim_app):
    app = sim_app("--sizes", "4M")
    app.ask("fork 30")   # a child that inherited every fd the agent had, and sleeps
    start, info0, fds0 = used(), app.ask("meminfo"), ctl_fds(app.pid)
    app.ask(f"alloc {64 * MiB}")
    assert used() == start + 64 * MiB and app.ask("meminfo")["free"] == info0["free"] - 64 * MiB
    assert ctl_fds(app.pid) == fds0 + 1, "the agent keeps one fd of the allocation"
    app.ask("free 1")
    assert used() == start, "the agent's fd was closed with the free: nothing stays on the GPU"
    assert app.ask("meminfo")["free"] == info0["free"], "cuMemGetInfo tells the application so"
    assert ctl_fds(app.pid) == fds0
    app.ask(f"ctx-temp {32 * MiB}")   # a context's end frees what was made in it: the agent's fd goes too
    assert used() == start and ctl_fds(app.pid) == fds0


def test_stream_ordered_pool_segments_are_handed_over_too(sim_workload):
    app = sim_workload("pool_app", "--sizes", "8M,3M", "--pool-sizes", "6M", "--streams", "2")
    got = import_in_controller(app.pid, {})
    kinds = [m["kind"] for m in got["memory"]]
    assert "pool" in kinds and all(m["fd"] for m in got["memory"]), got["memory"]


def test_fork_child_holds_none_of_the_agents_fds(sim_app):
    app = sim_app("--sizes", "8M,4M", "--vmm-mib", "4")
    parent = ctl_fds(app.pid)
    child = app.ask("fork 30")["child"]
    # the agent holds 4 fds (8M, 4M, two 2 MiB handles); the child closes them in its fork handler (it
    # may not have run yet when the parent answers) and keeps only simcuda's own opens
    deadline = time.monotonic() + 10
    while ctl_fds(child) > parent - 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctl_fds(child) <= parent - 4


def test_parked_process_holds_nothing_and_its_memory_is_exportable_again_after_restore(sim_app):
    idle = used()
    app = sim_app("--sizes", "8M,3M", "--vmm-mib", "4")
    fd = app.ask("vmm-export 2")["fd"]
    app.ask(f"close-fd {fd}")   # the application's own fd would keep its memory on the GPU, as on the driver
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    assert used() == idle, "the agent's fds do not keep memory on the GPU while the process is parked"
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
    bufs = app.ask("buffers")["buffers"]
    got = import_in_controller(app.pid, {b["va"]: b["bytes"] for b in bufs})
    assert all(m["fd"] for m in got["memory"]) and len(got["memory"]) == 5
    assert got["digests"] == {str(b["va"]): b["sha256"] for b in bufs}


def nofile(pid: int, which: str) -> int:
    out = subprocess.run(["prlimit", "--pid", str(pid), "--nofile", "--raw", "--noheadings", f"--output={which}"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def test_nofile_soft_limit_is_raised_to_the_hard_one_for_thousands_of_allocations(sim_app):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard != resource.RLIM_INFINITY and hard >= 2000, f"the hard RLIMIT_NOFILE here ({hard}) is too low"
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))   # the application starts with a low soft limit
    try:
        app = sim_app("--sizes", "4M")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert nofile(app.pid, "SOFT") == hard, "raised when the process took up CUDA"
    assert app.ask("many 1500 2097152")["count"] == 1500   # as expandable segments make them: one per 2 MiB
    assert gpucr.status(app.pid).allocations.not_exportable == 0
    assert ctl_fds(app.pid) >= 1500
    app.ask("free-many")


def test_no_fd_left_refuses_clearly_and_allocations_still_work(sim_app):
    app = sim_app("--sizes", "4M")
    subprocess.run(["prlimit", "--pid", str(app.pid), "--nofile=200:200"], check=True)   # no room to raise it
    before = app.ask("digest")
    assert app.ask("many 1500 2097152")["count"] == 1500, "every allocation works for the application"
    lacking = gpucr.status(app.pid).allocations.not_exportable
    assert 1500 - 200 <= lacking < 1500, "the agent keeps fds while the table has room, then says so"
    out = gpucr_cli("status", str(app.pid))
    assert out.returncode == 0 and f"{lacking} allocations are not" in out.stdout and "RLIMIT_NOFILE" in out.stdout
    # the data plane, in another process, can only reach memory through an fd of it: refused before touching
    with pytest.raises(gpucr.GpucrError, match=rf"{lacking} without an fd of the agent's.*raise 'ulimit -n'"):
        gpucr.checkpoint(app.pid)
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before
    app.ask("free-many")   # fds for every allocation again: the checkpoint goes through
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert gpucr.status(app.pid).allocations.not_exportable == 0
    assert app.ask("digest") == before
