"""Several processes checkpointed together on simcuda: all or nothing at checkpoint, every process
that can be restored is, and every failure names the process and the phase. Each test runs through the
gpucr server's data plane and through the agents' own (the `plane` fixture)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

import gpucr
from gpucr import checkpoint_many, restore_many   # through the module's gpucr server when one runs
from gpucr.driver import ProcessState, gpu_memory, process_gpu_memory

from conftest import gpucr_cli, moved_by, server_gpu_bytes, sim_driver

MiB = 1 << 20


def used() -> int:
    """The simulated GPU's memory in use, apart from the gpucr server's own context."""
    return gpu_memory(sim_driver()).used - server_gpu_bytes()


def start_group(sim_app, n: int, group: str = "g", extra: dict[int, dict[str, str]] | None = None):
    apps = []
    for i in range(n):
        env = dict(os.environ, GPUCR_GROUP=group, **(extra or {}).get(i, {}))
        apps.append(sim_app("--sizes", f"{16 + 8 * i}M,2M", "--vmm-mib", "4", "--seed", str(i), env=env))
    return apps, [a.ask("digest") for a in apps]


def test_group_checkpoint_and_restore_from_the_cli(plane, sim_app):
    idle = used()
    apps, before = start_group(sim_app, 3)
    ps = json.loads(gpucr_cli("ps", "--json").stdout)["processes"]
    assert sorted(r["pid"] for r in ps if r["group"] == "g") == sorted(a.pid for a in apps)
    r = gpucr_cli("checkpoint", "--group", "g")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("checkpointed (level full)") == 3
    assert used() == idle, "every process's memory is given back"
    r = gpucr_cli("restore", "--group", "g", "--json")
    assert r.returncode == 0, r.stderr
    assert [p["data_plane"] for p in json.loads(r.stdout)["processes"]] == [plane] * 3
    assert [a.ask("digest") for a in apps] == before   # every byte, at its old address (ptrs)
    one_line = gpucr_cli("checkpoint", "--group", "nosuch")
    assert one_line.returncode != 0 and "no process of group 'nosuch'" in one_line.stderr


def test_a_process_that_dies_during_data_out_rolls_everyone_back(plane, sim_app, monkeypatch):
    apps, before = start_group(sim_app, 3)
    victim = apps[1]
    monkeypatch.setenv("GPUCR_TEST_KILL_TARGET", f"data-out:{victim.pid}")
    with pytest.raises(gpucr.GpucrError, match=f"process {victim.pid} failed at data out.*2 of 3 processes run on \\(process {victim.pid} ended\\)"):
        checkpoint_many([a.pid for a in apps])
    for a, b in zip(apps, before):
        if a is victim:
            continue
        assert gpucr.status(a.pid).state == "running"
        assert sim_driver().state(a.pid) == ProcessState.RUNNING
        assert a.ask("digest") == b


def test_a_process_missing_the_lock_deadline_rolls_everyone_back(plane, sim_app):
    apps, before = start_group(sim_app, 3, extra={2: {"SIMCUDA_FAIL_LOCK": "1"}})
    with pytest.raises(gpucr.GpucrError, match=f"process {apps[2].pid} failed at driver lock"):
        checkpoint_many([a.pid for a in apps], timeout=2)
    for a, b in zip(apps, before):
        assert gpucr.status(a.pid).state == "running"
        assert sim_driver().state(a.pid) == ProcessState.RUNNING
        assert a.ask("digest") == b
    moved_by(plane, checkpoint_many([a.pid for a in apps]))   # the lock succeeds the next time
    moved_by(plane, restore_many([a.pid for a in apps]))
    assert [a.ask("digest") for a in apps] == before


def test_a_process_failing_at_restore_stays_checkpointed_others_run(plane, sim_app):
    apps, before = start_group(sim_app, 3, extra={0: {"SIMCUDA_FAIL_RESTORE": "1"}})
    full, first = used(), process_gpu_memory(sim_driver(), apps[0].pid, 0)
    moved_by(plane, checkpoint_many([a.pid for a in apps]))
    with pytest.raises(gpucr.GpucrError, match=f"process {apps[0].pid} failed at driver restore.*were restored and run"):
        restore_many([a.pid for a in apps])
    assert gpucr.status(apps[0].pid).state == "checkpointed"
    for a, b in zip(apps[1:], before[1:]):
        assert gpucr.status(a.pid).state == "running" and a.ask("digest") == b
    assert used() == full - first, "the memory the server made for the process the driver did not restore is gone"
    assert gpucr.restore(apps[0].pid).data_plane == plane   # and it is restorable
    assert apps[0].ask("digest") == before[0]


def test_group_images(plane, sim_app, tmp_path):
    apps, before = start_group(sim_app, 2)
    r = gpucr_cli("checkpoint", "--group", "g", "--image", str(tmp_path / "imgs"))
    assert r.returncode == 0, r.stderr
    for a in apps:
        assert (tmp_path / "imgs" / str(a.pid) / "manifest.json").exists()
    r = gpucr_cli("restore", "--group", "g", "--image", str(tmp_path / "imgs"))
    assert r.returncode == 0, r.stderr
    assert [a.ask("digest") for a in apps] == before


@pytest.mark.parametrize("point", ["after-handover", "during-server-copy", "after-driver-lock",
                                   "after-driver-checkpoint", "after-data-out"])
def test_a_server_killed_mid_group_leaves_every_process_with_its_data(reused_server, sim_app, point):
    """The server SIGKILLed at each step of a group's checkpoint through its data plane: until every
    process's copy is confirmed, each agent holds its memory on the GPU through its own fds, so each is
    taken back with no copy (its lease), or, once the driver holds it, by `gpucr recover`. Every process
    runs on with every byte at its old address."""
    apps, before = start_group(sim_app, 3)
    r = gpucr_cli("checkpoint", *(str(a.pid) for a in apps), env=dict(os.environ, GPUCR_TEST_KILL_AT=point))
    assert r.returncode != 0 and f"the gpucr server (pid {reused_server.pid}) died during 'checkpoint'" in r.stderr, r.stderr
    assert reused_server.proc.wait(timeout=30) == -signal.SIGKILL

    def settled(pid: int) -> bool:   # taken back by its lease, or held by the driver (its take-back waits for it)
        st = gpucr.status(pid)
        return sim_driver().state(pid) != ProcessState.RUNNING or (st.state == "running" and not st.busy)
    deadline = time.time() + 30
    while not all(settled(a.pid) for a in apps):
        assert time.time() < deadline, "the agents' own roll-back did not end"
        time.sleep(0.05)
    r = gpucr_cli("recover", *(str(a.pid) for a in apps), env=dict(os.environ, GPUCR_NO_SERVER="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    for a in apps:
        st = gpucr.status(a.pid)
        assert st.state == "running" and not st.gate_closed and st.checkpoint_phase == "", st
        assert sim_driver().state(a.pid) == ProcessState.RUNNING
    assert [a.ask("digest") for a in apps] == before
