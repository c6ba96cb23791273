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
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import gpucr

from .. import paths
from ..driver import Driver
from ..errors import GpucrError
from ..workloads.llm_app import MODELS
from ..workloads import runner
from ..workloads.runner import Workload

GENERATE_TOKENS = 32
STEP_TIMEOUT_S = 30.0       # gate drain and each driver step; the copies take what they take
WARMUP_TIMEOUT_S = 600.0    # the first gpucr checkpoint also prepares (faults in and pins) its staging


@dataclass(frozen=True)
class Spec:
    """One workload of the bench: 'llama3-8b' (an LLM server) or 'raw:8' (8 GiB raw buffer)."""
    name: str
    module: str
    args: tuple[str, ...]
    llm: bool


def parse_workload(text: str, gpu_util: float) -> Spec:
    text = text.strip()
    if text in MODELS:
        return Spec(text, "llm_app", (text, "--gpu-util", str(gpu_util)), True)
    if text.startswith("raw:"):
        try:
            gib = float(text[4:])
        except ValueError:
            gib = -1.0
        if gib > 0:
            return Spec(text, "raw_app", ("--gib", str(gib)), False)
    raise GpucrError(f"unknown workload '{text}': use raw:GIB or one of {', '.join(MODELS)}")


# ---- workload processes ----

def plain_env(simulate: bool) -> dict[str, str]:
    """run_env without the agent (the driver's own checkpoint must see the application as it is)."""
    return runner.plain_env(simulate)


class PlainWorkload(Workload):
    """A workload process started without gpucr's agent; asked and closed like any Workload."""

    def __init__(self, module: str, *args: str, simulate: bool = False) -> None:
        super().__init__(module, *args, simulate=simulate, agent=False)


def start(spec: Spec, under_agent: bool, simulate: bool, agent_env: dict[str, str] | None = None) -> Workload:
    if under_agent:
        return Workload(spec.module, *spec.args, simulate=simulate, env={**os.environ, **(agent_env or {})})
    return PlainWorkload(spec.module, *spec.args, simulate=simulate)


def observe(w: Workload, spec: Spec) -> dict[str, Any]:
    """What must be the same after a restore: every byte and address, and the next tokens."""
    d = w.ask("digest")
    seen = {"digest": d["digest"], "ptrs": d["ptrs"]}
    if spec.llm:
        seen["tokens"] = w.ask(f"generate {GENERATE_TOKENS}")["tokens"]
    return seen


def compare(ref: dict[str, Any], now: dict[str, Any]) -> dict[str, bool]:
    return {k: ref[k] == now.get(k) for k in ref}


# ---- methods ----

class Method:
    name = ""
    under_agent = False
    splits = False         # whether data and control are timed apart
    agent_env: dict[str, str] = {}   # settings the agent reads at start: such methods get a process of their own

    def checkpoint(self, pid: int) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, pid: int) -> dict[str, Any]:
        raise NotImplementedError


def _timed(steps: dict[str, float], name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    fn(*args)
    steps[name] = time.perf_counter() - t0


class DriverMethod(Method):
    """The driver's own checkpoint, through one persistent, initialised controller."""
    name = "driver"

    def __init__(self, drv: Driver) -> None:
        self.drv = drv

    def checkpoint(self, pid: int) -> dict[str, Any]:
        steps: dict[str, float] = {}
        _timed(steps, "lock", self.drv.lock, pid, int(STEP_TIMEOUT_S * 1000))
        _timed(steps, "checkpoint", self.drv.checkpoint, pid)
        return {"steps_s": steps}

    def restore(self, pid: int) -> dict[str, Any]:
        steps: dict[str, float] = {}
        _timed(steps, "restore", self.drv.restore, pid)
        _timed(steps, "unlock", self.drv.unlock, pid)
        return {"steps_s": steps}


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

    def __init__(self, drv: Driver, env: dict[str, str]) -> None:
        super().__init__(drv)
        self.env = env

    def _act(self, action: str, pid: int) -> None:
        timeout_ms = int(STEP_TIMEOUT_S * 1000) if action == "Lock" else 0   # other args must be all zero
        out = subprocess.run([sys.executable, "-c", _FRESH, self.drv.path, action, str(pid), str(timeout_ms)],
                             capture_output=True, text=True, env=self.env, timeout=3600)
        rc = out.stdout.strip()
        if out.returncode != 0 or rc != "0":
            raise GpucrError(f"driver {action.lower()} of process {pid} in a fresh process failed: "
                             f"{rc or out.stderr.strip()[-300:]}")

    def checkpoint(self, pid: int) -> dict[str, Any]:
        steps: dict[str, float] = {}
        _timed(steps, "lock", self._act, "Lock", pid)
        _timed(steps, "checkpoint", self._act, "Checkpoint", pid)
        return {"steps_s": steps}

    def restore(self, pid: int) -> dict[str, Any]:
        steps: dict[str, float] = {}
        _timed(steps, "restore", self._act, "Restore", pid)
        _timed(steps, "unlock", self._act, "Unlock", pid)
        return {"steps_s": steps}


class GpucrMethod(Method):
    """gpucr: the agent moves the data; at level full the driver then takes the control state.
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

    def checkpoint(self, pid: int) -> dict[str, Any]:
        if self.unpin:
            with _env("GPUCR_UNPIN_FOR_DRIVER", "1"):
                r = gpucr.checkpoint(pid, level=self.level, timeout=self.timeout)
        else:
            r = gpucr.checkpoint(pid, level=self.level, timeout=self.timeout)
        return {"steps_s": r["phases_s"], "agent_ms": r["agent_ms"], "bytes_moved": r["bytes_moved"],
                "bytes_left_to_driver": r["bytes_left_to_driver"]}

    def restore(self, pid: int) -> dict[str, Any]:
        r = gpucr.restore(pid, timeout=self.timeout)
        return {"steps_s": r["phases_s"], "bytes_moved": r.get("bytes_moved", 0), "agent_ms": r.get("agent_ms", {})}


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


METHODS = ("ceiling", "driver", "driver-fresh", "gpucr-full", "gpucr-data", "gpucr-full-pinned", "gpucr-full-unpinned")
DEFAULT_METHODS = METHODS[:5]


def make(name: str, drv: Driver, simulate: bool) -> Method:
    if name == "driver":
        return DriverMethod(drv)
    if name == "driver-fresh":
        return FreshDriverMethod(drv, plain_env(simulate))
    if name in ("gpucr-full", "gpucr-data"):
        return GpucrMethod(name.split("-", 1)[1])
    if name == "gpucr-full-pinned":
        return GpucrMethod("full", pinned=True)
    if name == "gpucr-full-unpinned":
        return GpucrMethod("full", unpin=True)
    raise GpucrError(f"unknown method '{name}': use some of {', '.join(METHODS)}")


def timed_cycle(method: Method, pid: int, read_used) -> tuple[dict, dict, int | None]:
    """Checkpoint, read GPU memory while checkpointed, restore; wall times around each call."""
    t0 = time.perf_counter()
    ck = method.checkpoint(pid)
    ck["wall_s"] = time.perf_counter() - t0
    used = read_used()
    t0 = time.perf_counter()
    rs = method.restore(pid)
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
    GPU footprint (as nvidia-smi counts it)."""
    cs, rsteps = ck["steps_s"], rs["steps_s"]
    row: dict[str, Any] = {"checkpoint_s": ck["wall_s"], "restore_s": rs["wall_s"]}
    if method.splits:
        am = ck["agent_ms"]
        row.update(gate_sync_s=(am["gate"] + am["sync"]) / 1000, data_out_s=cs["data_out"],
                   control_out_s=(cs["driver_lock"] + cs["control_out"]) if "control_out" in cs else None,
                   control_in_s=(rsteps["control_in"] + rsteps.get("driver_unlock", 0.0)) if "control_in" in rsteps else None,
                   data_in_s=rsteps["data_in"], driver_out_s=None, driver_in_s=None,
                   bytes_out=ck["bytes_moved"], bytes_in=rs["bytes_moved"],
                   bytes_left_to_driver=ck["bytes_left_to_driver"], agent_ms=am,
                   pin_wait_s=rs.get("agent_ms", {}).get("pin_wait", 0.0) / 1000)
        out_s, in_s = row["data_out_s"], row["data_in_s"]
    else:
        row.update(gate_sync_s=None, data_out_s=None, control_out_s=None, control_in_s=None, data_in_s=None,
                   driver_out_s=cs["lock"] + cs["checkpoint"], driver_in_s=rsteps["restore"] + rsteps["unlock"],
                   bytes_out=footprint, bytes_in=footprint, bytes_left_to_driver=footprint)
        out_s, in_s = row["driver_out_s"], row["driver_in_s"]
    row["steps_s"] = {"checkpoint": cs, "restore": rsteps}
    row["gbps_out"], row["gbps_in"] = _gbps(row["bytes_out"], out_s), _gbps(row["bytes_in"], in_s)
    c = ceiling or {}
    row["ceiling_share_out"] = _ratio(row["gbps_out"], c.get("d2h_gbps"))
    row["ceiling_share_in"] = _ratio(row["gbps_in"], c.get("h2d_gbps"))
    return row


SUMMARY_KEYS = ("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s", "driver_out_s",
                "driver_in_s", "checkpoint_s", "restore_s", "bytes_out", "bytes_in", "gbps_out", "gbps_in",
                "ceiling_share_out", "ceiling_share_in", "gpu_held_checkpointed_bytes")


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


def _ceiling_child(gib: float, repeat: int = 3) -> dict[str, Any]:
    """Driver API through ctypes (the same bindings as driver_app), so it runs on simcuda too."""
    from ..workloads import driver_app as d
    n = int(gib * (1 << 30))
    host_alloc = d._sig("cuMemHostAlloc", ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
    free_host = d._sig("cuMemFreeHost", ctypes.c_void_p)
    d.check(d.cuInit(0), "cuInit")
    ctx = ctypes.c_void_p()
    d.check(d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "context")
    d.check(d.cuCtxSetCurrent(ctx), "set context")
    dev, host = ctypes.c_uint64(), ctypes.c_void_p()
    d.check(d.cuMemAlloc(ctypes.byref(dev), n), "device buffer")
    t0 = time.perf_counter()
    d.check(host_alloc(ctypes.byref(host), n, 0), "pinned host buffer")
    pin_s = time.perf_counter() - t0
    d.check(d.cuMemcpyDtoH(host, dev.value, n), "D2H")   # untimed: first-use costs are not the rate
    d.check(d.cuMemcpyHtoD(dev.value, host, n), "H2D")
    d2h, h2d = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        d.check(d.cuMemcpyDtoH(host, dev.value, n), "D2H")
        d2h.append(n / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        d.check(d.cuMemcpyHtoD(dev.value, host, n), "H2D")
        h2d.append(n / (time.perf_counter() - t0) / 1e9)
    d.check(free_host(host), "free host")
    d.check(d.cuMemFree(dev.value), "free device")
    return {"bytes": n, "d2h_gbps": statistics.median(d2h), "h2d_gbps": statistics.median(h2d),
            "samples": {"d2h_gbps": d2h, "h2d_gbps": h2d}, "pin_s": pin_s, "simulated": d.SIM,
            "how": "one cuMemcpyDtoH/HtoD of a cuMemHostAlloc (pinned) buffer, driver API, default stream"}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "ceiling":
        print(json.dumps(_ceiling_child(float(sys.argv[2]))))
    else:
        sys.exit("usage: python3 -m gpucr.bench.methods ceiling GIB")
