"""What `gpucr bench` compares: methods that each checkpoint and restore the processes of one
workload (gpucr.bench.specs) and return the time of every step; `metrics` turns one cycle into the
uniform row the report reads, set against the bounds of gpucr.bench.bounds.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from ..coordinator import checkpoint_many, restore_many
from .. import gpus
from ..driver import Driver
from ..errors import GpucrError
from ..workloads import tms_app
from ..workloads.job import Job
from .rows import combine
from .specs import NO_FAST_TRANSPORTS, Spec, plain_env

STEP_TIMEOUT_S = 30.0       # gate drain and each driver step; the copies take what they take
WARMUP_TIMEOUT_S = 600.0    # the first gpucr checkpoint also prepares (faults in and pins) its staging

# ---- methods ----

class JobFailed(GpucrError):
    """The driver's own path failed or hung on a job: it cannot run on and must be started again.
    outcome: 'failed' (a call returned an error) or 'hung' (a call had not returned by the deadline)."""

    def __init__(self, outcome: str, step: str, errors: dict[int, str], steps_s: dict[str, float]) -> None:
        said = "; ".join(f"process {pid}: {e}" for pid, e in errors.items())
        super().__init__(f"the driver's {step} {outcome}: {said}")
        self.outcome, self.step, self.errors, self.steps_s = outcome, step, errors, dict(steps_s)


def _step_all(name: str, fn, pids: list[int], deadline: float, steps: dict[str, float]) -> None:
    """fn(pid) for every process at once, each in a daemon thread (a call into the driver cannot be
    cancelled, so a hung one is left behind); the step's wall time goes into steps[name]."""
    import threading
    results: dict[int, str | None] = {}

    def run(pid: int) -> None:
        try:
            fn(pid)
            results[pid] = None
        except Exception as exc:
            results[pid] = str(exc)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(pid,), daemon=True, name=f"bench-{name}-{pid}") for pid in pids]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    steps[name] = time.perf_counter() - t0
    hung = {pid: f"no return within {deadline:g} s" for pid in pids if pid not in results}
    failed = {pid: e for pid, e in results.items() if e}
    if hung:
        raise JobFailed("hung", name, {**failed, **hung}, steps)
    if failed:
        raise JobFailed("failed", name, failed, steps)


class Method:
    name = ""
    under_agent = False
    splits = False         # whether data and control are timed apart
    agent_env: dict[str, str] = {}   # settings the agent reads at start: such methods get a process of their own
    job_env: dict[str, str] = {}     # settings of the job itself (NCCL's): the same
    own_job = False        # a workload process of its own kind (the peer's): never shared
    in_app = False         # the application moves its data itself, timed inside it (the peer)

    def unavailable(self, spec: Spec) -> str | None:
        """Why this method cannot run on `spec` here (it is then reported as skipped), or None."""
        return None

    def workload(self, spec: Spec) -> tuple[str, list[str], dict[str, str]]:
        """The workload process this method acts on: module of gpucr.workloads, its arguments and
        environment of its own."""
        return spec.module, list(spec.args), {}

    def bind(self, job: Job) -> None:
        """The job just started for this method; one that talks to the application itself keeps it."""

    def before_first(self, pids: list[int]) -> None:
        """Called before its first (untimed for this) cycle: what a method waits for that a user would not time."""

    def warmup(self) -> "Method | None":
        """The untimed first cycle, reported apart, that prepares what later cycles reuse."""
        return None

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, pids: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def after_cycle(self) -> None:
        """After each timed cycle, untimed: what a user would do later, not as part of the restore."""

    def close(self) -> None:
        """Give back what the method holds between cycles (a server it started); after the last workload."""

    def server_log(self) -> list[str] | None:
        """What the server it started logged since the last call (None: it starts none), kept with its
        results: a cycle slower than the rest is then read beside what the server did meanwhile."""
        return None

    def staging_bytes(self, pids: list[int]) -> int | None:
        """Host memory the processes' staging holds now: the host-memory budget their cycles use (the agent
        grows it to the peak of the bytes it would move, and keeps it while the process runs). None when
        not under the agent, or when it cannot be asked."""
        if not self.under_agent:
            return None
        from .. import reading
        try:
            return sum(reading.status(p).staging_bytes for p in pids)
        except GpucrError:
            return None


class DriverMethod(Method):
    """The driver's own checkpoint, through one persistent, initialised controller: every process
    of the job locked, then each checkpointed; restored each, then unlocked all; every step for all
    processes at once, under a deadline. nop2p: 'driver-nop2p', the job started with NCCL's P2P and
    shared-memory transports off, so its ranks share no GPU memory (what the driver's path needs)."""
    name = "driver"

    def __init__(self, drv: Driver, deadline: float = 600.0, nop2p: bool = False) -> None:
        self.drv, self.deadline = drv, deadline
        if nop2p:
            self.name, self.job_env = "driver-nop2p", dict(NO_FAST_TRANSPORTS)

    def act(self, action: str, pid: int) -> None:
        if action == "Lock":
            self.drv.lock(pid, int(STEP_TIMEOUT_S * 1000))
        else:
            getattr(self.drv, action.lower())(pid)

    def _steps(self, pids: list[int], actions: tuple[str, str]) -> dict[str, Any]:
        steps: dict[str, float] = {}
        for action in actions:
            _step_all(action.lower(), lambda pid: self.act(action, pid), pids, self.deadline, steps)
        return {"steps_s": steps}

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return self._steps(pids, ("Lock", "Checkpoint"))

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return self._steps(pids, ("Restore", "Unlock"))


# One driver action in a fresh interpreter: cuInit and one call, as a CLI per action would do.
# The args struct is 64 bytes; only the lock's first field (timeoutMs) is not zero.
_FRESH = ("import ctypes,struct,sys\n"
          "cu=ctypes.CDLL(sys.argv[1]);rc=cu.cuInit(0)\n"
          "if rc==0:rc=getattr(cu,'cuCheckpointProcess'+sys.argv[2])(int(sys.argv[3]),"
          "ctypes.create_string_buffer(struct.pack('I',int(sys.argv[4])),64))\n"
          "print(rc)")


class FreshDriverMethod(DriverMethod):
    """The driver's own checkpoint, each action by a fresh process, timed from here end to end."""
    name = "driver-fresh"

    def __init__(self, drv: Driver, env: dict[str, str], deadline: float = 600.0) -> None:
        super().__init__(drv, deadline)
        self.env = env

    def act(self, action: str, pid: int) -> None:
        timeout_ms = int(STEP_TIMEOUT_S * 1000) if action == "Lock" else 0   # other args must be all zero
        out = subprocess.run([sys.executable, "-c", _FRESH, self.drv.path, action, str(pid), str(timeout_ms)],
                             capture_output=True, text=True, env=self.env, timeout=3600)
        rc = out.stdout.strip()
        if out.returncode != 0 or rc != "0":
            raise GpucrError(f"driver {action.lower()} of process {pid} in a fresh process failed: "
                             f"{rc or out.stderr.strip()[-300:]}")


class GpucrMethod(Method):
    """gpucr in a warm controller, the bench itself, with no server: its own mover copies through a small pinned
    ring, as `gpucr checkpoint --no-server` does, minus a fresh interpreter and cuInit each step; at level full the
    driver takes the control state beside it; all processes of a job at once (coordinator.checkpoint_many)."""
    under_agent = True
    splits = True

    def __init__(self, level: str, timeout: float = STEP_TIMEOUT_S) -> None:
        self.level, self.name, self.timeout = level, f"gpucr-{level}", timeout
        self._plane = contextlib.ExitStack()
        self._mover = None

    def warmup(self) -> Method:
        return agent_warmup()

    def _made(self):
        if self._mover is None:
            from ..dataplane.cli_plane import cli_plane
            self._mover = self._plane.enter_context(cli_plane())
        return self._mover

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return combine(checkpoint_many(pids, self._made(), level=self.level, timeout=self.timeout).processes)

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return combine(restore_many(pids, self._made(), timeout=self.timeout).processes)

    def close(self) -> None:
        self._plane.close()
        self._mover = None


class CliMethod(Method):
    """gpucr as a user types it: a fresh `gpucr checkpoint|restore --json` process per step.
    'gpucr-cli-server': through a gpucr server (`gpucr serve`, started for the bench and stopped after);
    'gpucr-cli': in-process (--no-server), so each step also pays an interpreter, imports and cuInit.
    The difference between the two is what the server saves; gpucr-full (a warm in-process controller,
    the bench itself) bounds it."""
    under_agent = True
    splits = True

    def __init__(self, server: bool, simulate: bool, timeout: float = STEP_TIMEOUT_S) -> None:
        self.name = "gpucr-cli-server" if server else "gpucr-cli"
        self.server, self.simulate, self.timeout = server, simulate, timeout
        self._srv = _BenchServer(simulate)

    def warmup(self) -> Method:
        return agent_warmup()

    def _cli(self, verb: str, pids: list[int]) -> dict[str, Any]:
        if self.server:
            self._srv.ensure()
        argv = [sys.executable, "-m", "gpucr.cli", verb, "--json", "--timeout", str(self.timeout)]
        argv += (["--simulate"] if self.simulate else []) + ([] if self.server else ["--no-server"]) + [str(p) for p in pids]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise GpucrError(f"{self.name} {verb}: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}")
        from ..results import CheckpointResult, RestoreResult, from_json
        kind = CheckpointResult if verb == "checkpoint" else RestoreResult
        return combine(from_json(kind, json.loads(r.stdout)).processes)

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return self._cli("checkpoint", pids)

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return self._cli("restore", pids)

    def close(self) -> None:
        self._srv.close()

    def server_log(self) -> list[str] | None:
        return self._srv.log_since()


class _BenchServer:
    """A `gpucr serve` started for one method of the bench and stopped after it (one already running is
    refused: the bench must know what it measures)."""

    LOG_LINES = 200   # kept per read: a run's results stay small

    def __init__(self, simulate: bool, *flags: str) -> None:
        self.simulate, self.flags = simulate, flags
        self.proc: subprocess.Popen | None = None
        # its log goes to a file, not a pipe: a pipe nobody reads fills (64 KiB) and the server's next
        # line would block it mid-request. Written in append mode through a file of its own, read through
        # another: a shared offset would let our reads move where the server writes. The name is never
        # opened again (the reader comes through /proc/self/fd), so nobody can swap the file under it
        fd, path = tempfile.mkstemp(prefix="gpucr-bench-serve-", suffix=".log")   # 0600, O_EXCL
        os.unlink(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._log_w, self._log_r = open(fd, "ab"), open(f"/proc/self/fd/{fd}", "rb")
        # both stay open while the method lives (read after its server stopped), then close
        weakref.finalize(self, lambda *fs: [f.close() for f in fs], self._log_w, self._log_r)

    def ensure(self) -> None:
        from ..server import client
        if self.proc is not None and self.proc.poll() is None:
            return
        if client.info(self.simulate) is not None:
            raise GpucrError("a gpucr server already runs: stop it ('gpucr serve --stop') so the bench knows what it measures")
        argv = [sys.executable, "-m", "gpucr.cli", "serve", *self.flags] + (["--simulate"] if self.simulate else [])
        self._log_w.truncate(0)   # a new server logs afresh
        self._log_r.seek(0)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log_w)
        deadline = time.monotonic() + 120
        while client.info(self.simulate) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = " ".join(line.strip() for line in self.log_since()[-5:])
                raise GpucrError(f"gpucr serve did not start: {said}")
            time.sleep(0.05)

    def log_since(self) -> list[str]:
        """The server's log lines written since the last call (the last LOG_LINES of them)."""
        return self._log_r.read().decode(errors="replace").splitlines()[-self.LOG_LINES:]

    def info(self) -> dict[str, Any] | None:
        from ..server import client
        return client.info(self.simulate)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.proc = None   # its log stays readable until the next server starts


def agent_warmup() -> GpucrMethod:
    """The first checkpoint of a process under the agent prepares (faults in and pins) its staging."""
    return GpucrMethod("full", timeout=WARMUP_TIMEOUT_S)


class TmsMethod(Method):
    """torch_memory_saver, the peer: a workload process of its own (gpucr.workloads.tms_app, started
    with the package's hook library preloaded) whose raw buffer, or weights and KV cache, are in one
    region with CPU backup kept between cycles; pause and resume are asked of the application over
    its protocol and timed inside it (app_out_s / app_in_s, on which its GB/s are computed) and from
    here (checkpoint_s / restore_s, the request's round trip as well)."""
    name = "torch-memory-saver"
    own_job = True
    in_app = True

    def __init__(self, simulate: bool) -> None:
        self.simulate = simulate
        self.job: Job | None = None
        self.probed: dict[str, str] | str | None = None   # the probe's answer, or why it failed

    def unavailable(self, spec: Spec) -> str | None:
        if self.simulate:
            return "needs torch and torch_memory_saver on a real GPU"
        if spec.module not in tms_app.APPS or spec.launch != "single":
            return "runs on the single-GPU workloads only (raw:GIB and the LLM servers)"
        probed = self.probe()
        return probed if isinstance(probed, str) else None

    def probe(self) -> dict[str, str] | str:
        """Once a run: the hook library to preload (asked of a child, which imports torch), or why
        torch_memory_saver cannot run here."""
        if self.probed is None:
            r = subprocess.run([sys.executable, "-m", "gpucr.workloads.tms_app", "--probe"], capture_output=True,
                               text=True, env=plain_env(self.simulate), timeout=600)
            if r.returncode == 0:
                self.probed = json.loads(r.stdout.strip().splitlines()[-1])
            else:
                said = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                self.probed = f"torch_memory_saver cannot be used here ({said})"
        return self.probed

    def workload(self, spec: Spec) -> tuple[str, list[str], dict[str, str]]:
        probed = self.probe()
        if isinstance(probed, str):
            raise GpucrError(probed)
        preload = ":".join(p for p in (probed["preload"], os.environ.get("LD_PRELOAD")) if p)
        return "tms_app", [spec.module, *spec.args], {"LD_PRELOAD": preload}

    def bind(self, job: Job) -> None:
        self.job = job

    def warmup(self) -> Method:
        return self     # the first pause pins the CPU backup, which later ones reuse

    def _ask(self, verb: str, step: str) -> dict[str, Any]:
        if self.job is None:
            raise GpucrError(f"{self.name}: no workload process to ask")
        a = self.job.ask(verb)
        return {"steps_s": {step: a["seconds"]}, "bytes_moved": a["bytes"]}

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return self._ask("tms_pause", "pause")

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return self._ask("tms_resume", "resume")


class ServerMethod(Method):
    """gpucr through its server (`gpucr serve`, started for this method): the server's data plane copies
    the data while the driver takes the control state, side by side (docs/server.md). Its first cycle,
    which pins the staging in the server, is its warm-up, reported apart."""
    under_agent = True
    splits = True

    def __init__(self, level: str, simulate: bool, timeout: float = STEP_TIMEOUT_S, routes: bool = True,
                 scan: bool = True) -> None:
        self.level, self.timeout, self.scan = level, timeout, scan
        # scan off: 'gpucr-server-plain', the same path with issue 26's two parts off (checkpoint --no-scan): zero
        # chunks cross the link and nothing is checked, to set beside gpucr-server-full in one run
        self.name = f"gpucr-server-{level}" + ("" if routes else "-one-link") if scan else "gpucr-server-plain"
        # routes off: only the process's own GPU's host link, to set beside the routes through idle NVLink
        # neighbours on a machine that has them (on one GPU both are the same)
        self._srv = _BenchServer(simulate, *([] if routes else ["--no-routes"]))

    def warmup(self) -> Method:
        return self   # its first cycle pins the process's staging in the server: later ones reuse it

    def _api(self):
        from ..server import route
        if route.server_wanted() is False:
            raise GpucrError(f"{self.name} needs the server: unset GPUCR_NO_SERVER")
        self._srv.ensure()
        return route

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return combine(self._api().checkpoint_many(pids, level=self.level, timeout=WARMUP_TIMEOUT_S,
                                                   scan=self.scan).processes)

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return combine(self._api().restore_many(pids, timeout=WARMUP_TIMEOUT_S).processes)

    def close(self) -> None:
        self._srv.close()

    def server_log(self) -> list[str] | None:
        return self._srv.log_since()


class ServerImageMethod(ServerMethod):
    """gpucr-server-image: `checkpoint --image DIR` then `restore --image DIR` through the server, each
    process's image in a new directory of its own under --image-dir, removed after each cycle, outside its timings
    (a run of several cycles never holds more than one image per process on the disk)."""
    name = "gpucr-server-image"

    def __init__(self, simulate: bool, image_dir: str | Path, timeout: float = STEP_TIMEOUT_S) -> None:
        super().__init__("full", simulate, timeout)
        self.name, self.image_dir = ServerImageMethod.name, Path(image_dir)   # not the level's name
        self.dirs: dict[int, str] = {}

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        self._remove()
        self.dirs = {p: tempfile.mkdtemp(prefix=f"gpucr-bench-image-{p}-", dir=self.image_dir) for p in pids}
        try:
            rs = self._api().checkpoint_many(pids, level=self.level, timeout=WARMUP_TIMEOUT_S, images=self.dirs)
        except BaseException:
            self._remove()   # nothing checkpointed: the processes run on, their images are of no use
            raise
        return combine(rs.processes)

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return combine(self._api().restore_many(pids, timeout=WARMUP_TIMEOUT_S, images=self.dirs).processes)

    def after_cycle(self) -> None:
        # not inside the restore's time: deleting a 27 GiB image took ~4 s on the H100 host, which the restore then
        # counted (16.5 s against its 12.6 s of phases)
        self._remove()

    def _remove(self) -> None:
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = {}

    def close(self) -> None:
        self._remove()
        super().close()


class ServerMapMethod(ServerMethod):
    """gpucr-server-map: restored with `--map` naming every GPU of the machine onto itself, through the
    server (on one GPU only the identity map exists; it takes the path of a restore onto other GPUs)."""

    name = "gpucr-server-map"

    def __init__(self, drv: Driver, simulate: bool, timeout: float = STEP_TIMEOUT_S) -> None:
        super().__init__("full", simulate, timeout)
        self.name, self.drv = ServerMapMethod.name, drv   # not the level's name

    def identity_map(self) -> dict[str, str]:
        """Every GPU of the machine onto itself, as --map names them (gpus.machine_gpus, as the restore checks it)."""
        return {g.uuid: g.uuid for g in gpus.machine_gpus(self.drv)}

    def restore(self, pids: list[int]) -> dict[str, Any]:
        gpu_map = self.identity_map()
        out = combine(self._api().restore_many(pids, timeout=WARMUP_TIMEOUT_S, gpu_map=gpu_map).processes)
        return {**out, "gpu_map": gpu_map}


METHODS = ("ceiling", "driver", "driver-fresh", "gpucr-full", "gpucr-data", "driver-nop2p", "gpucr-cli", "gpucr-cli-server",
           "torch-memory-saver", "gpucr-server-full", "gpucr-server-data", "gpucr-server-full-one-link",
           "gpucr-server-image", "gpucr-server-map", "gpucr-server-plain")
# the server's path is what `gpucr run` users get: it is in the default, beside the server-less one
DEFAULT_METHODS = METHODS[:5] + ("gpucr-server-full", "gpucr-server-data")
JOB_METHODS = ("ceiling", "driver", "driver-nop2p", "gpucr-full", "gpucr-data")   # the default for multi-GPU jobs


def make(name: str, drv: Driver, simulate: bool, deadline: float = 600.0, image_dir: str | Path = "/var/tmp") -> Method:
    if name == "driver":
        return DriverMethod(drv, deadline)
    if name == "driver-nop2p":
        return DriverMethod(drv, deadline, nop2p=True)
    if name == "driver-fresh":
        return FreshDriverMethod(drv, plain_env(simulate), deadline)
    if name in ("gpucr-full", "gpucr-data"):
        return GpucrMethod(name.split("-", 1)[1])
    if name in ("gpucr-cli", "gpucr-cli-server"):
        return CliMethod(name.endswith("-server"), simulate)
    if name in ("gpucr-server-full", "gpucr-server-data"):
        return ServerMethod(name.rsplit("-", 1)[1], simulate)
    if name == "gpucr-server-full-one-link":
        return ServerMethod("full", simulate, routes=False)
    if name == "gpucr-server-plain":
        return ServerMethod("full", simulate, scan=False)
    if name == ServerImageMethod.name:
        return ServerImageMethod(simulate, image_dir)
    if name == ServerMapMethod.name:
        return ServerMapMethod(drv, simulate)
    if name == "torch-memory-saver":
        return TmsMethod(simulate)
    raise GpucrError(f"unknown method '{name}': use some of {', '.join(METHODS)}")


def timed_cycle(method: Method, pids: list[int], read_used, park_s: float = 0.0) -> tuple[dict, dict, int | None]:
    """Checkpoint, read GPU memory while checkpointed, stay parked park_s, restore; wall times around each call.
    Parked for a while, the restore meets a card whose driver has finished its own work on the memory the
    checkpoint freed (measured on the H200: a copy into memory made at once runs at 48-49 GB/s, 53-55 a second later)."""
    t0 = time.perf_counter()
    ck = method.checkpoint(pids)
    ck["wall_s"] = time.perf_counter() - t0
    used = read_used()
    if park_s:
        time.sleep(park_s)
    t0 = time.perf_counter()
    rs = method.restore(pids)
    rs["wall_s"] = time.perf_counter() - t0
    method.after_cycle()
    return ck, rs, used
