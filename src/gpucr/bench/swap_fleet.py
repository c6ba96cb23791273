"""The swap scenario's servers (`gpucr bench --scenario swap`): what one is (an LLM server of a model shape on a GPU,
a raw-memory token server on simcuda), each started under `gpucr run --swap` through a `gpucr serve` that the bench
starts or reuses, and one request to one of them, timed from its arrival to its first and last token."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import GpucrError
from ..server import route
from ..workloads.runner import Workload
from .methods import _BenchServer

SIM_CARD_MAX = 2 << 30   # on simcuda, the largest card the scenario runs on
SIM_CONTEXT = 64 << 20   # what simcuda counts for each context: a token server's share less it is its buffer
START_TIMEOUT_S = 600.0
ASK_TIMEOUT_S = 600.0    # a request to a parked server waits for its resume, and for others' parks before it
BY = "gpucr bench"
WATCH_TICK_S = 0.6       # the swap service's tick (0.5 s), and a little: an app seen is watched from the next one


@dataclass(frozen=True)
class Shape:
    """What each server of a run is: module of gpucr.workloads, its arguments but the seed and weights."""
    module: str
    args: tuple[str, ...]
    what: str

    def argv(self, seed: int, weights: Path | None = None, save: Path | None = None) -> list[str]:
        out = [*self.args, "--seed", str(seed)]
        out += ["--weights", str(weights)] if weights is not None else []
        return out + (["--save-weights", str(save)] if save is not None else [])


def shape_for(simulated: bool, model: str, gpu_util: float, total_bytes: int | None) -> Shape:
    """An LLM server of `model` on a GPU; on simcuda a token server holding gpu_util of the simulated card, its
    context included (the LLM servers need torch on a GPU)."""
    if not simulated:
        return Shape("swap_llm_app", (model, "--gpu-util", str(gpu_util)), f"{model} at --gpu-util {gpu_util:g}")
    if not total_bytes:
        raise GpucrError("simcuda did not say its memory (SIMCUDA_TOTAL_MEM)")
    if total_bytes > SIM_CARD_MAX:   # each server's share is host memory here, and each park copies it
        raise GpucrError(f"simcuda's card is {total_bytes >> 20} MiB: give the scenario a small one, e.g. "
                         "SIMCUDA_TOTAL_MEM=419430400 (400 MiB) with --gpu-util 0.4 --servers 3")
    mib = (gpu_util * total_bytes - SIM_CONTEXT) / (1 << 20)
    if mib < 1:
        raise GpucrError(f"--gpu-util {gpu_util:g} of simcuda's {total_bytes >> 20} MiB leaves no room beside a context")
    return Shape("token_app", ("--mib", f"{mib:.2f}"), f"a token server of {mib:.1f} MiB (simcuda)")


def switched(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """[app, direction, bytes moved] of each switch of the service's timeline: what the bench saw happen, which
    `--watch` sets against the metrics' counters (swap_watch.bench_counters)."""
    return [[s["app"], s["direction"], s["bytes_moved"]] for s in rows]


def ask(w: Workload, tokens: int, arrival: float, timeout: float = ASK_TIMEOUT_S) -> dict[str, Any]:
    """One request: `generate K`, timed from `arrival` (time.monotonic(), which the server's answer shares)."""
    a = w.ask(f"generate {tokens}", timeout=timeout)
    return {"ttft_s": a["first_at"] - arrival, "ttlt_s": a["last_at"] - arrival, "tokens": a["tokens"]}


@dataclass
class Member:
    name: str
    seed: int
    w: Workload
    reference: list[int] | None = None
    last_request: float = 0.0
    resident_ttft: list[float] = field(default_factory=list)


class Fleet:
    """The servers under the swap service, and the `gpucr serve` they run under."""

    def __init__(self, shape: Shape, simulated: bool, serve_flags: list[str], server_cost: int) -> None:
        self.shape, self.simulated, self.server_cost = shape, simulated, server_cost
        self.srv = _BenchServer(simulated, *serve_flags)
        self.reused = self.srv.info() is not None   # one already running is used as it is
        if not self.reused:
            self.srv.ensure()
        self.members: dict[str, Member] = {}
        self.pre_parks: list[dict[str, Any]] = []
        self.starts: list[dict[str, Any]] = []   # each start's switches (its pre-parks, any the service made)

    def view(self) -> dict[str, Any]:
        return route.swap("swap_view", {}, BY)

    def states(self) -> dict[str, str]:
        return {a["name"]: a["state"] for a in self.view()["apps"]}

    def free_bytes(self) -> tuple[int | None, int]:
        """GPU 0's free memory, and what the gpucr server holds there itself (its context, once it has copied)."""
        g = (self.view().get("gpus") or [{}])[0]
        known = g.get("total_bytes") is not None and g.get("used_bytes") is not None
        return (g["total_bytes"] - g["used_bytes"] if known else None), g.get("server_bytes") or 0

    def start(self, name: str, seed: int, need: int) -> Member:
        """One server under `gpucr run --swap`, after room for `need` bytes was made. The service makes room only
        for an app it watches already (from its first status read, up to a second after its start): a server that
        allocates at once would get the out-of-memory error. So the bench parks the least recently used resident
        servers through the service first (each said in the results' pre_parks)."""
        wall = time.time()
        self._room_for(need)
        argv = [sys.executable, "-m", "gpucr.cli", "run"] + (["--simulate"] if self.simulated else [])
        argv += ["--swap", "--name", name, "--", sys.executable, "-m", f"gpucr.workloads.{self.shape.module}",
                 *self.shape.argv(seed)]
        w = Workload(self.shape.module, simulate=self.simulated, argv=argv, ready_timeout=START_TIMEOUT_S)
        m = self.members[name] = Member(name, seed, w, last_request=time.monotonic())
        self._seen(name)
        self.starts.append({"server": name, "switched": switched(self.switches_since(wall))})
        return m

    def _seen(self, name: str, timeout: float = 30.0) -> None:
        """Wait until the service has read the server's memory and watches it. A park before it knows what the app
        holds leaves its resume nothing to make room by (measured on simcuda: the resume waited, then failed out of
        memory, and the request hung at the gate)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = next((r for r in self.view()["apps"] if r["name"] == name), None)
            if row is not None and row.get("resident_bytes"):
                time.sleep(WATCH_TICK_S)   # its watch starts at the service's next tick
                return
            time.sleep(0.05)
        raise GpucrError(f"the swap service did not see {name}'s GPU memory within {timeout:g} s")

    def _room_for(self, need: int, timeout: float = 120.0) -> None:
        """Room for `need` bytes, and for the gpucr server's own context where it holds none yet (its first park
        makes it: server_cost)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            free, own = self.free_bytes()
            if free is None or free >= need + (0 if own else self.server_cost):
                return
            states = self.states()
            resident = [m for m in self.members.values() if states.get(m.name) == "resident"]
            if resident:
                victim = min(resident, key=lambda m: m.last_request)
                self.park(victim.name)
                self.pre_parks.append({"parked": victim.name, "free_before_bytes": free, "need_bytes": need})
            time.sleep(0.1)   # memory a park gave back is not always free at once

    def park(self, name: str) -> dict[str, Any]:
        """The service's own park of one server (as `gpucr top`'s p): its next request resumes it on demand."""
        return route.swap("swap_park", {"name": name, "by": BY}, BY)

    def lru_resident(self, but: str) -> Member | None:
        """The resident server the service's policy would park first (all of one priority: the least recently
        active), as the bench saw their activity."""
        states = self.states()
        resident = [m for m in self.members.values() if m.name != but and states.get(m.name) == "resident"]
        return min(resident, key=lambda m: m.last_request) if resident else None

    def switches_since(self, wall: float) -> list[dict[str, Any]]:
        """The parks and resumes the service ended from `wall` (time.time()) on, oldest first: those begun before
        too, which a request arriving then waited for (its server met resuming, not yet resident). Counted from their
        start only, 7 of the 47 switches of the H100's swap run (2026-12-05) were set against no bytes and no bound."""
        return [s for s in self.view()["switches"] if s["at"] + s["seconds"] >= wall - 0.001]

    def close(self) -> None:
        """Every server killed (a parked one's quit would first be resumed: its exit reaches the GPU), then the
        bench's own `gpucr serve` stopped; an app killed while parked has its staging freed by the service."""
        for m in self.members.values():
            if m.w.proc.poll() is None:
                m.w.proc.kill()
            m.w.proc.wait()
        self.members.clear()
        self.srv.close()

    def server_log(self) -> list[str]:
        return self.srv.log_since() if not self.reused else []
