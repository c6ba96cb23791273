"""Bad input: one clear line, a non-zero exit, and the target untouched."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import gpucr
from gpucr import paths
from gpucr import target as targets

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20


def one_line_error(r: subprocess.CompletedProcess, pattern: str) -> None:
    assert r.returncode != 0, r
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpucr: error: ") and pattern in lines[0], lines[0]


def test_pid_that_does_not_exist():
    one_line_error(gpucr_cli("checkpoint", "999999999"), "no process with pid 999999999")
    one_line_error(gpucr_cli("restore", "999999999"), "no process with pid")
    one_line_error(gpucr_cli("status", "999999999"), "no process with pid")


def test_a_bad_pid_beside_a_good_one_is_named_whichever_driver_the_controller_took(sim_app):
    """`gpucr checkpoint P BAD` (P on simcuda, the controller not told so) said the system's driver could not be
    loaded, where one process was fine and the other is not one gpucr can act on: the bad one is named now."""
    app = sim_app("--sizes", "4M")
    env = {k: v for k, v in os.environ.items() if k != "GPUCR_SIMULATE"}
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        one_line_error(gpucr_cli("checkpoint", str(app.pid), "999999999", env=env), "no process with pid 999999999")
        one_line_error(gpucr_cli("checkpoint", str(app.pid), str(sleeper.pid), env=env), "not running under gpucr")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert gpucr_cli("status", str(app.pid), env=env).returncode == 0


def test_two_restores_at_once_one_restores_and_the_other_says_there_is_nothing_left(sim_app):
    """The loser of two `gpucr restore P` at once said it failed at a driver step and to retry, while the process ran
    restored (found from outside: 2-3 rounds in 5)."""
    app = sim_app("--sizes", "8M,3M")
    before = app.ask("digest")
    for _ in range(3):
        assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _i: gpucr_cli("restore", str(app.pid)), range(2)))
        assert sorted(r.returncode for r in got) == [0, 1], got
        lost = next(r for r in got if r.returncode)
        one_line_error(lost, "")
        assert "is not checkpointed" in lost.stderr or "restored by another controller meanwhile" in lost.stderr, \
            lost.stderr
        assert app.ask("digest") == before


def test_process_not_under_gpucr():
    p = subprocess.Popen(["sleep", "30"])
    try:
        one_line_error(gpucr_cli("checkpoint", str(p.pid)), "not running under gpucr")
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_non_cuda_process_under_gpucr():
    p = subprocess.Popen(["sleep", "30"], env=paths.run_env(simulate=True))
    try:
        sock = paths.runtime_dir() / targets.agent_socket_name(p.pid)
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        one_line_error(gpucr_cli("checkpoint", str(p.pid)), "has not loaded the CUDA driver")
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_checkpoint_twice_and_restore_running(sim_app):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    one_line_error(gpucr_cli("restore", str(app.pid)), "is not checkpointed")
    assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0
    one_line_error(gpucr_cli("checkpoint", str(app.pid)), "already checkpointed")
    one_line_error(gpucr_cli("checkpoint", "--level", "data", str(app.pid)), "already checkpointed")
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("digest") == before
    # data level: a second checkpoint is refused by the agent's state too
    assert gpucr_cli("checkpoint", "--level", "data", str(app.pid)).returncode == 0
    one_line_error(gpucr_cli("checkpoint", str(app.pid)), "already checkpointed")
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("digest") == before


def test_bad_arguments():
    r = gpucr_cli("checkpoint", "--timeout", "-1", str(os.getpid()))
    assert r.returncode != 0
    r = gpucr_cli("checkpoint", "notapid")
    assert r.returncode != 0 and "invalid int value" in r.stderr
    one_line_error(gpucr_cli("run"), "nothing to run")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process as another user")
def test_process_of_another_user(sim_app):
    app = sim_app("--sizes", "8M")   # owned by root
    before = app.ask("digest")
    env = dict(os.environ, HOME="/tmp", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = gpucr_cli("checkpoint", str(app.pid), env=env, user=65534)
    one_line_error(r, "belongs to user root")
    assert sim_driver().state(app.pid).name == "RUNNING"
    assert app.ask("digest") == before


def test_doctor_reports_and_advises():
    import json
    r = gpucr_cli("doctor", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == (1 if d["problems"] else 0), r.stderr   # 1: something gpucr needs is missing
    assert (d["schema_version"], d["command"]) == (gpucr.SCHEMA_VERSION, "doctor")
    for key in ("hugepages_free", "memlock_limit_bytes", "driver", "gpu", "problems", "advice"):
        assert key in d
    env = dict(os.environ, LD_LIBRARY_PATH=str(paths.simcuda_dir()))
    d = json.loads(gpucr_cli("doctor", "--json", env=env).stdout)
    assert d["driver"]["checkpoint_api"] is True and d["driver"]["simulated"] is True
    assert gpucr_cli("doctor", env=env).returncode == 0


def test_gpu_map_is_checked_before_anything_is_touched(sim_app):
    from gpucr.gpus import parse_map, to_bytes
    u1, u2 = "GPU-" + "11" * 4 + "-2222-3333-4444-" + "55" * 6, "GPU-" + "AA" * 16
    assert parse_map([f"{u1}={u2}"]) == {u1: "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"}
    assert to_bytes(u1) == bytes.fromhex("11" * 4 + "2222" + "3333" + "4444" + "55" * 6)
    one_line_error(gpucr_cli("restore", "--map", "GPU-12=oops", str(os.getpid())), "--map takes OLD_UUID=NEW_UUID")
    one_line_error(gpucr_cli("restore", "--map", f"{u1}={u2}", "--map", f"{u1}={u1}", str(os.getpid())),
                   "names GPU-11111111-2222-3333-4444-555555555555 twice")
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0
    mine = gpucr.status(app.pid).gpus
    assert [d.ordinal for d in mine] == [0] and mine[0].vmm_bytes >= 8 * MiB
    here = mine[0].uuid
    # a map that misses the process's GPU, or points at a GPU this machine lacks: refused, still checkpointed
    one_line_error(gpucr_cli("restore", "--map", f"{u1}={u2}", str(app.pid)), f"was checkpointed on {here}")
    one_line_error(gpucr_cli("restore", "--map", f"{here}={u2}", str(app.pid)), "is not a GPU of this machine")
    assert gpucr.status(app.pid).state == "checkpointed"
    # the identity map is a map like any other: the driver gets one pair and restores in place
    assert gpucr_cli("restore", "--map", f"{here}={here}", str(app.pid)).returncode == 0
    assert app.ask("digest") == before
    # --map on a process whose context stayed on the GPU (level data) is refused
    assert gpucr_cli("checkpoint", "--level", "data", str(app.pid)).returncode == 0
    one_line_error(gpucr_cli("restore", "--map", f"{here}={here}", str(app.pid)), "applies only to a restore of a --level full")
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("digest") == before


def test_bad_timeouts_and_image_dirs_touch_nothing(sim_app, tmp_path):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    # refused as given, before the process is gated (0.0001 and 1e9 used to fail after, at the agent's word)
    for t in ("nan", "inf", "0", "-3", "0.0001", "1e9"):
        one_line_error(gpucr_cli("checkpoint", "--timeout", t, str(app.pid)), "timeout must be a number of seconds")
    one_line_error(gpucr_cli("checkpoint", "--image", "", str(app.pid)), "the image directory is empty")
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(gpucr_cli("checkpoint", "--image", str(afile), str(app.pid)), "is not a directory")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    one_line_error(gpucr_cli("checkpoint", "--image", str(full), str(app.pid)), "is not empty")
    one_line_error(gpucr_cli("status", "0"), "0 is not a process id")
    assert gpucr_cli("status", str(app.pid)).returncode == 0
    assert app.ask("digest") == before
    from gpucr.driver import ProcessState
    assert sim_driver().state(app.pid) == ProcessState.RUNNING


def test_a_process_the_driver_will_not_lock_is_told_what_to_do(sim_app, monkeypatch):
    """On the H200 the driver refuses to lock a process run under compute-sanitizer (CUDA error 801): the
    checkpoint fails in one error that names the cause and the way out (`--level data`), rolled back, and
    the data level then cycles it."""
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    drv = sim_driver()
    monkeypatch.setattr(drv._cu, "cuCheckpointProcessLock", lambda pid, args: 801)
    with pytest.raises(gpucr.GpucrError, match=r"CUDA error 801\); the driver does not checkpoint a process run under a "
                                                r"CUDA tool such as compute-sanitizer.*`--level data`"):
        gpucr.checkpoint(app.pid, timeout=30)
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before
    assert gpucr.checkpoint(app.pid, level="data", timeout=30).bytes_moved >= 8 * MiB
    gpucr.restore(app.pid, timeout=30)
    assert app.ask("digest") == before
