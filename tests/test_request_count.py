"""How many requests a checkpoint and a restore ask of the agent, in-process and through a gpucr server
(issue 25, "pins while moving"): each is a round trip into the application, and no move of the data plane
may add one. The agent counts the requests it served and says so in `status` (requests_served)."""
from __future__ import annotations

from typing import Callable


import gpucr
from gpucr import paths
from gpucr.agent import AgentClient
from gpucr.server.route import NO_SERVER_ENV
from gpucr.target import agent_socket_name

# Today's counts (2026-12-03) for one process of two allocations. A move may lower them, never raise
# them: no move may add a round trip; lower the cap with the move that saves one. Through the server, a
# restore asks one `adopt` per 64 allocations (the server makes the memory, the agent maps it); with
# `gpucr serve --give-back-context` it asks none and takes 9 (ARCHITECTURE.md's 11 / 9). In-process (no server)
# the same mover runs in the requesting process since issue 25, with the server's protocol: its counts are the
# server's (the agent's own plane took 7 / 7, with its copy engine inside the application).
# Lowered with the in-process copy engine's deletion: a checkpoint no longer lists the memory first to choose a
# plane (the agent's handover refuses what the plane cannot take), 11 -> 10.
IN_PROCESS = {"checkpoint": 10, "restore": 10}
THROUGH_SERVER = {"checkpoint": 10, "restore": 10}
CYCLES = 3


def served(pid: int) -> int:
    """The agent's count of requests served, this status request among them."""
    with AgentClient(paths.runtime_dir() / agent_socket_name(pid), pid) as agent:
        return agent.call("status")["requests_served"]


def requests_of(pid: int, step: Callable[[int], object]) -> int:
    """The agent requests `step` took: those between two status requests, the second not counted."""
    before = served(pid)
    step(pid)
    return served(pid) - before - 1


def fewest_requests(pid: int) -> dict[str, int]:
    """Per step, the fewest requests over CYCLES cycles. Pollers that run on a clock (the controller's
    progress watch, every second once an answer is 0.25 s late; the server's pin-ahead round, every second)
    can only add requests to a cycle they happen to fall in, while a round trip the protocol adds is in
    every cycle: the fewest is the protocol's own count."""
    counts: dict[str, list[int]] = {"checkpoint": [], "restore": []}
    for _ in range(CYCLES):
        counts["checkpoint"].append(requests_of(pid, lambda p: gpucr.checkpoint(p, timeout=10)))
        counts["restore"].append(requests_of(pid, lambda p: gpucr.restore(p, timeout=10)))
    return {step: min(n) for step, n in counts.items()}


def check_caps(got: dict[str, int], caps: dict[str, int], path: str) -> None:
    over = {step: f"{got[step]} > {cap}" for step, cap in caps.items() if got[step] > cap}
    assert not over, (f"{path}: more agent requests than today's ({over}); a move may not add a round trip. "
                      f"If the new one is needed, raise the cap in {__name__}.py and say why in the commit")


def test_each_request_counts_once(sim_app):
    app = sim_app("--sizes", "1M")
    first = served(app.pid)
    with AgentClient(paths.runtime_dir() / agent_socket_name(app.pid), app.pid) as agent:
        agent.call("hello")
    assert served(app.pid) == first + 2, "the hello and this status"


def test_in_process_cycle_keeps_to_its_requests(sim_app, monkeypatch):
    monkeypatch.setenv(NO_SERVER_ENV, "1")
    app = sim_app("--sizes", "8M,1M")
    check_caps(fewest_requests(app.pid), IN_PROCESS, "in-process")


def test_cycle_through_the_server_keeps_to_its_requests(sim_app, server):
    app = sim_app("--sizes", "8M,1M")
    before = server.requests()
    got = fewest_requests(app.pid)
    assert server.requests() - before == 2 * CYCLES, "every checkpoint and restore went through the server"
    check_caps(got, THROUGH_SERVER, "through the server")
