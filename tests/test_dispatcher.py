"""The coordinator's two-phase protocol against a fake agent, a fake driver and a fake data plane, in milliseconds
(ARCHITECTURE.md's fast dispatcher test, beside the end-to-end tests on simcuda): the order of the phases of a
checkpoint and a restore of one or several processes through the plane, and that a failure at any step rolls every
process back and names the process and the phase.

The fakes are wired in at the coordinator's seams: target.resolve (a fake Target whose connect() gives the fake
agent and whose driver() the fake driver) and gpus.machine_gpus; the plane is handed in, as the server hands its
Mover. The processes are real (sleepers): the coordinator looks at /proc to tell whether a process still runs."""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpucr import coordinator, gpus
from gpucr import proc
from gpucr import target as targets
from gpucr.plane import Stats
from gpucr.driver import DriverError, ProcessState
from gpucr.errors import GpucrError

# Each process's memory, as its agent lists it (`memory`) and lays out its staging (`layout`).
ALLOCATIONS = [{"index": 0, "va": 0x7f0000000000, "bytes": 2 << 20},
               {"index": 1, "va": 0x7f0000200000, "bytes": 4 << 20}]
TOTAL_BYTES = sum(a["bytes"] for a in ALLOCATIONS)
MADE_FD_NAME = "gpucr-test-made-memory"   # the fake plane's new memory at a restore: memfds of this name

Step = tuple[str, int]   # ("who:verb", pid), as the World logs them


class World:
    """Everything the coordinator reaches, faked: one agent per process, one driver, one plane. Every step is logged
    in order (from any thread); a step named in `faults` ("who:verb", pid) fails instead of acting."""

    def __init__(self, pids: list[int], faults: set[Step], plane: str) -> None:
        self.log: list[Step] = []
        self.faults = faults
        self.agents = {pid: FakeAgent(self, pid) for pid in pids}
        self.driver = FakeDriver(self)
        self.plane = FakePlane(self, plane)

    def step(self, who: str, verb: str, pid: int) -> None:
        self.log.append((f"{who}:{verb}", pid))
        if (f"{who}:{verb}", pid) not in self.faults:
            return
        if who == "driver":
            raise DriverError(f"cuCheckpointProcess {verb}", 999, "injected fault")
        raise GpucrError(f"process {pid}: {who} {verb} failed (injected fault)")

    def resolve(self, pid: int) -> FakeTarget:
        return FakeTarget(pid, self)

    def steps(self, name: str) -> list[int]:
        """The pids of `name`'s steps, in order."""
        return [pid for s, pid in self.log if s == name]

    def verbs(self, pid: int, who: str = "agent") -> list[str]:
        """`who`'s verbs for one process, in order, reads of its status left out."""
        return [s.split(":")[1] for s, p in self.log if p == pid and s.startswith(who + ":") and s != "agent:status"]

    def before(self, first: str, then: str) -> bool:
        """Every `first` step came before any `then` step (and both happened)."""
        names = [s for s, _ in self.log]
        return first in names and then in names and \
            max(i for i, s in enumerate(names) if s == first) < min(i for i, s in enumerate(names) if s == then)


class FakeTarget:
    def __init__(self, pid: int, world: World) -> None:
        self.pid, self.world = pid, world
        # its real start time: with the pid, it names the (real, sleeping) process, as target.resolve's does
        self.uid, self.start_time = os.getuid(), proc.process_start_time(pid)
        self.hello = {"cuda": True, "simulated": True}

    def connect(self) -> FakeAgent:
        return self.world.agents[self.pid]

    def driver(self) -> FakeDriver:
        return self.world.driver

    def app_socket(self) -> Path:
        return Path(f"/nonexistent/{self.pid}.app.sock")   # the application did not join the cut


class FakeAgent:
    """A process's agent, as a small state machine of the verbs a cycle through the plane sends. Verbs that need
    CUDA in the process (adopt, restore) are refused while the driver holds it, as the real agent's calls fail."""

    def __init__(self, world: World, pid: int) -> None:
        self.world, self.pid = world, pid
        self.state = "running"     # or "checkpointed": the data in staging, off the GPU
        self.gate_closed = False
        self.handed = False        # memory released, kept on the GPU by the agent's fds until the commit
        self.adopted = 0           # allocations the plane made and filled, mapped here at a restore
        self.generation = 0

    def call(self, verb: str, timeout: float = 30.0, *, watch: Any = None, **args: int) -> dict[str, Any]:
        self.world.step("agent", verb, self.pid)
        return getattr(self, "_" + verb)(**args)   # a verb it does not know: AttributeError, the test fails

    def call_with_fds(self, verb: str, timeout: float = 30.0, **args: int) -> tuple[dict[str, Any], list[int]]:
        return self.call(verb, timeout, **args), []

    def call_sending_fds(self, verb: str, send: list[int], timeout: float = 30.0, **args: int) -> dict[str, Any]:
        return self.call(verb, timeout, fds=len(send), **args)

    def call_paged_with_fds(self, verb: str, key: str, entry, what: str, timeout: float) -> list[Any]:
        return [entry(e, []) for e in self.call(verb, timeout)[key]]

    def close(self) -> None:
        pass   # one agent per process, reached again by the next request

    def _need_cuda(self, verb: str) -> None:
        if self.world.driver.state(self.pid) != ProcessState.RUNNING:
            raise GpucrError(f"process {self.pid}: '{verb}' while the driver holds the process")

    def _status(self, controller: int = 0) -> dict[str, Any]:   # controller=1: the connection of a request's vet
        return {"state": self.state, "gate_closed": self.gate_closed, "busy": False, "staged": self.state != "running",
                "generation": self.generation, "devices": [], "shared": [],
                "checkpoint_phase": "handed" if self.handed else ""}

    def _shared(self, **_: int) -> dict[str, Any]:
        return {"shared": []}

    def _memory(self, **_: int) -> dict[str, Any]:
        return {"memory": [{"index": a["index"], "kind": "converted", "bytes": a["bytes"], "device": 0,
                            "released": self.state != "running" or self.handed, "not_exportable": False,
                            "maps": [{"va": a["va"], "bytes": a["bytes"], "offset": 0}], "fd_index": -1,
                            "movable": True, "handable": True} for a in ALLOCATIONS]}

    def _layout(self) -> dict[str, Any]:
        return {"allocations": ALLOCATIONS, "generation": self.generation}

    def _quiesce(self, **_: int) -> dict[str, Any]:
        self.gate_closed = True
        return self._status()

    def _handover(self, **_: int) -> dict[str, Any]:
        assert self.state == "running"
        self.gate_closed = self.handed = True
        return self._status()

    def _handed_done(self) -> dict[str, Any]:
        assert self.handed, f"handed_done to process {self.pid}, which handed nothing over"
        self.state, self.generation = "checkpointed", self.generation + 1
        return {**self._status(), "bytes_left_to_driver": 0, "last_cycle_ms": {
            "staging": 0.0, "gate": 0.0, "sync": 0.0, "release": 0.0, "bytes_out": 0}}

    def _abort(self) -> dict[str, Any]:
        """A quiesce undone, or a handover before its commit: the memory mapped again from the agent's fds."""
        assert self.state == "running" or self.handed, f"abort of process {self.pid}, whose memory has left the GPU"
        if self.handed:
            self._need_cuda("abort")
        self.state, self.handed, self.gate_closed = "running", False, False
        return self._status()

    def _commit(self, full: int) -> dict[str, Any]:
        self.handed = False   # the agent's fds let go: the memory leaves the GPU
        return {}

    def _adopt(self, fds: int, **_: int) -> dict[str, Any]:
        self._need_cuda("adopt")
        self.adopted += fds
        return {}

    def _unadopt(self, **_: int) -> dict[str, Any]:
        """What a restore adopted given back: parked again, as before it."""
        self._need_cuda("unadopt")
        undone, self.adopted = self.adopted, 0
        return {"ok": True, "undone": undone}

    def _restore(self, drop_staging: int, open_gate: int) -> dict[str, Any]:
        """The end of a restore: every allocation adopted, or it stays checkpointed (the agent copies nothing)."""
        self._need_cuda("restore")
        assert self.state == "checkpointed" and not self.handed and not open_gate
        if self.adopted < len(ALLOCATIONS):
            raise GpucrError(f"{len(ALLOCATIONS) - self.adopted} allocations were not brought back by gpucr's data "
                             "plane; the process stays checkpointed")
        self.state, self.adopted = "running", 0
        return self._status()

    def _resume(self) -> dict[str, Any]:
        self.gate_closed = False
        return {}


class FakeDriver:
    """The driver's checkpoint state machine: running -> locked -> checkpointed -> locked -> running."""
    simulated = True

    def __init__(self, world: World) -> None:
        self.world = world
        self.states: dict[int, ProcessState] = {}

    def state(self, pid: int) -> ProcessState:
        return self.states.get(pid, ProcessState.RUNNING)

    def _move(self, pid: int, verb: str, was: ProcessState, now: ProcessState) -> None:
        self.world.step("driver", verb, pid)
        assert self.state(pid) == was, f"driver {verb} of process {pid} in state {self.state(pid).name}"
        self.states[pid] = now

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._move(pid, "lock", ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._move(pid, "checkpoint", ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int, pairs: list[tuple[bytes, bytes]] | None = None) -> None:
        self._move(pid, "restore", ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid: int) -> None:
        self._move(pid, "unlock", ProcessState.LOCKED, ProcessState.RUNNING)


class FakePlane:
    """The data plane (a Mover's interface): copies out, and makes and fills new memory, handed back as fds."""

    def __init__(self, world: World, plane: str) -> None:
        self.world, self.plane = world, plane

    def copy_out(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Any],
                 scan: bool = True) -> Stats:
        self.world.step("plane", "copy_out", pid)
        assert [e.index for e in memory] == [a["index"] for a in layout["allocations"]]
        return Stats(bytes=TOTAL_BYTES, seconds=0.001, allocations=len(memory))

    def fill(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Any],
             image: Any = None, check: bool = True) -> tuple[Stats, list[tuple[int, int]]]:
        self.world.step("plane", "fill", pid)
        fds = [(int(a["index"]), os.memfd_create(MADE_FD_NAME)) for a in layout["allocations"]]
        return Stats(bytes=TOTAL_BYTES, seconds=0.001, allocations=len(fds)), fds

    def settle(self) -> None:
        self.world.step("plane", "settle", 0)

    def forget(self, pid: int) -> None:
        self.world.step("plane", "forget", pid)


@pytest.fixture(scope="module")
def live_pids() -> Iterator[list[int]]:
    """Three real processes for the fake agents to stand for."""
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


@contextmanager
def fake_world(pids: list[int], faults: set[Step] | None = None, plane: str = "server") -> Iterator[World]:
    world = World(pids, faults or set(), plane)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(targets, "resolve", world.resolve)
        mp.setattr(gpus, "machine_gpus", lambda drv: [])
        yield world


def made_fds_open() -> int:
    """The fake plane's new memory still held open here (each keeps memory on the GPU)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += MADE_FD_NAME in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass   # the listing's own fd, closed meanwhile
    return n


def check_all_running(world: World) -> None:
    """Every process runs on with its data on the GPU: the driver lets go of it, its gate is open, nothing handed."""
    for pid, agent in world.agents.items():
        assert world.driver.state(pid) == ProcessState.RUNNING, pid
        assert (agent.state, agent.gate_closed, agent.handed) == ("running", False, False), pid


# --- checkpoint --------------------------------------------------------------------------------------------------

def test_one_process_checkpoint_through_the_plane(live_pids):
    pid = live_pids[0]
    with fake_world([pid]) as world:
        result = coordinator.checkpoint_many([pid], mover=world.plane)
    assert world.verbs(pid) == ["shared", "handover", "memory", "layout", "handed_done", "commit"]
    assert world.verbs(pid, "driver") == ["lock", "checkpoint"]
    assert world.verbs(pid, "plane") == ["copy_out"]
    assert world.before("agent:layout", "driver:lock")   # listed before the driver holds the process
    assert world.before("driver:checkpoint", "agent:handed_done")
    assert world.before("plane:copy_out", "agent:handed_done")
    assert world.log[-2:] == [("plane:settle", 0), ("agent:status", pid)]
    [p] = result.processes
    assert (p.state, p.level, p.data_plane, p.generation) == ("checkpointed", "full", "server", 1)
    assert world.agents[pid].state == "checkpointed" and world.driver.state(pid) == ProcessState.CHECKPOINTED


@pytest.mark.parametrize("plane", ["server", "cli"])
def test_several_processes_go_through_each_phase_together(live_pids, plane):
    with fake_world(live_pids, plane=plane) as world:
        result = coordinator.checkpoint_many(live_pids, mover=world.plane)
    for first, then in [("agent:quiesce", "agent:handover"), ("agent:handover", "plane:copy_out"),
                        ("agent:handover", "driver:lock"), ("agent:layout", "driver:lock"),
                        ("driver:lock", "driver:checkpoint"), ("plane:copy_out", "agent:handed_done"),
                        ("driver:checkpoint", "agent:handed_done"), ("agent:handed_done", "agent:commit"),
                        ("agent:commit", "plane:settle")]:
        assert world.before(first, then), f"every {first} before any {then}: {world.log}"
    assert world.steps("plane:copy_out") == live_pids   # one after another: the link is the bound
    assert all(world.verbs(pid)[-1] == "commit" for pid in live_pids)
    assert [p.data_plane for p in result.processes] == [plane] * len(live_pids)
    assert [p.state for p in result.processes] == ["checkpointed"] * len(live_pids)


# Where a checkpoint through the plane can fail, and the phase its error names.
FAIL_POINTS = {"agent:quiesce": "quiesce", "agent:handover": "data out", "plane:copy_out": "data out",
               "driver:lock": "driver lock", "driver:checkpoint": "driver checkpoint", "agent:handed_done": "release"}


# Every failure point x number of processes x which one fails x level: 72 cases, few enough to run them all.
FAILURES = [(n, which, point, level) for n in (1, 2, 3) for which in range(n) for point in FAIL_POINTS
            for level in ("full", "data")]


def reached(point: str, n: int, level: str) -> bool:
    """Whether a checkpoint of n processes at `level` takes that step: one process is not quiesced first, and
    --level data leaves the driver alone."""
    return not (point == "agent:quiesce" and n == 1 or point.startswith("driver:") and level != "full")


def undo_expected(world: World, pid: int, fault: Step) -> list[str]:
    """What a roll-back asks of a process's agent: abort, where anything was done (its fds kept the memory on the
    GPU until the commit, so it maps it again: no copy); nothing, where nothing was done."""
    done = [v for v in ("quiesce", "handover", "handed_done")
            if (f"agent:{v}", pid) in world.log and (f"agent:{v}", pid) != fault]
    return ["abort"] if done else []


@pytest.mark.parametrize("n, which, point, level", FAILURES)
def test_a_failure_at_any_step_rolls_every_process_back(live_pids, n, which, point, level):
    pids = live_pids[:n]
    bad = pids[which]
    with fake_world(pids, {(point, bad)}) as world:
        if not reached(point, n, level):
            coordinator.checkpoint_many(pids, world.plane, level)
            assert (point, bad) not in world.log and all(a.state == "checkpointed" for a in world.agents.values())
            return
        with pytest.raises(GpucrError) as err:
            coordinator.checkpoint_many(pids, world.plane, level)
    error = str(err.value)
    assert f"process {bad} failed at {FAIL_POINTS[point]}: " in error, error
    if n > 1:
        assert f"rolled back: all {n} processes run on with their data intact" in error, error
    elif FAIL_POINTS[point] != "data out":   # (a data out that fails says itself that the process runs on)
        assert f"rolled back, process {bad} runs on with its data intact" in error, error
    check_all_running(world)
    assert not world.steps("agent:commit")
    for pid in pids:
        undone = [v for v in world.verbs(pid) if v in ("abort", "restore", "resume")]
        assert undone == undo_expected(world, pid, (point, bad)), (pid, world.verbs(pid))


def test_a_mistake_of_ours_in_a_roll_back_is_raised_once_every_process_is_undone(live_pids):
    """A roll-back step that fails with anything but a GpucrError is a bug: it is raised, not swallowed (it was, for
    several processes, in _run_all's threads), and only once the other steps ran for every process."""
    pids = live_pids[:2]
    with fake_world(pids, {("driver:checkpoint", pids[1])}) as world:
        real = world.driver.restore

        def broken(pid: int, pairs=None) -> None:
            if pid == pids[0]:
                raise TypeError("a mistake of ours")
            real(pid, pairs)
        world.driver.restore = broken
        with pytest.raises(TypeError, match="a mistake of ours"):
            coordinator.checkpoint_many(pids, mover=world.plane)
    assert all("abort" in world.verbs(pid) for pid in pids), [world.verbs(pid) for pid in pids]
    assert world.driver.state(pids[1]) == ProcessState.RUNNING   # the other one's driver steps were undone


def test_a_failed_driver_checkpoint_is_undone_on_the_driver(live_pids):
    pids = live_pids[:2]
    with fake_world(pids, {("driver:checkpoint", pids[1])}) as world, pytest.raises(GpucrError) as err:
        coordinator.checkpoint_many(pids, mover=world.plane)
    assert f"process {pids[1]} failed at driver checkpoint: cuCheckpointProcess checkpoint failed: injected fault" \
        in str(err.value)
    # the one checkpointed is restored and unlocked, the one left locked is unlocked; both agents let go
    assert world.verbs(pids[0], "driver")[-2:] == ["restore", "unlock"]
    assert world.verbs(pids[1], "driver")[-1] == "unlock"
    assert all(world.verbs(pid)[-1] == "abort" for pid in pids)
    check_all_running(world)


# --- restore -----------------------------------------------------------------------------------------------------

@contextmanager
def parked(pids: list[int], faults: set[Step] | None = None, plane: str = "server") -> Iterator[World]:
    """A world whose processes a checkpoint through the plane has just parked; its log starts after it, and
    `faults` apply from there."""
    with fake_world(pids, plane=plane) as world:
        coordinator.checkpoint_many(pids, mover=world.plane)
        world.log.clear()
        world.faults = faults or set()
        yield world


@pytest.mark.parametrize("plane", ["server", "cli"])
def test_restore_fills_beside_the_driver_then_adopts_then_resumes(live_pids, plane):
    pids = live_pids[:2]
    with parked(pids, plane=plane) as world:
        result = coordinator.restore_many(pids, mover=world.plane)
    for first, then in [("agent:layout", "plane:fill"), ("agent:layout", "driver:restore"),
                        ("driver:restore", "driver:unlock"), ("plane:fill", "agent:adopt"),
                        ("driver:unlock", "agent:adopt"), ("agent:adopt", "agent:restore"),
                        ("agent:restore", "agent:resume"), ("agent:resume", "plane:settle")]:
        assert world.before(first, then), f"every {first} before any {then}: {world.log}"
    assert world.steps("plane:fill") == pids
    for pid in pids:
        assert world.verbs(pid) == ["memory", "layout", "adopt", "restore", "resume"]
    assert [(p.state, p.data_plane, p.bytes_moved) for p in result.processes] == [("running", plane, TOTAL_BYTES)] * 2
    check_all_running(world)
    assert made_fds_open() == 0   # ours closed: each agent holds its own of what it adopted


def test_a_failed_fill_leaves_that_process_checkpointed(live_pids):
    """The plane cannot fill one process: it stays checkpointed, its data still in staging (the agent copies
    nothing), and the error names it; the other is restored and runs."""
    pids = live_pids[:2]
    with parked(pids, {("plane:fill", pids[0])}) as world, pytest.raises(GpucrError) as err:
        coordinator.restore_many(pids, mover=world.plane)
    assert f"process {pids[0]} failed at data in: plane fill failed (injected fault)" in str(err.value), err.value
    assert f"processes {pids[1]} were restored and run" in str(err.value)
    assert world.verbs(pids[0]) == ["memory", "layout"] and world.agents[pids[0]].state == "checkpointed"
    assert world.verbs(pids[1]) == ["memory", "layout", "adopt", "restore", "resume"]
    assert made_fds_open() == 0


def test_an_adopt_that_fails_part_way_is_given_back_whole(live_pids, monkeypatch):
    """The agent maps the first batch of the plane's new memory, then refuses the next: what it adopted is given
    back (unadopt), so the process stays checkpointed whole, not half mapped, and the other process is restored."""
    from gpucr.coordinator import through_plane
    monkeypatch.setattr(through_plane, "ADOPT_BATCH", 1)
    pids = live_pids[:2]
    with parked(pids) as world:
        agent = world.agents[pids[0]]
        first_adopt = agent._adopt

        def second_fails(fds: int, **args: int) -> dict[str, Any]:
            if agent.adopted:
                raise GpucrError("mapping the server's memory failed (injected fault)")
            return first_adopt(fds, **args)
        monkeypatch.setattr(agent, "_adopt", second_fails)
        with pytest.raises(GpucrError) as err:
            coordinator.restore_many(pids, mover=world.plane)
    assert f"process {pids[0]} failed at data in" in str(err.value) and "injected fault" in str(err.value), err.value
    assert world.verbs(pids[0]) == ["memory", "layout", "adopt", "adopt", "unadopt"]
    assert agent.state == "checkpointed" and agent.adopted == 0
    assert world.verbs(pids[1])[-2:] == ["restore", "resume"]
    assert made_fds_open() == 0


def test_a_failed_driver_restore_leaves_that_process_checkpointed(live_pids):
    pids = live_pids[:2]
    with parked(pids, {("driver:restore", pids[0])}) as world, pytest.raises(GpucrError) as err:
        coordinator.restore_many(pids, mover=world.plane)
    assert f"process {pids[0]} failed at driver restore" in str(err.value)
    assert f"processes {pids[1]} were restored and run" in str(err.value)
    assert "adopt" not in world.verbs(pids[0]) and world.driver.state(pids[0]) == ProcessState.CHECKPOINTED
    assert world.agents[pids[0]].state == "checkpointed"   # restorable: a retry brings it back
    assert world.verbs(pids[1])[-1] == "resume" and world.agents[pids[1]].state == "running"
    assert made_fds_open() == 0   # the memory made for the one that failed is let go
