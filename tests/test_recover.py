"""F25 (issue 24): `gpucr recover` finds processes under gpucr in their own verified runtime dirs (every user's,
for root), never has the driver alone bring back a process that has an agent, and leaves checkpoints made on
purpose alone unless asked (--all)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpucr import paths
from gpucr.results import RecoverResult, from_json

from conftest import gpucr_cli
from test_security import SYS_PY, as_user, user_cli, user_dir, user_env, users  # noqa: F401 (a fixture)


def _recover(*args: str, env: dict[str, str] | None = None) -> RecoverResult:
    r = gpucr_cli("recover", "--json", *args, env={**(env or os.environ), "GPUCR_NO_SERVER": "1"})
    assert r.stdout, r.stderr
    return from_json(RecoverResult, json.loads(r.stdout))


def test_roots_recover_finds_another_users_process_in_that_users_dir(users):
    """A victim's process, left checkpointed by the driver when the victim's controller was killed, in the
    victim's own runtime dir: root's recover lists it as under gpucr, from root's own runtime dir."""
    victim = users["victim"]
    rt, sim = user_dir(victim), user_dir(victim)
    env = user_env(victim, GPUCR_RUNTIME_DIR=str(rt), SIMCUDA_DIR=str(sim), GPUCR_NO_SERVER="1")
    app = as_user(victim, [SYS_PY, "-m", "gpucr.workloads.driver_app", "--sizes", "8M"],
                  paths.run_env(simulate=True, base=env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(app.stdout.readline())["ready"]
        # one driver for the machine, as on a GPU host: root's simcuda sees the victim's process
        os.symlink(sim / f"{app.pid}.ctl", Path(os.environ["SIMCUDA_DIR"]) / f"{app.pid}.ctl")
        killed = user_cli(victim, {**env, "GPUCR_TEST_KILL_AT": "after-driver-checkpoint"}, "checkpoint", str(app.pid))
        assert killed.returncode != 0
        found = [s for s in _recover("--list").processes if s.pid == app.pid]
        assert len(found) == 1 and found[0].under_gpucr, found
    finally:
        app.kill()
        app.wait()
        shutil.rmtree(rt, ignore_errors=True)
        shutil.rmtree(sim, ignore_errors=True)


def test_recover_from_another_dir_never_uses_the_driver_alone_and_leaves_a_checkpoint_made_on_purpose(sim_app, tmp_path):
    """A process checkpointed on purpose (level full), recover run with another runtime dir: without --all it is
    left alone; with --all it is restored through its agent (the driver alone left its gate closed: frozen)."""
    import gpucr
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    env = {**os.environ, "GPUCR_RUNTIME_DIR": str(other)}
    assert app.pid not in [s.pid for s in _recover("--list", env=env).processes], "made on purpose: not stuck"
    assert gpucr.status(app.pid).state == "checkpointed", "left alone"
    done = [s for s in _recover("--all", env=env).processes if s.pid == app.pid]
    assert len(done) == 1 and done[0].under_gpucr and done[0].ok, done
    st = gpucr.status(app.pid)
    assert st.state == "running" and not st.gate_closed, st
    assert app.ask("digest") == before


def test_recover_of_a_named_simcuda_process_takes_its_driver_as_checkpoint_and_restore_do(sim_app):
    """`gpucr recover --all PID` of a simcuda process, the controller not told --simulate, tried the system's driver
    (on a machine without one: 'cannot load the CUDA driver'), though a failed checkpoint's own advice names it."""
    import gpucr
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    env = {k: v for k, v in os.environ.items() if k != "GPUCR_SIMULATE"}
    done = [s for s in _recover("--all", str(app.pid), env=env).processes if s.pid == app.pid]
    assert len(done) == 1 and done[0].ok, done
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


@pytest.mark.parametrize("level", ["data", "full"])
def test_a_committed_checkpoint_says_so_and_recover_leaves_it_alone_at_every_level(sim_app, level):
    """The agent says `committed` for a checkpoint its controller committed, until a restore: recover (plain or
    --list) leaves such a process alone at either level; the restore clears it."""
    import gpucr
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    assert not gpucr.status(app.pid).committed, "nothing checkpointed yet"
    gpucr.checkpoint(app.pid, level=level)
    st = gpucr.status(app.pid)
    assert st.committed and st.level == level, st
    assert app.pid not in [s.pid for s in _recover("--list").processes]
    assert app.pid not in [s.pid for s in _recover().processes]
    assert gpucr.status(app.pid).state == "checkpointed", "left alone"
    gpucr.restore(app.pid)
    st = gpucr.status(app.pid)
    assert st.state == "running" and not st.committed, st
    assert app.ask("digest") == before


def _ask(app: subprocess.Popen, command: str) -> dict:
    app.stdin.write(command + "\n")
    app.stdin.flush()
    return json.loads(app.stdout.readline())


def _wait_for_server(uid: int, env: dict[str, str]) -> None:
    deadline = time.time() + 60
    while user_cli(uid, env, "serve", "--status", "--simulate").returncode != 0:
        assert time.time() < deadline, "the user's gpucr server did not start within 60 s"
        time.sleep(0.2)


@pytest.mark.serial   # its recover acts on every process of the victim user, whom other tests run as too
@pytest.mark.parametrize("via_server", [False, True], ids=["in-process", "server"])
def test_recover_brings_back_a_committed_checkpoint_whose_restore_died_after_the_driver_let_go(users, via_server):
    """A committed level-full checkpoint, then its restore's controller (or the server doing it) killed after the
    driver's restore and unlock: the driver runs the process, its agent is checkpointed with the gate closed. That is
    no checkpoint parked on purpose: status says not committed, and recover lists it and brings it back, data intact.
    Run as a user of its own: root's recover acts on every process of the machine."""
    victim = users["victim"]
    rt, sim = user_dir(victim), user_dir(victim)
    env = user_env(victim, GPUCR_RUNTIME_DIR=str(rt), SIMCUDA_DIR=str(sim))
    if not via_server:
        env["GPUCR_NO_SERVER"] = "1"
    srv = as_user(victim, [SYS_PY, "-m", "gpucr.cli", "serve", "--simulate"], env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if via_server else None
    app = as_user(victim, [SYS_PY, "-m", "gpucr.workloads.driver_app", "--sizes", "8M"],
                  paths.run_env(simulate=True, base=env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(app.stdout.readline())["ready"]
        before = _ask(app, "digest")
        if srv is not None:
            _wait_for_server(victim, env)
        assert user_cli(victim, env, "checkpoint", "--level", "full", str(app.pid)).returncode == 0
        killed = user_cli(victim, {**env, "GPUCR_TEST_KILL_AT": "after-driver-unlock"}, "restore", str(app.pid))
        assert killed.returncode != 0 and (not via_server or "gpucr server" in killed.stderr), killed.stderr
        st = json.loads(user_cli(victim, env, "status", "--json", str(app.pid)).stdout)["processes"][0]
        assert (st["state"], st["driver_state"], st["gate_closed"], st["committed"]) == \
            ("checkpointed", "running", True, False), st
        found = json.loads(user_cli(victim, env, "recover", "--list", "--json").stdout)["processes"]
        assert [s["pid"] for s in found] == [app.pid], found
        done = json.loads(user_cli(victim, env, "recover", "--json").stdout)["processes"]
        assert [(s["pid"], s["ok"]) for s in done] == [(app.pid, True)], done
        assert _ask(app, "digest") == before
    finally:
        for p in (app, srv):
            if p is not None:
                p.kill()
                p.wait()
        shutil.rmtree(rt, ignore_errors=True)
        shutil.rmtree(sim, ignore_errors=True)


def test_a_restore_step_leaves_a_committed_checkpoint_stuck(sim_app):
    """The server's restore maps new memory with `adopt` before the agent's restore: once that (or any restore step)
    has come, a controller that dies leaves the process half restored. The agent no longer says `committed`, so
    recover lists it (at level data the driver state alone cannot tell)."""
    import gpucr
    from gpucr import target as targets
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid, level="data")
    assert gpucr.status(app.pid).committed
    with targets.resolve(app.pid).connect() as agent:
        agent.call("adopt", timeout=10.0, **{"from": 0})   # no memory with it: the step alone
    st = gpucr.status(app.pid)
    assert st.state == "checkpointed" and st.gate_closed and not st.committed, st
    assert app.pid in [s.pid for s in _recover("--list").processes]
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
