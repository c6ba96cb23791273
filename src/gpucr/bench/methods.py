"""What `gpucr bench` compares, and on what.

Workloads are the protocol-speaking apps of gpucr.workloads, started either under gpucr's agent
(for gpucr's methods) or as plain processes (for the driver's own checkpoint, which must see the
application exactly as it would without gpucr). Methods each checkpoint and restore one process
and return the time of every step; `metrics` turns one cycle into the uniform row the report
reads. The pinned-copy ceiling runs in a child process of its own (`python3 -m
gpucr.bench.methods ceiling GIB`), so its memory is gone before any workload starts.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ..coordinator import checkpoint_many, restore_many
from ..driver import Driver
from ..errors import GpucrError
from ..results import ProcessCheckpoint, ProcessRestore
from ..workloads.llm_app import MODELS
from ..workloads import runner, tms_app
from ..workloads.job import Job

GENERATE_TOKENS = 32
STEP_TIMEOUT_S = 30.0       # gate drain and each driver step; the copies take what they take
WARMUP_TIMEOUT_S = 600.0    # the first gpucr checkpoint also prepares (faults in and pins) its staging


@dataclass(frozen=True)
class Spec:
    """One workload of the bench: 'llama3-8b' (an LLM server), 'raw:8' (8 GiB raw buffer), or a
    multi-GPU job: 'tp2-llama3-8b' (tensor parallel over two ranks, started by torchrun),
    'pp2-llama3-8b' (pipeline parallel, two ranks), '2gpu-llama3-8b' (one process on two GPUs)."""
    name: str
    module: str
    args: tuple[str, ...]
    llm: bool
    launch: str = "single"     # workloads.job.LAUNCHES
    world: int = 1

    @property
    def nccl(self) -> bool:
        return self.module in ("tp_app", "pp_app")

    @property
    def gpus(self) -> int:
        return 2 if self.module == "two_gpu_app" else self.world


# prefix -> (module, launch, ranks): the multi-GPU jobs, each of a Llama-architecture model of MODELS
JOBS = {"tp2": ("tp_app", "torchrun", 2), "pp2": ("pp_app", "torchrun", 2), "2gpu": ("two_gpu_app", "single", 1)}
# NCCL as docs/nccl.md says gpucr runs it; the driver's own path gets the same, so both see one job
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NO_FAST_TRANSPORTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def parse_workload(text: str, gpu_util: float) -> Spec:
    text = text.strip()
    if text in MODELS:
        return Spec(text, "llm_app", (text, "--gpu-util", str(gpu_util)), True)
    prefix, _, model = text.partition("-")
    if prefix in JOBS and model in MODELS:
        if MODELS[model][0] != "llama":
            raise GpucrError(f"workload '{text}': the multi-GPU jobs take a Llama-architecture model (llama3-8b)")
        module, launch, world = JOBS[prefix]
        return Spec(text, module, ("--model", model, "--gpu-util", str(gpu_util)), True, launch, world)
    if text.startswith("raw:"):
        try:
            gib = float(text[4:])
        except ValueError:
            gib = -1.0
        if gib > 0:
            return Spec(text, "raw_app", ("--gib", str(gib)), False)
    raise GpucrError(f"unknown workload '{text}': use raw:GIB, one of {', '.join(MODELS)}, "
                     f"or a multi-GPU job {'|'.join(JOBS)}-MODEL (e.g. tp2-llama3-8b)")


# ---- workload processes ----

def plain_env(simulate: bool) -> dict[str, str]:
    """run_env without the agent (the driver's own checkpoint must see the application as it is)."""
    return runner.plain_env(simulate)


def start(spec: Spec, method: "Method", simulate: bool) -> Job:
    """The workload's process(es) for `method`, as one Job (one process for the single-GPU workloads)."""
    module, args, own_env = method.workload(spec)
    env = {**(NCCL_ENV if spec.nccl else {}), **os.environ, **method.agent_env, **method.job_env, **own_env}
    return Job(module, args, launch=spec.launch, world=spec.world, env=env, agent=method.under_agent,
               simulate=simulate)


def observe(w: Job, spec: Spec) -> dict[str, Any]:
    """What must be the same after a restore: every rank's bytes and addresses, and the next tokens."""
    d = w.ask("digest")
    seen = {"digest": [r["digest"] for r in d["ranks"]], "ptrs": [r["ptrs"] for r in d["ranks"]]}
    if spec.llm:
        seen["tokens"] = [r["tokens"] for r in w.ask(f"generate {GENERATE_TOKENS}")["ranks"]]
    return seen


def compare(ref: dict[str, Any], now: dict[str, Any]) -> dict[str, bool]:
    return {k: ref[k] == now.get(k) for k in ref}


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
        from .. import coordinator
        try:
            return sum(coordinator.status(p).staging_bytes for p in pids)
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


def combine(results: list[ProcessCheckpoint] | list[ProcessRestore]) -> dict[str, Any]:
    """The job's view of gpucr's per-process results: the processes go through each phase together,
    so a phase takes as long as its slowest process; bytes add up. (The bench file's schema,
    gpucr-bench/1, keeps the agent's times in milliseconds.)"""
    steps: dict[str, float] = {}
    agent_ms: dict[str, float] = {}
    routes: dict[str, int] = {}
    for r in results:
        for k, v in r.phases_s.items():
            steps[k] = max(steps.get(k, 0.0), v)
        for k, v in r.agent_phases_s.items():
            agent_ms[k] = max(agent_ms.get(k, 0.0), v * 1000)
        for k, v in r.routes.items():
            routes[k] = routes.get(k, 0) + v
    return {"steps_s": steps, "agent_ms": agent_ms, "bytes_moved": sum(r.bytes_moved for r in results),
            "bytes_left_to_driver": sum(getattr(r, "bytes_left_to_driver", 0) for r in results),
            "warnings": [w for r in results for w in r.warnings], "routes": routes,
            # which plane moved the job's data: "server", "agent", or both ("agent+server")
            "data_plane": "+".join(sorted({r.data_plane for r in results}))}


class GpucrMethod(Method):
    """gpucr: the agent moves the data; at level full the driver then takes the control state; all
    processes of a job at once (coordinator.checkpoint_many / restore_many).
    By default staging stays unpinned and the copies go through the agent's pinned bounce ring.
    pinned: the ablation 'gpucr-full-pinned', the ring off (GPUCR_BOUNCE_MIB=0) and staging pinned,
    in a process of its own; unpin: 'gpucr-full-unpinned', pinned staging unpinned for the driver's
    checkpoint and pinned again during the restore's copies (GPUCR_UNPIN_FOR_DRIVER=1)."""
    under_agent = True
    splits = True

    def __init__(self, level: str, timeout: float = STEP_TIMEOUT_S, pinned: bool = False, unpin: bool = False) -> None:
        self.level = level
        self.name = f"gpucr-{level}" + ("-unpinned" if unpin else "-pinned" if pinned else "")
        self.timeout = timeout
        self.unpin = unpin
        self.agent_env = {"GPUCR_BOUNCE_MIB": "0"} if pinned or unpin else {}

    def warmup(self) -> Method:
        return agent_warmup()

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        if self.unpin:
            with _env("GPUCR_UNPIN_FOR_DRIVER", "1"):
                rs = checkpoint_many(pids, level=self.level, timeout=self.timeout)
        else:
            rs = checkpoint_many(pids, level=self.level, timeout=self.timeout)
        return combine(rs.processes)

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return combine(restore_many(pids, timeout=self.timeout).processes)


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
        if spec.module not in tms_app.APPS:
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

    def __init__(self, level: str, simulate: bool, timeout: float = STEP_TIMEOUT_S, ahead: bool = False,
                 routes: bool = True) -> None:
        self.level, self.timeout, self.ahead = level, timeout, ahead
        self.name = f"gpucr-server-{level}" + ("-ahead" if ahead else "") + ("" if routes else "-one-link")
        # routes off: only the process's own GPU's host link, to set beside the routes through idle NVLink
        # neighbours on a machine that has them (on one GPU both are the same)
        self._srv = _BenchServer(simulate, *([] if routes else ["--no-routes"]))
        # ahead: staging prepared by the agent as the process starts and pinned by the server meanwhile, as
        # `gpucr run` does with a server; the first checkpoint waits until both are done (prepared_ahead_s)
        # and is then the one to compare with the later ones (issue 13: within 1.2x)
        self.agent_env = {"GPUCR_STAGING_AHEAD": "1"} if ahead else {}
        self.prepared_ahead_s: float | None = None

    def warmup(self) -> Method:
        return self   # its first cycle pins the process's staging in the server: later ones reuse it

    def _api(self):
        from ..server import route
        if route.server_wanted() is False:
            raise GpucrError(f"{self.name} needs the server: unset GPUCR_NO_SERVER")
        self._srv.ensure()
        return route

    def before_first(self, pids: list[int]) -> None:
        if self.ahead and self.prepared_ahead_s is None:
            self.prepared_ahead_s = self._wait_prepared(self._api(), pids)

    def checkpoint(self, pids: list[int]) -> dict[str, Any]:
        return combine(self._api().checkpoint_many(pids, level=self.level, timeout=WARMUP_TIMEOUT_S).processes)

    def _wait_prepared(self, route, pids: list[int]) -> float:
        """Seconds from the first look until every process's staging covers its data and the server has it
        all pinned (at most WARMUP_TIMEOUT_S, then the checkpoint goes on and pays the rest)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < WARMUP_TIMEOUT_S:
            sts = [route.status(p) for p in pids]
            info = self._srv.info() or {}
            staged = sum(st.staging_bytes for st in sts)
            if (all(st.staging_bytes >= st.allocations.tracked_bytes for st in sts)
                    and info.get("pinned_staging_bytes", 0) >= staged):
                break
            time.sleep(0.5)
        return time.perf_counter() - t0

    def restore(self, pids: list[int]) -> dict[str, Any]:
        return combine(self._api().restore_many(pids, timeout=WARMUP_TIMEOUT_S).processes)

    def close(self) -> None:
        self._srv.close()

    def server_log(self) -> list[str] | None:
        return self._srv.log_since()


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


METHODS = ("ceiling", "driver", "driver-fresh", "gpucr-full", "gpucr-data", "gpucr-full-pinned", "gpucr-full-unpinned",
           "driver-nop2p", "gpucr-cli", "gpucr-cli-server", "torch-memory-saver", "gpucr-server-full", "gpucr-server-data",
           "gpucr-server-full-ahead", "gpucr-server-full-one-link")
# the server's path is what `gpucr run` users get: it is in the default, beside the in-process one
DEFAULT_METHODS = METHODS[:5] + ("gpucr-server-full", "gpucr-server-data")
JOB_METHODS = ("ceiling", "driver", "driver-nop2p", "gpucr-full", "gpucr-data")   # the default for multi-GPU jobs


def make(name: str, drv: Driver, simulate: bool, deadline: float = 600.0) -> Method:
    if name == "driver":
        return DriverMethod(drv, deadline)
    if name == "driver-nop2p":
        return DriverMethod(drv, deadline, nop2p=True)
    if name == "driver-fresh":
        return FreshDriverMethod(drv, plain_env(simulate), deadline)
    if name in ("gpucr-full", "gpucr-data"):
        return GpucrMethod(name.split("-", 1)[1])
    if name == "gpucr-full-pinned":
        return GpucrMethod("full", pinned=True)
    if name == "gpucr-full-unpinned":
        return GpucrMethod("full", unpin=True)
    if name in ("gpucr-cli", "gpucr-cli-server"):
        return CliMethod(name.endswith("-server"), simulate)
    if name in ("gpucr-server-full", "gpucr-server-data"):
        return ServerMethod(name.rsplit("-", 1)[1], simulate)
    if name == "gpucr-server-full-ahead":
        return ServerMethod("full", simulate, ahead=True)
    if name == "gpucr-server-full-one-link":
        return ServerMethod("full", simulate, routes=False)
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
    return ck, rs, used


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds else None


def _ratio(x: float | None, ceiling: float | None) -> float | None:
    return x / ceiling if x and ceiling else None


def metrics(method: Method, ck: dict, rs: dict, footprint: int | None, ceiling: dict | None) -> dict[str, Any]:
    """One cycle as the report's row: seconds per part, bytes, rates and their share of the ceiling.

    gpucr splits data (agent) from control (driver); the driver's own checkpoint does both in one
    step, so its time is driver_out_s / driver_in_s and the bytes it moved are the process's whole
    GPU footprint (as nvidia-smi counts it); the peer pauses its region inside the application, so
    its time is app_out_s / app_in_s and its bytes the region's."""
    cs, rsteps = ck["steps_s"], rs["steps_s"]
    row: dict[str, Any] = {"checkpoint_s": ck["wall_s"], "restore_s": rs["wall_s"],
                           **dict.fromkeys(("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s",
                                            "driver_out_s", "driver_in_s", "app_out_s", "app_in_s"))}
    if method.in_app:
        row.update(app_out_s=cs["pause"], app_in_s=rsteps["resume"], bytes_out=ck["bytes_moved"],
                   bytes_in=rs["bytes_moved"], bytes_left_to_driver=None)
        out_s, in_s = row["app_out_s"], row["app_in_s"]
    elif method.splits:
        am = ck["agent_ms"]
        row.update(gate_sync_s=(am["gate"] + am["sync"]) / 1000, data_out_s=cs["data_out"],
                   control_out_s=(cs["driver_lock"] + cs["control_out"]) if "control_out" in cs else None,
                   control_in_s=(rsteps["control_in"] + rsteps.get("driver_unlock", 0.0)) if "control_in" in rsteps else None,
                   data_in_s=rsteps["data_in"], bytes_out=ck["bytes_moved"], bytes_in=rs["bytes_moved"],
                   bytes_left_to_driver=ck["bytes_left_to_driver"], agent_ms=am,
                   pin_wait_s=rs.get("agent_ms", {}).get("pin_wait", 0.0) / 1000,
                   data_plane={"checkpoint": ck.get("data_plane"), "restore": rs.get("data_plane")})
        out_s, in_s = row["data_out_s"], row["data_in_s"]
    else:
        row.update(driver_out_s=cs["lock"] + cs["checkpoint"], driver_in_s=rsteps["restore"] + rsteps["unlock"],
                   bytes_out=footprint, bytes_in=footprint, bytes_left_to_driver=footprint)
        out_s, in_s = row["driver_out_s"], row["driver_in_s"]
    row["steps_s"] = {"checkpoint": cs, "restore": rsteps}
    if ck.get("routes") or rs.get("routes"):   # bytes through each NVLink neighbour's link (the server's routes)
        row["routes_bytes"] = {"checkpoint": ck.get("routes", {}), "restore": rs.get("routes", {})}
    row["gbps_out"], row["gbps_in"] = _gbps(row["bytes_out"], out_s), _gbps(row["bytes_in"], in_s)
    c = ceiling or {}
    row["ceiling_share_out"] = _ratio(row["gbps_out"], c.get("d2h_gbps"))
    row["ceiling_share_in"] = _ratio(row["gbps_in"], c.get("h2d_gbps"))
    return row


def per_gpu(row: dict[str, Any], method: Method, bytes_per_gpu: dict[str, int]) -> dict[str, Any]:
    """Each GPU's bytes over the job's data time (its ranks move their data at once), and the
    slowest GPU's rate, which bounds the job."""
    kind = "app" if method.in_app else "data" if method.splits else "driver"
    out_s, in_s = row[f"{kind}_out_s"], row[f"{kind}_in_s"]
    out = {"bytes_per_gpu": bytes_per_gpu,
           "gbps_out_per_gpu": {u: _gbps(b, out_s) for u, b in bytes_per_gpu.items()},
           "gbps_in_per_gpu": {u: _gbps(b, in_s) for u, b in bytes_per_gpu.items()}}
    for k in ("out", "in"):
        rates = [r for r in out[f"gbps_{k}_per_gpu"].values() if r]
        out[f"gbps_{k}_slowest_gpu"] = min(rates) if rates else None
    return out


SUMMARY_KEYS = ("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s", "driver_out_s",
                "driver_in_s", "app_out_s", "app_in_s", "checkpoint_s", "restore_s", "bytes_out", "bytes_in", "gbps_out", "gbps_in",
                "ceiling_share_out", "ceiling_share_in", "gpu_held_checkpointed_bytes", "gbps_out_slowest_gpu",
                "gbps_in_slowest_gpu", "staging_bytes")


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in SUMMARY_KEYS:
        vals = [s[k] for s in samples if s.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


# ---- the pinned-copy ceiling ----

def ceiling(simulate: bool, gib: float, timeout: float = 600.0) -> dict[str, Any]:
    """D2H and H2D GB/s of one pinned copy of GIB GiB, measured by a child process that then exits."""
    out = subprocess.run([sys.executable, "-m", "gpucr.bench.methods", "ceiling", str(gib)], capture_output=True,
                         text=True, env=plain_env(simulate), timeout=timeout)
    if out.returncode != 0:
        raise GpucrError(f"the pinned-copy ceiling could not be measured: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Link:
    """One GPU's pinned-copy path: a device buffer and a pinned host buffer of n bytes, through the
    driver API via ctypes (the same bindings as driver_app), so it runs on simcuda too."""

    def __init__(self, ordinal: int, n: int) -> None:
        from ..workloads import driver_app as d
        self.d, self.n = d, n
        self.host_alloc = d._sig("cuMemHostAlloc", ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
        self.free_host = d._sig("cuMemFreeHost", ctypes.c_void_p)
        d.check(d.cuInit(0), "cuInit")
        self.ctx = ctypes.c_void_p()
        d.check(d.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), ordinal), f"context on device {ordinal}")
        self.enter()
        self.dev, self.host = ctypes.c_uint64(), ctypes.c_void_p()
        d.check(d.cuMemAlloc(ctypes.byref(self.dev), n), f"device buffer on device {ordinal}")
        t0 = time.perf_counter()
        d.check(self.host_alloc(ctypes.byref(self.host), n, 0), "pinned host buffer")
        self.pin_s = time.perf_counter() - t0
        self.d2h()   # untimed: first-use costs are not the rate
        self.h2d()

    def enter(self) -> None:
        """Make this GPU's context current in the calling thread (contexts are per thread)."""
        self.d.check(self.d.cuCtxSetCurrent(self.ctx), "set context")

    def d2h(self) -> None:
        self.d.check(self.d.cuMemcpyDtoH(self.host, self.dev.value, self.n), "D2H")

    def h2d(self) -> None:
        self.d.check(self.d.cuMemcpyHtoD(self.dev.value, self.host, self.n), "H2D")

    def close(self) -> None:
        self.d.check(self.free_host(self.host), "free host")
        self.d.check(self.d.cuMemFree(self.dev.value), "free device")


HOW = "one cuMemcpyDtoH/HtoD of a cuMemHostAlloc (pinned) buffer, driver API, default stream"


def _ceiling_child(gib: float, repeat: int = 3) -> dict[str, Any]:
    link = _Link(0, int(gib * (1 << 30)))
    d2h, h2d = [], []
    for _ in range(repeat):
        for fn, rates in ((link.d2h, d2h), (link.h2d, h2d)):
            t0 = time.perf_counter()
            fn()
            rates.append(link.n / (time.perf_counter() - t0) / 1e9)
    link.close()
    return {"bytes": link.n, "d2h_gbps": statistics.median(d2h), "h2d_gbps": statistics.median(h2d),
            "samples": {"d2h_gbps": d2h, "h2d_gbps": h2d}, "pin_s": link.pin_s, "simulated": link.d.SIM, "how": HOW}


def _ceiling_all_child(gib: float, gpus: int, repeat: int = 3) -> dict[str, Any]:
    """Every GPU's link at once: one thread per GPU (ctypes lets the GIL go during each copy), all
    starting each copy together; per GPU its own rate, and the aggregate: all bytes over the time
    from the first start to the last end."""
    import threading
    links = [_Link(i, int(gib * (1 << 30))) for i in range(gpus)]
    barrier = threading.Barrier(gpus)
    spans: dict[tuple[str, int, int], tuple[float, float]] = {}

    def run(i: int) -> None:
        links[i].enter()
        for r in range(repeat):
            for name in ("d2h", "h2d"):
                barrier.wait()
                t0 = time.perf_counter()
                getattr(links[i], name)()
                spans[(name, r, i)] = (t0, time.perf_counter())
    threads = [threading.Thread(target=run, args=(i,)) for i in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = links[0].n
    out: dict[str, Any] = {"bytes_per_gpu": n, "gpus": gpus, "how": HOW + ", one thread per GPU, all at once",
                           "simulated": links[0].d.SIM, "per_gpu": []}
    for i in range(gpus):
        out["per_gpu"].append({f"{k}_gbps": statistics.median(n / (spans[(k, r, i)][1] - spans[(k, r, i)][0]) / 1e9
                                                             for r in range(repeat)) for k in ("d2h", "h2d")})
    for k in ("d2h", "h2d"):
        rounds = [[spans[(k, r, i)] for i in range(gpus)] for r in range(repeat)]
        out[f"aggregate_{k}_gbps"] = statistics.median(n * gpus / (max(e for _, e in sp) - min(b for b, _ in sp)) / 1e9
                                                       for sp in rounds)
    for link in links:
        link.close()
    return out


def ceiling_all(simulate: bool, gib: float, gpus: int, timeout: float = 600.0) -> dict[str, Any]:
    """The pinned-copy ceiling of every GPU's link at once, by a child process that then exits."""
    out = subprocess.run([sys.executable, "-m", "gpucr.bench.methods", "ceiling-all", str(gib), str(gpus)],
                         capture_output=True, text=True, env=plain_env(simulate), timeout=timeout)
    if out.returncode != 0:
        raise GpucrError(f"the pinned-copy ceiling of {gpus} GPUs at once could not be measured: "
                         f"{out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "ceiling":
        print(json.dumps(_ceiling_child(float(sys.argv[2]))))
    elif len(sys.argv) == 4 and sys.argv[1] == "ceiling-all":
        print(json.dumps(_ceiling_all_child(float(sys.argv[2]), int(sys.argv[3]))))
    else:
        sys.exit("usage: python3 -m gpucr.bench.methods ceiling GIB | ceiling-all GIB GPUS")
