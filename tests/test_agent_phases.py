"""The agent's process phases (issue 25: an explicit state per process, each transition checked in one function
that refuses an illegal one by name): running -> (quiesced) -> handed -> copied -> parked (-> on disk)
-> running; status says the phase, and a step that does not lead from the phase the process is in is refused,
naming both phases, with nothing touched."""
from __future__ import annotations

import pytest

import gpucr
from gpucr import paths
from gpucr.agent import AgentClient
from gpucr.errors import GpucrError
from gpucr.target import agent_socket_name


def agent(pid: int) -> AgentClient:
    return AgentClient(paths.runtime_dir() / agent_socket_name(pid), pid)


def phase(pid: int) -> str:
    with agent(pid) as a:
        return a.call("status")["phase"]


@pytest.mark.parametrize("verb,args,refusal", [
    ("handed_done", {}, "handed_done refused: the process is running, and handed_done does not lead from there to copied"),
    ("drop", {}, "drop refused: the process is running, and drop does not lead from there to on disk"),
    ("restore", {"open_gate": 0}, "restore refused: the process is running, and restore does not lead from there to running"),
    ("adopt", {"from": 0}, "adopt refused: the process is running, not parked"),
    ("abort", {}, "no checkpoint in progress to abort (the process is running)"),
])
def test_a_step_that_does_not_lead_from_the_phase_is_refused_by_name(sim_app, verb, args, refusal):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    with agent(app.pid) as a, pytest.raises(GpucrError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        a.call(verb, **args)
    assert phase(app.pid) == "running" and app.ask("digest") == before


def memory_states(a: AgentClient) -> dict[str, list[bool]]:
    """{state: [released...]} of the allocations the agent lists (its first page; our fds of them closed at once)."""
    import os
    listed, fds = a.call_with_fds("memory", **{"from": 0})
    for fd in fds:
        os.close(fd)
    out: dict[str, list[bool]] = {}
    for e in listed["memory"]:
        if e["movable"] or e["released"]:
            out.setdefault(e["state"], []).append(e["released"])
    return out


def allocation_states(pid: int) -> set[str]:
    with agent(pid) as a:
        return set(memory_states(a))


def test_each_allocation_is_live_handed_then_parked_and_live_again(sim_app):
    app = sim_app("--sizes", "8M,4M", "--vmm-mib", "4")
    before = app.ask("digest")
    assert allocation_states(app.pid) == {"live"}
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)   # staging made by the data plane, kept: a bare handover has its places
    with agent(app.pid) as a:
        a.call("handover", lease=0)
        states = memory_states(a)
        assert list(states) == ["handed"] and all(states["handed"]), states
        a.call("abort")   # nothing left the GPU: mapped again from the agent's fds
    assert allocation_states(app.pid) == {"live"} and app.ask("digest") == before
    gpucr.checkpoint(app.pid)
    assert allocation_states(app.pid) == {"parked"}
    gpucr.restore(app.pid)
    assert allocation_states(app.pid) == {"live"} and app.ask("digest") == before


def test_status_follows_the_phases_of_a_cycle_and_an_image(sim_app, tmp_path):
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    assert phase(app.pid) == "running"
    gpucr.checkpoint(app.pid)
    assert phase(app.pid) == "parked"
    with agent(app.pid) as a, pytest.raises(GpucrError, match="handover refused: the process is parked"):
        a.call("handover", lease=0)
    gpucr.restore(app.pid)
    assert phase(app.pid) == "running"
    gpucr.checkpoint(app.pid, image=tmp_path / "img")
    assert phase(app.pid) == "on disk"
    # on disk, the image is filled straight into new memory: a restore before every allocation is adopted is refused
    with agent(app.pid) as a, pytest.raises(GpucrError, match="were not brought back by gpucr's data plane"):
        a.call("restore", open_gate=0)
    assert phase(app.pid) == "on disk"
    gpucr.restore(app.pid, image=tmp_path / "img")
    assert phase(app.pid) == "running" and app.ask("digest") == before
