"""One schema for every result (gpucr.results, docs/api.md), on simcuda: the Python API returns its
dataclasses; every command's --json prints the same envelope for one process or several, and reads
back strictly (same keys, same types) with from_json; units are those the field names say; the GPU
memory reported per process is that process's own, apart from the whole GPU's."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest

import gpucr
from gpucr import results as R
from gpucr.driver import gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20
T = TypeVar("T")


def cli_json(cls: type[T], *args: str) -> T:
    """A command's --json, parsed strictly into its result type."""
    r = gpucr_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    out = R.from_json(cls, json.loads(r.stdout))   # raises on a missing or unknown key, or a wrong type
    assert out.schema_version == R.SCHEMA_VERSION
    return out


def used() -> int:
    return gpu_memory(sim_driver()).used


def start(sim_app, n: int, group: str | None = None) -> list:
    env = dict(os.environ, GPUCR_GROUP=group) if group else None
    return [sim_app("--sizes", f"{16 + 8 * i}M,3M", "--seed", str(i), env=env) for i in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_checkpoint_and_restore_print_one_shape_for_any_number_of_processes(sim_app, n):
    apps = start(sim_app, n)
    pids = [str(a.pid) for a in apps]
    before = [a.ask("digest") for a in apps]
    ck = cli_json(R.CheckpointResult, "checkpoint", *pids)
    assert ck.command == "checkpoint" and [p.pid for p in ck.processes] == [a.pid for a in apps]
    # no server: the CLI's own mover copies them, one process or a group
    plane = "cli"
    for p in ck.processes:
        assert p.state == "checkpointed" and p.level == "full" and p.image is None and p.bytes_moved >= 16 * MiB
        assert p.data_plane == plane and 0 < p.phases_s["data_out"] < 30
        [g] = p.gpus
        assert g.process_before_bytes >= p.bytes_moved and g.process_after_bytes == 0, "level full gives it all back"
    rs = cli_json(R.RestoreResult, "restore", *pids)
    assert rs.command == "restore" and [p.pid for p in rs.processes] == [a.pid for a in apps]
    for p, c in zip(rs.processes, ck.processes):
        assert p.state == "running" and p.bytes_moved == c.bytes_moved and p.moved == {} and p.data_plane == plane
        assert 0 < p.phases_s["data_in"] < 30
        [g] = p.gpus
        assert g.process_before_bytes == 0 and g.process_after_bytes == c.gpus[0].process_before_bytes
    assert [a.ask("digest") for a in apps] == before


@pytest.mark.parametrize("n", [1, 2])
def test_group_checkpoint_and_restore_print_the_same_shape(sim_app, n):
    apps = start(sim_app, n, group="shape")
    ck = cli_json(R.CheckpointResult, "checkpoint", "--group", "shape")
    assert sorted(p.pid for p in ck.processes) == sorted(a.pid for a in apps) and ck.left_out == []
    rs = cli_json(R.RestoreResult, "restore", "--group", "shape")
    assert sorted(p.pid for p in rs.processes) == sorted(a.pid for a in apps)


def test_status_and_ps_print_the_same_shape_for_one_and_for_all(sim_app):
    apps = start(sim_app, 3)
    one = cli_json(R.StatusResult, "status", str(apps[0].pid))
    assert one.command == "status" and [p.pid for p in one.processes] == [apps[0].pid] and one.unreachable == []
    every = cli_json(R.StatusResult, "status")
    listed = cli_json(R.StatusResult, "ps")
    assert every.command == "status" and listed.command == "ps"
    assert sorted(p.pid for p in every.processes) == sorted(p.pid for p in listed.processes) == sorted(a.pid for a in apps)
    gpucr.checkpoint(apps[1].pid, level="data")
    st = cli_json(R.StatusResult, "status", str(apps[1].pid)).processes[0]
    assert st.state == "checkpointed" and st.level == "data" and st.certificate["id"] == "live"
    assert st.last_cycle.release_s < 30 and st.last_cycle.bytes_out >= 24 * MiB, "seconds, and bytes"
    gpucr.restore(apps[1].pid)


def test_ps_lists_a_stopped_process_as_unreachable_at_once(sim_app):
    """Issue 14 item 1: ps took 5.3 s with one process stopped; it names it at once, apart."""
    import signal
    import time
    stopped, running = start(sim_app, 2)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        listed = cli_json(R.StatusResult, "ps")
        assert time.monotonic() - t0 < 3
        assert [p.pid for p in listed.processes] == [running.pid]
        [u] = listed.unreachable
        assert u.pid == stopped.pid and "stopped (SIGSTOP)" in u.error, u
        line = next(l for l in gpucr_cli("ps").stdout.splitlines() if l.split()[0] == str(stopped.pid))
        assert "unreachable" in line and "stopped" in line, line
    finally:
        os.kill(stopped.pid, signal.SIGCONT)


@pytest.mark.parametrize("n", [1, 2])
def test_recover_prints_the_same_shape_listed_or_done(sim_app, n):
    apps = start(sim_app, n)
    for a in apps:
        gpucr.checkpoint(a.pid, level="data")   # checkpointed on purpose: recover takes it only with --all
    # named: with --all, root's recover would take any process of the machine checkpointed on purpose
    pids = [str(a.pid) for a in apps]
    assert cli_json(R.RecoverResult, "recover", "--all", "--list", pids[0]).processes[0].pid == apps[0].pid
    listed = cli_json(R.RecoverResult, "recover", "--all", "--list", *pids)
    assert listed.command == "recover" and listed.listed_only
    assert sorted(s.pid for s in listed.processes) == sorted(a.pid for a in apps)
    assert cli_json(R.RecoverResult, "recover", "--list", *pids).processes == [], "checkpointed on purpose: left alone"
    done = cli_json(R.RecoverResult, "recover", "--all", *pids)
    assert not done.listed_only and all(s.ok for s in done.processes) and len(done.processes) == n
    assert cli_json(R.RecoverResult, "recover", "--all", "--list", *pids).processes == []


def test_gpu_memory_is_the_process_own_apart_from_the_whole_gpu(sim_app):
    idle = used()
    small, big = sim_app("--sizes", "16M"), sim_app("--sizes", "64M,32M")
    s, b = gpucr.status(small.pid).gpus[0], gpucr.status(big.pid).gpus[0]
    # a process's own: its data and its context (the same size in both, as the driver's would be)
    assert s.process_bytes >= s.vmm_bytes == 16 * MiB and b.process_bytes - s.process_bytes == 80 * MiB
    assert s.gpu_used_bytes == b.gpu_used_bytes == idle + s.process_bytes + b.process_bytes
    assert s.uuid == b.uuid and s.gpu_total_bytes == 4 << 30
    ck = gpucr.checkpoint(small.pid)
    [g] = ck.gpus
    assert (g.process_before_bytes, g.process_after_bytes) == (s.process_bytes, 0)
    assert g.gpu_used_before_bytes - g.gpu_used_after_bytes == s.process_bytes, "only this process's memory went"
    assert g.gpu_used_after_bytes == idle + b.process_bytes
    out = gpucr_cli("status", str(small.pid)).stdout
    assert f"this process 0 MiB, GPU used {(idle + b.process_bytes) / MiB:,.0f} MiB" in out, out
    gpucr.restore(small.pid)


def test_python_api_returns_the_dataclasses(sim_app):
    a, b = start(sim_app, 2)
    assert isinstance(gpucr.status(a.pid), R.ProcessStatus)
    listed = gpucr.ps()
    assert isinstance(listed, R.StatusResult) and all(isinstance(p, R.ProcessStatus) for p in listed.processes)
    assert isinstance(gpucr.checkpoint(a.pid), R.ProcessCheckpoint)
    assert isinstance(gpucr.restore(a.pid), R.ProcessRestore)
    many = gpucr.checkpoint_many([a.pid, b.pid])
    assert isinstance(many, R.CheckpointResult) and [p.pid for p in many.processes] == [a.pid, b.pid]
    back = gpucr.restore_many([a.pid, b.pid])
    assert isinstance(back, R.RestoreResult)
    # the JSON of an API result is the CLI's, and reads back equal
    assert R.from_json(R.RestoreResult, json.loads(json.dumps(R.to_json(back)))) == back


# The API in a controller of its own: simcuda reads its number of GPUs once, when this test
# process's driver started (with one).
_MAP_SCRIPT = """
import json, sys
import gpucr
pid, u0, u1 = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ck = gpucr.checkpoint(pid)
refused = []
for bad in ({u0: "not-a-gpu"}, {u0: u1}):
    try:
        gpucr.restore(pid, gpu_map=bad)
    except gpucr.GpucrError as exc:
        refused.append(str(exc))
state = gpucr.status(pid).state
rs = gpucr.restore(pid, gpu_map={u0.lower(): u1.removeprefix("GPU-"), u1: u0})   # any spelling, as --map
print(json.dumps({"ck": gpucr.to_json(ck), "refused": refused, "state": state, "rs": gpucr.to_json(rs),
                  "type": type(rs).__name__}))
"""


def test_restore_through_the_api_takes_a_gpu_map(sim_app):
    env = dict(os.environ, SIMCUDA_DEVICES="2")
    app = sim_app("--sizes", "16M", env=env)
    app.ask("device 1 40M")
    u0, u1 = app.ask("uuids")["uuids"]
    before = app.ask("digest")
    r = subprocess.run([sys.executable, "-c", _MAP_SCRIPT, str(app.pid), u0, u1], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ck, rs = R.from_json(R.ProcessCheckpoint, out["ck"]), R.from_json(R.ProcessRestore, out["rs"])
    assert out["type"] == "ProcessRestore"
    assert "OLD_UUID=NEW_UUID" in out["refused"][0] and f"was checkpointed on {u1}" in out["refused"][1]
    assert out["state"] == "checkpointed", "a refused map touches nothing"
    assert rs.moved == {u0: u1, u1: u0}
    assert app.ask("uuids")["uuids"] == [u1, u0] and app.ask("digest") == before
    held = {g.uuid: g.process_before_bytes for g in ck.gpus}
    assert {g.uuid: g.process_after_bytes for g in rs.gpus} == {u0: held[u1], u1: held[u0]}, \
        "each card holds what the other held"


def test_demo_json_carries_the_results_in_the_schema():
    r = gpucr_cli("demo", "--simulate", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["schema_version"], d["command"], d["simulated"]) == (R.SCHEMA_VERSION, "demo", True)
    ck, rs = R.from_json(R.ProcessCheckpoint, d["checkpoint"]), R.from_json(R.ProcessRestore, d["restore"])
    assert ck.pid == rs.pid and all(d["checks"].values())
    assert d["gpu_used_checkpointed_bytes"] < d["gpu_used_running_bytes"] == d["gpu_used_restored_bytes"]


def test_from_json_refuses_what_is_not_the_schema():
    good = R.to_json(R.RecoverResult(R.SCHEMA_VERSION, "recover", True, [R.Stuck(1, "x", "parked", True)]))
    assert R.from_json(R.RecoverResult, good).processes[0].pid == 1
    for bad, why in (({**good, "extra": 1}, "unknown extra"),
                     ({k: v for k, v in good.items() if k != "command"}, "missing command"),
                     ({**good, "listed_only": 1}, "listed_only: bool expected"),
                     ({**good, "processes": [{**good["processes"][0], "pid": True}]}, r"processes\[0\].pid: int expected")):
        with pytest.raises(ValueError, match=why):
            R.from_json(R.RecoverResult, bad)


def _classes() -> list[type]:
    return [c for c in vars(R).values() if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == R.__name__]


def _type_text(t: object) -> str:
    """A type as the docs write it: int, str | None, list[GpuStatus]."""
    return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "").replace(f"{R.__name__}.", "")


def test_docs_list_every_field_with_its_type():
    """docs/api.md has a table per result class whose rows are exactly its fields, with their types."""
    import typing
    doc = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    for cls in _classes():
        section = doc.split(f"### {cls.__name__}\n", 1)
        assert len(section) == 2, f"docs/api.md has no section for {cls.__name__}"
        rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section[1].split("\n### ", 1)[0], re.M)
        hints = typing.get_type_hints(cls)
        want = [(f.name, _type_text(hints[f.name])) for f in dataclasses.fields(cls)]
        assert [(n, t.replace("\\|", "|")) for n, t in rows] == want, cls.__name__
