"""Several processes checkpointed together on simcuda: all or nothing at checkpoint, every process
that can be restored is, and every failure names the process and the phase."""
from __future__ import annotations

import json
import os

import pytest

import gpucr
from gpucr.coordinator import checkpoint_many, restore_many
from gpucr.driver import ProcessState, gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20


def used() -> int:
    return gpu_memory(sim_driver()).used


def start_group(sim_app, n: int, group: str = "g", extra: dict[int, dict[str, str]] | None = None):
    apps = []
    for i in range(n):
        env = dict(os.environ, GPUCR_GROUP=group, **(extra or {}).get(i, {}))
        apps.append(sim_app("--sizes", f"{16 + 8 * i}M,2M", "--vmm-mib", "4", "--seed", str(i), env=env))
    return apps, [a.ask("digest") for a in apps]


def test_group_checkpoint_and_restore_from_the_cli(sim_app):
    idle = used()
    apps, before = start_group(sim_app, 3)
    ps = json.loads(gpucr_cli("ps", "--json").stdout)["processes"]
    assert sorted(r["pid"] for r in ps if r["group"] == "g") == sorted(a.pid for a in apps)
    r = gpucr_cli("checkpoint", "--group", "g")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("checkpointed (level full)") == 3
    assert used() == idle, "every process's memory is given back"
    r = gpucr_cli("restore", "--group", "g")
    assert r.returncode == 0, r.stderr
    assert [a.ask("digest") for a in apps] == before
    one_line = gpucr_cli("checkpoint", "--group", "nosuch")
    assert one_line.returncode != 0 and "no process of group 'nosuch'" in one_line.stderr


def test_a_process_that_dies_during_data_out_rolls_everyone_back(sim_app, monkeypatch):
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


def test_a_process_missing_the_lock_deadline_rolls_everyone_back(sim_app):
    apps, before = start_group(sim_app, 3, extra={2: {"SIMCUDA_FAIL_LOCK": "1"}})
    with pytest.raises(gpucr.GpucrError, match=f"process {apps[2].pid} failed at driver lock"):
        checkpoint_many([a.pid for a in apps], timeout=2)
    for a, b in zip(apps, before):
        assert gpucr.status(a.pid).state == "running"
        assert sim_driver().state(a.pid) == ProcessState.RUNNING
        assert a.ask("digest") == b
    checkpoint_many([a.pid for a in apps])   # the lock succeeds the next time
    restore_many([a.pid for a in apps])
    assert [a.ask("digest") for a in apps] == before


def test_a_process_failing_at_restore_stays_checkpointed_others_run(sim_app):
    apps, before = start_group(sim_app, 3, extra={0: {"SIMCUDA_FAIL_RESTORE": "1"}})
    checkpoint_many([a.pid for a in apps])
    with pytest.raises(gpucr.GpucrError, match=f"process {apps[0].pid} failed at driver restore.*were restored and run"):
        restore_many([a.pid for a in apps])
    assert gpucr.status(apps[0].pid).state == "checkpointed"
    for a, b in zip(apps[1:], before[1:]):
        assert gpucr.status(a.pid).state == "running" and a.ask("digest") == b
    gpucr.restore(apps[0].pid)   # and it is restorable
    assert apps[0].ask("digest") == before[0]


def test_group_images(sim_app, tmp_path):
    apps, before = start_group(sim_app, 2)
    r = gpucr_cli("checkpoint", "--group", "g", "--image", str(tmp_path / "imgs"))
    assert r.returncode == 0, r.stderr
    for a in apps:
        assert (tmp_path / "imgs" / str(a.pid) / "manifest.json").exists()
    r = gpucr_cli("restore", "--group", "g", "--image", str(tmp_path / "imgs"))
    assert r.returncode == 0, r.stderr
    assert [a.ask("digest") for a in apps] == before
