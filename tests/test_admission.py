"""Admission of host staging (issue 13 item 4), on simcuda with real processes: a checkpoint whose
staging would pass the user's host-memory budget (GPUCR_HOST_BUDGET, shared by all processes under
gpucr) or the memory cgroup's limit is refused in one line before anything is touched."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

import gpucr
from gpucr import paths
from gpucr import results as R
from gpucr.cli import _mib

from conftest import gpucr_cli

MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "GPUCR_STAGING": "shm", **extra}


def _refused(r, pattern: str) -> str:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert pattern in lines[0], lines[0]
    return lines[0]


def _untouched(pid: int) -> R.ProcessStatus:
    st = gpucr.status(pid)
    assert st.state == "running" and not st.gate_closed and st.generation == 0, st
    assert st.staging_bytes == 0 and st.staging_segments == 0, "no staging made"
    return st


def test_a_budget_smaller_than_the_data_refuses_before_anything_is_touched(sim_app):
    app = sim_app("--sizes", "64M", env=_env(GPUCR_HOST_BUDGET="32M"))
    before = app.ask("digest")
    line = _refused(gpucr_cli("checkpoint", str(app.pid)), "host-memory budget")
    assert "32 MiB" in line and "raise GPUCR_HOST_BUDGET" in line and "--staging file:DIR" in line, line
    _untouched(app.pid)
    assert app.ask("digest") == before, "the application runs on, its data as it was"


def test_the_budget_is_shared_by_the_processes_of_the_user(sim_app):
    """The first process's staging counts against the second's checkpoint; once it is given back,
    the second fits."""
    first = sim_app("--sizes", "48M", env=_env(GPUCR_HOST_BUDGET="80M"))
    second = sim_app("--sizes", "48M", env=_env(GPUCR_HOST_BUDGET="80M"))
    gpucr.checkpoint(first.pid)
    held = gpucr.status(first.pid).staging_bytes
    assert held >= 48 * MiB
    line = _refused(gpucr_cli("checkpoint", str(second.pid)), "host-memory budget")
    assert f"other processes hold {held // MiB} MiB" in line, line
    st = _untouched(second.pid)
    assert st.host_budget_bytes == 80 * MiB and st.host_budget_used_bytes == held, st
    gpucr.restore(first.pid, drop_staging=True)
    assert gpucr.status(first.pid).staging_bytes == 0
    gpucr.checkpoint(second.pid)
    gpucr.restore(second.pid)


def _ledger() -> list[str]:
    return sorted(p.name for p in paths.runtime_dir().iterdir() if p.name.endswith(".staging"))


def test_a_killed_process_staging_no_longer_counts(sim_app):
    first = sim_app("--sizes", "48M", env=_env(GPUCR_HOST_BUDGET="80M"))
    second = sim_app("--sizes", "48M", env=_env(GPUCR_HOST_BUDGET="80M"))
    gpucr.checkpoint(first.pid)
    assert [n.split("-")[0] for n in _ledger()] == [str(first.pid)]
    first.proc.kill()
    first.proc.wait()
    gpucr.checkpoint(second.pid)   # the dead process's entry holds no flock: stale, not counted, removed
    assert [n.split("-")[0] for n in _ledger()] == [str(second.pid)]
    gpucr.restore(second.pid, drop_staging=True)
    assert _ledger() == [], "staging given back: the entry goes with it"


def test_ps_removes_a_killed_process_ledger_entry(sim_app):
    app = sim_app("--sizes", "16M", env=_env())
    gpucr.checkpoint(app.pid)
    assert len(_ledger()) == 1
    app.proc.kill()
    app.proc.wait()
    assert gpucr.ps().processes == [] and _ledger() == []


def test_a_fork_child_does_not_keep_the_parent_entry_alive(sim_app):
    """The entry's flock is the process's life sign: a fork child (a DataLoader worker) must not hold it."""
    import signal
    app = sim_app("--sizes", "16M", env=_env())
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)   # staging kept: the entry stays
    child = app.ask("fork 30")["child"]
    try:
        app.proc.kill()
        app.proc.wait()
        assert os.path.exists(f"/proc/{child}"), "the child outlives its parent"
        # the child lets go of the entry's fd in its fork handler, which it runs once scheduled (late on a busy host)
        deadline = time.time() + 10
        while gpucr.ps() is not None and _ledger() and time.time() < deadline:
            time.sleep(0.05)
        assert _ledger() == [], "the parent's entry is stale although its fork child lives"
    finally:
        os.kill(child, signal.SIGKILL)


def test_status_and_ps_show_the_budget_and_what_is_used(sim_app):
    app = sim_app("--sizes", "16M", env=_env(GPUCR_HOST_BUDGET="1G"))
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert st.host_budget_bytes == 1 << 30 and st.host_budget_used_bytes == st.staging_bytes > 0, st
    out = gpucr_cli("status", str(app.pid)).stdout
    assert f"host memory  budget 1,024 MiB, {_mib(st.staging_bytes)} of it used" in out, out
    ps = gpucr_cli("ps").stdout
    row = next(l for l in ps.splitlines() if l.split()[:1] == [str(app.pid)])
    assert "STAGING" in ps and _mib(st.staging_bytes) in row, ps
    assert f"host staging: {_mib(st.staging_bytes)} held by all processes under gpucr; budget 1,024 MiB" in ps, ps
    gpucr.restore(app.pid)


def test_a_budget_as_a_share_of_memtotal(sim_app):
    total = next(int(l.split()[1]) * 1024 for l in Path("/proc/meminfo").read_text().splitlines()
                 if l.startswith("MemTotal:"))
    app = sim_app("--sizes", "8M", env=_env(GPUCR_HOST_BUDGET="50%"))
    assert gpucr.status(app.pid).host_budget_bytes == total // 100 * 50


def test_file_staging_is_outside_the_budget(sim_app, tmp_path):
    """Staging in a file (GPUCR_STAGING=file:DIR) lies on a filesystem, not in host memory: the way
    to checkpoint past the budget, as the refusal says."""
    app = sim_app("--sizes", "64M", env=_env(GPUCR_HOST_BUDGET="32M", GPUCR_STAGING=f"file:{tmp_path}"))
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert st.staging_kind == "file" and st.staging_bytes >= 64 * MiB and st.host_budget_used_bytes == 0, st
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


# ---- the memory cgroup ----

def _fake_cgroup(root: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    for rel, text in files.items():
        p = root / "sys/fs/cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("case", ["v2-own", "v2-parent-tighter", "v2-high", "v1", "v2-max-is-none"])
def test_the_cgroup_files_are_read_as_the_kernel_writes_them(sim_app, tmp_path, case):
    """Fake /proc/self/cgroup and /sys/fs/cgroup files (GPUCR_TEST_CGROUP_ROOT): the binding limit is
    the least room among the process's cgroup and its ancestors; 'max' is no limit."""
    v2 = "0::/user.slice/app.scope\n"
    layouts = {
        "v2-own": (v2, {"user.slice/app.scope/memory.max": "33554432\n", "user.slice/app.scope/memory.current": "0\n"},
                   ("/sys/fs/cgroup/user.slice/app.scope", "memory.max", 32 * MiB, 0)),
        "v2-parent-tighter": (v2, {"user.slice/app.scope/memory.max": "max\n",
                                   "user.slice/app.scope/memory.current": "1048576\n",
                                   "user.slice/memory.max": "50331648\n", "user.slice/memory.current": "20971520\n"},
                              ("/sys/fs/cgroup/user.slice", "memory.max", 48 * MiB, 20 * MiB)),
        "v2-high": (v2, {"user.slice/app.scope/memory.max": "1073741824\n",
                         "user.slice/app.scope/memory.high": "16777216\n",
                         "user.slice/app.scope/memory.current": "0\n"},
                    ("/sys/fs/cgroup/user.slice/app.scope", "memory.high", 16 * MiB, 0)),
        "v1": ("12:pids:/x\n4:memory:/job/7\n0::/\n", {"memory/job/7/memory.limit_in_bytes": "41943040\n",
                                                    "memory/job/7/memory.usage_in_bytes": "10485760\n",
                                                    "memory/memory.limit_in_bytes": "9223372036854771712\n"},
               ("/sys/fs/cgroup/memory/job/7", "memory.limit_in_bytes", 40 * MiB, 10 * MiB)),
        "v2-max-is-none": (v2, {"user.slice/app.scope/memory.max": "max\n",
                                "user.slice/app.scope/memory.current": "0\n"}, None),
    }
    text, files, want = layouts[case]
    root = _fake_cgroup(tmp_path / "root", text, files)
    app = sim_app("--sizes", "64M", env=_env(GPUCR_TEST_CGROUP_ROOT=str(root)))
    cg = gpucr.status(app.pid).memory_cgroup
    if want is None:
        assert cg is None
        gpucr.checkpoint(app.pid)
        gpucr.restore(app.pid)
        return
    assert (cg.path, cg.limit_file, cg.limit_bytes, cg.current_bytes) == want, cg
    line = _refused(gpucr_cli("checkpoint", str(app.pid)), f"memory cgroup {want[0]}")
    assert f"{want[1]} {want[2] // MiB} MiB, current {want[3] // MiB} MiB" in line and "need" in line, line
    _untouched(app.pid)


def _real_memory_cgroup() -> tuple[Path, str] | str:
    """A memory cgroup this test may make: under the v2 tree (memory.max) or the v1 memory hierarchy,
    below the one this process is in; or why not."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((l.split(":", 2)[2] for l in lines if "memory" in l.split(":")[1].split(",")), None)
    if v1 is not None:
        parent, limit = Path("/sys/fs/cgroup/memory" + v1), "memory.limit_in_bytes"
    else:
        v2 = next((l.split(":", 2)[2] for l in lines if l.startswith("0::")), None)
        if v2 is None:
            return "no memory cgroup (neither v1's memory controller nor cgroup v2) in /proc/self/cgroup"
        parent, limit = Path("/sys/fs/cgroup" + v2), "memory.max"
        if "memory" not in (parent / "cgroup.subtree_control").read_text() if (parent / "cgroup.subtree_control").exists() else True:
            return f"cgroup v2 at {parent} does not hand the memory controller to its children"
    child = parent / f"gpucr-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as e:
        return f"cannot make a cgroup under {parent}: {e.strerror}"
    return child, limit


def test_a_real_cgroup_limit_refuses_the_checkpoint(sim_app):
    made = _real_memory_cgroup()
    if isinstance(made, str):
        pytest.skip(made)
    cg, limit_file = made
    try:
        app = sim_app("--sizes", "128M", env=_env())
        before = app.ask("digest")
        (cg / limit_file).write_text(str(1024 * MiB))
        (cg / "cgroup.procs").write_text(str(app.pid))
        current = int((cg / ("memory.usage_in_bytes" if limit_file.endswith("in_bytes") else "memory.current"))
                      .read_text())
        # room for half the data: the process runs on, its staging would not fit
        (cg / limit_file).write_text(str(current + 64 * MiB))
        st = gpucr.status(app.pid)
        assert st.memory_cgroup is not None and st.memory_cgroup.path == str(cg), st.memory_cgroup
        line = _refused(gpucr_cli("checkpoint", str(app.pid)), f"memory cgroup {cg}")
        # the plane faults staging in, so the kernel charges its own cgroup; the app's limit is checked as a policy
        assert f"{limit_file} " in line and "staging counts against it" in line, line
        _untouched(app.pid)
        # raised: it fits, and the cycle goes through (the digest reads the data through host memory:
        # only now is there room for it)
        (cg / limit_file).write_text(str(current + 1024 * MiB))
        assert app.ask("digest") == before
        gpucr.checkpoint(app.pid)
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            (cg.parent / "cgroup.procs").write_text(pid)
        cg.rmdir()


def test_an_image_needs_no_staging_so_no_budget(sim_app, tmp_path):
    """--image DIR writes the image from the GPU straight to disk through the data plane's ring, with no staging:
    a process twice the host budget is checkpointed to disk (a plain checkpoint of it is refused, saying so) and
    comes back byte-exact."""
    app = sim_app("--sizes", "64M", env=_env(GPUCR_HOST_BUDGET="32M"))
    before = app.ask("digest")
    line = _refused(gpucr_cli("checkpoint", str(app.pid)), "host-memory budget")
    assert "gpucr checkpoint --image DIR" in line, line
    _untouched(app.pid)
    image = tmp_path / "img"
    ck = gpucr.checkpoint(app.pid, image=image)
    assert ck.image.bytes >= 64 * MiB and gpucr.status(app.pid).staging_bytes == 0
    gpucr.restore(app.pid, image=image)
    assert app.ask("digest") == before


def _hold_runtime_dir_lock(seconds: float) -> int:
    """A process of this user holding the ledger's lock (the runtime dir's flock) for `seconds`: as a fork
    child does that was made while its parent held it. Returns its pid."""
    import fcntl
    import time
    fd = os.open(paths.runtime_dir(), os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(0)
    os.close(fd)   # the child's copy keeps the lock, as a fork child's does
    return pid


def test_a_held_ledger_never_blocks_status_and_refuses_admission_by_its_deadline(sim_app):
    """F26: status is answered without the ledger's lock; an admission waits for it a few seconds at most, then
    refuses in one line naming the holder."""
    import signal
    import time
    app = sim_app("--sizes", "16M", env=_env())
    holder = _hold_runtime_dir_lock(60)
    try:
        t0 = time.monotonic()
        r = gpucr_cli("status", "--no-server", str(app.pid), timeout=20)
        assert r.returncode == 0 and time.monotonic() - t0 < 5, r.stdout + r.stderr
        t0 = time.monotonic()
        line = _refused(gpucr_cli("checkpoint", "--no-server", str(app.pid), timeout=30), "host-memory ledger")
        assert time.monotonic() - t0 < 15 and f"held by process {os.getpid()} (or a child it forked)" in line, line
        _untouched(app.pid)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    gpucr.checkpoint(app.pid)   # the holder gone, admission goes on
    gpucr.restore(app.pid)


def test_fork_children_made_during_admissions_and_status_keep_no_ledger_lock(sim_app):
    """F26: children forked while agent threads hold the ledger's lock (status asked in a loop, checkpoints and
    restores admitting staging) must not keep it: once the forks are done, nobody holds it while they live."""
    import threading
    import time
    app = sim_app("--sizes", "16M", env=_env())
    other = sim_app("--sizes", "16M", env=_env())
    stop = threading.Event()
    errors: list[str] = []

    def status_loop() -> None:
        while not stop.is_set():
            try:
                gpucr.status(app.pid)
            except gpucr.GpucrError as exc:   # blocked behind a lock a child keeps
                errors.append(str(exc))

    def cycle_loop() -> None:   # admissions: staging made and given back; the status loops never make one "busy"
        while not stop.is_set():
            try:
                gpucr.checkpoint(app.pid)
                gpucr.restore(app.pid, drop_staging=True)
            except gpucr.GpucrError as exc:
                errors.append(str(exc))

    loops = [threading.Thread(target=f, daemon=True) for f in (status_loop, status_loop, cycle_loop)]
    for t in loops:
        t.start()
    children = [app.ask("fork 90")["child"] for _ in range(150)]
    stop.set()
    for t in loops:
        t.join(30)
    try:
        assert errors == [], errors[:3]
        dev = os.stat(paths.runtime_dir())
        name = f"{os.major(dev.st_dev):02x}:{os.minor(dev.st_dev):02x}:{dev.st_ino}"
        held = [l for l in Path("/proc/locks").read_text().splitlines() if f" {name} " in l and "FLOCK" in l]
        assert held == [], f"the ledger's lock outlives every admission: {held}"
        t0 = time.monotonic()
        gpucr.checkpoint(other.pid)
        assert time.monotonic() - t0 < 5
        gpucr.restore(other.pid)
    finally:
        for c in children:
            os.kill(c, 9)
