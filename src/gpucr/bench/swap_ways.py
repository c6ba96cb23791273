"""The swap scenario's ways of switching, each a list of request records (swap_scenario reads them): gpucr's swap
service on the request stream, and beside it, with fewer switches each, (a) gpucr with the switch one-way by hand
(park, then resume), (b) what users do without gpucr (stop the server, start it again from its safetensors, wait
for its first token) and (c) the driver's own checkpoint (cuCheckpointProcess) doing the same switches."""
from __future__ import annotations

import importlib.util
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ..driver import Driver
from ..errors import GpucrError
from ..workloads.runner import Workload
from .methods import DriverMethod, JobFailed
from .swap_fleet import ASK_TIMEOUT_S, START_TIMEOUT_S, Fleet, Member, Shape, ask, switched

GPUCR, ONE_WAY, RESTART, DRIVER = "gpucr-swap", "gpucr-one-way", "restart-safetensors", "driver-checkpoint"
Say = Callable[[str], None]
Emit = Callable[[dict[str, Any]], None]
RECORD_WAIT_S = 10.0   # how long a request waits for the service to write down the resume made for it


def stream(names: list[str], n: int, zipf_share: float, zipf_s: float, seed: int) -> list[tuple[str, str]]:
    """(mix, server) of each request: round-robin first (with more servers than fit, each one's server is the one
    parked longest: a switch each), then the Zipf mix (seeded), server k drawn with weight 1/(k+1)^s."""
    rr = n - round(n * zipf_share)
    out = [("round-robin", names[i % len(names)]) for i in range(rr)]
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(names))]
    return out + [("zipf", rng.choices(names, weights)[0]) for _ in range(n - rr)]


def record(method: str, phase: str, server: str, t0: float, arrival: float, resident: bool, got: dict[str, Any],
           reference: list[int] | None, **extra: Any) -> dict[str, Any]:
    return {"method": method, "phase": phase, "server": server, "arrival_s": round(arrival - t0, 4),
            "resident": resident, "answered": True, "ttft_s": got["ttft_s"], "ttlt_s": got["ttlt_s"],
            "tokens": got["tokens"], "correct": reference is not None and got["tokens"] == reference, **extra}


def failed(method: str, phase: str, server: str, t0: float, arrival: float, resident: bool, exc: Exception) -> dict[str, Any]:
    return {"method": method, "phase": phase, "server": server, "arrival_s": round(arrival - t0, 4),
            "resident": resident, "answered": False, "error": f"{type(exc).__name__}: {exc}", "correct": False}


def references(method: str, m: Member, count: int, tokens: int, t0: float, emit: Emit) -> None:
    """`count` requests to a server just started, resident: the first one's tokens are its reference, and the
    times to first token are its resident ones (what a switch is set against)."""
    for _ in range(count):
        arrival = time.monotonic()
        got = ask(m.w, tokens, arrival)
        m.reference = m.reference or got["tokens"]
        m.resident_ttft.append(got["ttft_s"])
        m.last_request = time.monotonic()
        emit(record(method, "reference", m.name, t0, arrival, True, got, m.reference))


def _control(switches: list[dict[str, Any]]) -> float | None:
    """The driver's control time of these switches together, or None where one does not say it."""
    known = [s["control_s"] for s in switches if s.get("control_s") is not None]
    return sum(known) if switches and len(known) == len(switches) else None


def _moved(switches: list[dict[str, Any]], target: str) -> dict[str, Any]:
    parks = [s for s in switches if s["direction"] == "park"]
    resumes = [s for s in switches if s["direction"] == "resume" and s["app"] == target]
    return {"parked": [s["app"] for s in parks], "switched": switched(switches), "bytes_out": sum(s["bytes_moved"] for s in parks),
            "bytes_in": sum(s["bytes_moved"] for s in resumes), "park_s": sum(s["seconds"] for s in parks),
            "resume_s": sum(s["seconds"] for s in resumes), "control_out_s": _control(parks),
            "control_in_s": _control(resumes),
            "two_way": any(s.get("two_way") for s in switches),   # the service switched both at once (docs/swap.md)
            "phases_s": {"park": [s.get("phases_s") or {} for s in parks],   # where each one's time went
                         "resume": [s.get("phases_s") or {} for s in resumes]}}


def fleet_request(fleet: Fleet, method: str, phase: str, m: Member, tokens: int, t0: float,
                  before: Callable[[], dict[str, Any]] = dict, timeout: float = ASK_TIMEOUT_S) -> dict[str, Any]:
    """One request to a server under the swap service: whether it was resident at its arrival, its tokens and
    times, and the parks and resumes the service did meanwhile (from its switch timeline). before(): what the way
    does first, timed from the arrival (the one-way switch's park by hand)."""
    resident = fleet.states().get(m.name) == "resident"
    wall, arrival = time.time(), time.monotonic()
    try:
        done = before()
        got = ask(m.w, tokens, arrival, timeout)
    except (GpucrError, RuntimeError, OSError, TimeoutError) as exc:
        return failed(method, phase, m.name, t0, arrival, resident, exc)
    m.last_request = time.monotonic()
    if resident:
        m.resident_ttft.append(got["ttft_s"])
    return record(method, phase, m.name, t0, arrival, resident, got, m.reference, **done,
                  **_moved(_switches_of(fleet, wall, m.name, resident), m.name))


def _switches_of(fleet: Fleet, wall: float, name: str, resident: bool) -> list[dict[str, Any]]:
    """The service's switches since `wall`. A server parked at the request's arrival was resumed for it, but the
    service writes the switch in its timeline once the switch's call returns, which can be after the server's gate
    opened and its first token came: so wait for that resume (RECORD_WAIT_S at most), or its switch is missed."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        seen = fleet.switches_since(wall)
        if resident or time.monotonic() > deadline or any(
                s["app"] == name and s["direction"] == "resume" for s in seen):
            return seen
        time.sleep(0.05)


def one_way(fleet: Fleet, switches: int, tokens: int, t0: float, deadline: float, emit: Emit, say: Say,
            expect_s: float = 0.0) -> str | None:
    """(a): the server to park is parked by hand through the service, then the parked server's request resumes it
    (park, then resume). None, or why fewer switches were made. No switch is begun that would end past `deadline` by
    the last one's time (the first: `expect_s`, the service's median switch of the stream)."""
    states = fleet.states()
    last = expect_s
    for i in range(switches):
        parked = [m for m in fleet.members.values() if states.get(m.name) == "parked"]
        if not parked:
            return "no server of the fleet is parked: the servers fit the card together"
        target = min(parked, key=lambda m: m.last_request)
        victim = fleet.lru_resident(but=target.name)
        if victim is None:
            return "no other server is resident"
        if time.monotonic() + last > deadline:
            return f"the time budget was spent after {i} switches"
        t = time.monotonic()
        rec = fleet_request(fleet, ONE_WAY, "switch", target, tokens, t0,
                            before=lambda v=victim: _timed_park(fleet, v.name))
        last = time.monotonic() - t
        emit(rec)
        say(f"(a) one-way {i + 1}/{switches}: {victim.name} out, {target.name} in, first token after "
            f"{rec.get('ttft_s', float('nan')):.3f} s")
        states = fleet.states()
    return None


def _timed_park(fleet: Fleet, name: str) -> dict[str, Any]:
    t = time.monotonic()
    fleet.park(name)
    return {"hand_park": name, "hand_park_s": time.monotonic() - t}


def _plain(shape: Shape, simulated: bool, seed: int, **kw: Path | None) -> Workload:
    """A server without gpucr's agent, as a user runs it (and as the driver's own checkpoint must see it)."""
    return Workload(shape.module, *shape.argv(seed, **kw), simulate=simulated, agent=False, ready_timeout=START_TIMEOUT_S)


def _each_switch(n: int, deadline: float, out: dict[str, Any], one: Callable[[int], bool]) -> None:
    """one(i) for each of n switches while the time budget lasts: none is started that the last one's time says
    would end past it. one(i) is False when it failed: the way stops there."""
    last = 0.0
    for i in range(n):
        if time.monotonic() + last > deadline:
            out["short"] = f"the time budget was spent after {i} switches"
            return
        t = time.monotonic()
        if not one(i):
            return
        last = time.monotonic() - t


def restart(shape: Shape, simulated: bool, switches: int, tokens: int, refs: int, weights_dir: str, t0: float,
            deadline: float, emit: Emit, say: Say) -> dict[str, Any]:
    """(b): one server writes its weights once to safetensors under weights_dir (removed after); each switch stops
    the running server and starts one that loads them, until its first token. Every start is of the same weights,
    so one reference holds for all."""
    if not simulated and importlib.util.find_spec("safetensors") is None:
        return {"skipped": "safetensors is not installed here: the restart cannot load its weights from it"}
    where = Path(tempfile.mkdtemp(prefix="gpucr-bench-weights-", dir=weights_dir))
    path = where / "model.safetensors" if shape.module == "token_app" else where   # a file, or transformers' dir
    out: dict[str, Any] = {"weights_dir": weights_dir}
    m: Member | None = None
    try:
        t = time.monotonic()
        m = Member("restart", 0, _plain(shape, simulated, 0, save=path))   # one server, stopped and started again
        out["write_and_start_s"] = time.monotonic() - t
        out["weights_bytes"] = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
        references(RESTART, m, refs, tokens, t0, emit)

        def one(i: int) -> bool:
            assert m is not None
            arrival = time.monotonic()
            try:
                m.w.close()
                m.w = _plain(shape, simulated, 0, weights=path)
                got = ask(m.w, tokens, arrival)
            except (RuntimeError, OSError, TimeoutError) as exc:
                emit(failed(RESTART, "switch", m.name, t0, arrival, False, exc))
                return False
            emit(record(RESTART, "switch", m.name, t0, arrival, False, got, m.reference))
            say(f"(b) restart {i + 1}/{switches}: first token after {got['ttft_s']:.3f} s")
            return True
        _each_switch(switches, deadline, out, one)
    finally:
        if m is not None:
            m.w.close()
        shutil.rmtree(where, ignore_errors=True)
    return out


def driver_switches(shape: Shape, simulated: bool, drv: Driver, deadline_s: float, switches: int, tokens: int,
                    refs: int, t0: float, deadline: float, emit: Emit, say: Say) -> dict[str, Any]:
    """(c): two servers without the agent; one is checkpointed by the driver (lock, checkpoint); each switch
    checkpoints the running one and restores (restore, unlock) the other, then asks it."""
    dm = DriverMethod(drv, deadline_s)
    pair: list[Member] = []
    out: dict[str, Any] = {"steps_s": []}
    try:
        for k in range(2):
            pair.append(Member(f"driver-{k}", 100 + k, _plain(shape, simulated, 100 + k)))   # seeds apart from the fleet's
            references(DRIVER, pair[-1], refs, tokens, t0, emit)
        dm.checkpoint([pair[1].w.pid])
        turn = list(pair)   # [running, checkpointed]

        def one(i: int) -> bool:
            running, parked = turn
            arrival = time.monotonic()
            try:
                ck = dm.checkpoint([running.w.pid])
                rs = dm.restore([parked.w.pid])
                got = ask(parked.w, tokens, arrival)
            except (JobFailed, RuntimeError, OSError, TimeoutError) as exc:
                emit(failed(DRIVER, "switch", parked.name, t0, arrival, False, exc))
                out["error"] = str(exc)
                return False
            steps = {**ck["steps_s"], **rs["steps_s"]}
            out["steps_s"].append(steps)
            emit(record(DRIVER, "switch", parked.name, t0, arrival, False, got, parked.reference, driver_steps_s=steps))
            say(f"(c) driver {i + 1}/{switches}: {running.name} out, {parked.name} in, first token after "
                f"{got['ttft_s']:.3f} s")
            turn.reverse()
            return True
        _each_switch(switches, deadline, out, one)
    finally:
        for m in pair:   # the checkpointed one too: the driver frees what it holds of a process that ends
            if m.w.proc.poll() is None:
                m.w.proc.kill()
            m.w.proc.wait()
    return out
