"""`gpucr bench`: every method on every workload, side by side, in one invocation.

Per workload, the methods that need a plain process (the driver's own checkpoint) share one, and
gpucr's methods share one under the agent, after one warm-up cycle that prepares the agent's
staging (reported apart). Each cycle is checked: same bytes, same addresses, same next tokens.
The JSON is rewritten after every method, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import gpucr
from ..agent_tables import SETTINGS

from . import bounds as B
from . import methods as M
from . import rows as R
from . import specs as S
from . import report
from .compare import ceiling_of as _ceiling_of, derive
from ..demo import gpu_present
from ..doctor import meminfo
from ..driver import Driver, device_count, device_info, driver_for, gpu_memory
from ..dataplane.hostmem import HUGE_PAGE, add_hugepages, drop_hugepages
from ..errors import GpucrError
from ..paths import simcuda_dir

SCHEMA = "gpucr-bench/1"
SPEED_TOKENS = 128         # the generation timed for a job's serving speed
DEFAULT_WORKLOADS = "llama3-8b,phi4-mini,pythia-1b,qwen3-1.7b,raw:8"
SIMULATED_WORKLOADS = "raw:0.25"
SIMULATED_BANNER = ("SIMULATED: these numbers come from simcuda, a test double over host memory, not from a GPU. "
                    "They are NOT GPU results.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=None, metavar="LIST",
                   help=f"comma-separated, each {S.WORKLOADS} (default {DEFAULT_WORKLOADS}; {SIMULATED_WORKLOADS} "
                        "on simcuda, where the LLM servers, torch and JAX are skipped)")
    p.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated, of {','.join(M.METHODS)} (default {','.join(M.DEFAULT_METHODS)}; "
                        f"{','.join(M.JOB_METHODS)} when a multi-GPU job is among the workloads)")
    p.add_argument("--driver-deadline", type=float, default=600.0, metavar="SECONDS",
                   help="the driver's own path: a step not done by then is reported as hung and the job "
                        "is killed (default 600)")
    p.add_argument("--gpu-util", type=float, default=None, help="share of the GPU an LLM server may hold, "
                   "weights and KV cache (vLLM's --gpu-memory-utilization; default 0.5, 0.3 for --scenario swap)")
    p.add_argument("--repeat", type=int, default=3, help="timed cycles per method and workload (default 3)")
    p.add_argument("--park", type=float, default=0.0, metavar="SECONDS", help="seconds each timed cycle stays "
                   "checkpointed before its restore, as a parked process does (default 0: restored at once)")
    p.add_argument("--ceiling-gib", type=float, default=None, help="size of the pinned copy that measures the "
                   "ceiling (default 8; 0.25 on simcuda)")
    p.add_argument("--image-dir", default="/var/tmp", metavar="DIR",
                   help="where gpucr-server-image writes its images (each removed after its restore) and where the "
                        "disk's rate is measured, with as many bytes, to set them against (default /var/tmp)")
    p.add_argument("--out", default=None, metavar="JSON", help="results file (default gpucr-bench-DATE.json here)")
    p.add_argument("--chart", default=None, metavar="PNG", help="chart file (default: the results file with .png)")
    p.add_argument("--staging-hugepages", action="store_true",
                   help="as root, reserve 2 MiB hugepages for gpucr's staging while gpucr's methods run on a "
                        "workload (as many as the workload's footprint needs), and give them back after; the "
                        "driver's own methods run with ordinary memory, as they need it for their copy")
    p.add_argument("--simulate", action="store_true", help="use simcuda, the simulated driver (test double), "
                   "even if a GPU is present")


def _say(msg: str) -> None:
    print(f"gpucr bench: {msg}", file=sys.stderr, flush=True)


# ---- what the results were measured on ----

def _nvml_text(fn: str, *args: Any) -> str | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(256)
        if args:   # a device query: the handle first
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(args[0], ctypes.byref(h)) != 0:
                return None
            rc = getattr(lib, fn)(h, buf, 256)
        else:
            rc = getattr(lib, fn)(buf, 256)
        return buf.value.decode() if rc == 0 else None
    except OSError:
        return None


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(drv: Driver, simulated: bool) -> dict[str, Any]:
    v = drv.version()
    mem = gpu_memory(drv)
    try:
        host_mem = meminfo()["MemTotal"] * 1024
    except (OSError, IndexError, KeyError, ValueError):
        host_mem = None
    return {
        "host": {"name": socket.gethostname(), "cpus": os.cpu_count(), "memory_bytes": host_mem,
                 "platform": platform.platform()},
        "device": {"name": "simcuda (simulated driver, test double)" if simulated else _nvml_text("nvmlDeviceGetName", 0),
                   "driver_version": "simcuda" if simulated else _nvml_text("nvmlSystemGetDriverVersion"),
                   "count": device_count(drv),
                   "cuda_version": f"{v // 1000}.{v % 1000 // 10}", "memory_total_bytes": mem.total if mem else None},
        "software": {"python": platform.python_version(), "gpucr": gpucr.__version__,
                     "torch": _version("torch"), "transformers": _version("transformers")},
    }


# ---- one workload process, several methods ----

def _used(drv: Driver) -> Callable[[], int | None]:
    """Memory in use on the machine's GPUs, all of them added up (a job may span several)."""
    def read() -> int | None:
        per = {} if drv.simulated else _used_per_gpu(drv)
        if per:
            return sum(per.values())
        m = gpu_memory(drv)
        return m.used if m else None
    return read


def settle(used: Callable[[], int | None], idle: int | None, timeout: float = 30.0, slack: int = 64 << 20) -> bool:
    """Wait for an exited process's memory to be given back (the GPU's use within `slack` of `idle`), so the next
    idle reading is true and the next process fits; False when it was not back within `timeout`."""
    end = time.monotonic() + timeout
    while idle is not None and time.monotonic() < end:
        now = used()
        if now is None or now <= idle + slack:
            return True
        time.sleep(0.2)
    return idle is None


def _diff(a: int | None, b: int | None) -> int | None:
    return a - b if a is not None and b is not None else None


class Hugepages:
    """Reserve 2 MiB hugepages for the agent's staging while gpucr's methods run, and give them back."""

    def __init__(self, nbytes: int) -> None:
        self.want = nbytes // HUGE_PAGE + 1024   # + 2 GiB: segments are rounded up
        self.got = 0

    def __enter__(self) -> "Hugepages":
        try:
            self.got = add_hugepages(self.want)
        except (OSError, ValueError) as exc:
            raise GpucrError(f"--staging-hugepages: cannot reserve hugepages ({exc}); run the bench as root") from exc
        _say(f"reserved {self.got} of {self.want} hugepages ({self.got * HUGE_PAGE / 2**30:.1f} GiB) for gpucr's staging")
        return self

    def __exit__(self, *exc: object) -> None:
        drop_hugepages(self.got)


def _used_per_gpu(drv: Driver) -> dict[str, int]:
    """Memory in use on every GPU of the machine, by UUID (NVML; simcuda's count when simulated)."""
    out = {}
    for i in range(device_count(drv)):
        uuid = device_info(drv, i)["uuid"]
        m = gpu_memory(drv, i, uuid)
        if m:
            out[uuid] = m.used
    return out


def _agent_bytes_per_gpu(pids: list[int]) -> dict[str, int]:
    """What gpucr's agents move on each GPU (their tracked VMM bytes), added over the processes."""
    out: dict[str, int] = {}
    for pid in pids:
        for g in gpucr.status(pid).gpus:
            out[g.uuid] = out.get(g.uuid, 0) + g.vmm_bytes
    return out


def _start(spec: S.Spec, group: list[M.Method], simulate: bool, drv: Driver, idle: int | None,
           idle_gpus: dict[str, int]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """One job for `group`: started, described (footprint per GPU, serving speed) and observed."""
    head = group[0]
    _say(f"{spec.name}: starting {'under the agent' if head.under_agent else 'without the agent'} "
         f"for {', '.join(m.name for m in group)}" + (f" with {head.job_env}" if head.job_env else ""))
    w = S.start(spec, head, simulate)
    for m in group:
        m.bind(w)
    try:
        info = w.ask("info")
        running, running_gpus = _used(drv)(), _used_per_gpu(drv)
        proc = {"pid": w.pids[0], "pids": w.pids, "launcher_pid": w.launcher, "info": info,
                "job_env": head.job_env, "gpu_used_idle_bytes": idle, "gpu_used_running_bytes": running,
                "footprint_bytes": _diff(running, idle),
                "footprint_per_gpu_bytes": {u: n - idle_gpus.get(u, 0) for u, n in running_gpus.items()
                                            if n - idle_gpus.get(u, 0) > 64 << 20}}
        if spec.llm:
            speed = w.ask(f"serve-speed {SPEED_TOKENS}")
            proc["tokens_per_s"] = speed["tokens_per_s"]
            _say(f"{spec.name}: serving {speed['tokens_per_s']:.1f} tokens/s"
                 + (f" with {head.job_env}" if head.job_env else ""))
        return w, proc, S.observe(w, spec)
    except BaseException:
        w.close(graceful=False)
        raise


def _bytes_per_gpu(head: M.Method, w: Any, proc: dict[str, Any]) -> dict[str, int]:
    """What each GPU's rate is computed on: what the agents move, the peer's region, or else the
    process's whole footprint (what the driver's own checkpoint moves)."""
    if head.under_agent:
        return _agent_bytes_per_gpu(w.pids)
    if head.in_app:
        return {u: proc["info"]["region_bytes"] for u in proc["footprint_per_gpu_bytes"]}
    return proc["footprint_per_gpu_bytes"]


def _failed_entry(proc: dict[str, Any], exc: M.JobFailed, samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"process": proc, "outcome": exc.outcome, "error": str(exc), "failed_step": exc.step,
            "errors": {str(k): v for k, v in exc.errors.items()}, "steps_s": exc.steps_s, "samples": samples,
            "median": None, "warmup": None, "correct": False}


def run_group(spec: S.Spec, group: list[M.Method], simulate: bool, drv: Driver, ceiling: dict | None,
              repeat: int, out: dict[str, dict[str, Any]], hugepages_for: int | None = None,
              saved: Callable[[], None] = lambda: None, park_s: float = 0.0) -> None:
    """Start one job for `group`, then time `repeat` cycles of each method on it; each method's
    results go into `out`, and `saved` is called, as soon as it is done, so a later failure or a
    time limit keeps them. A method that leaves the job dead (the driver's path failed or hung) is
    reported as such, and the job is killed and started again for the next method.
    hugepages_for: bytes of hugepages to reserve for the agent's staging while this group runs."""
    if hugepages_for:
        with Hugepages(hugepages_for) as h:
            def saved_with_pages() -> None:
                for m in group:
                    if m.name in out:
                        out[m.name]["hugepages_reserved_bytes"] = h.got * HUGE_PAGE
                saved()
            run_group(spec, group, simulate, drv, ceiling, repeat, out, saved=saved_with_pages, park_s=park_s)
        return
    used = _used(drv)
    idle, idle_gpus = used(), _used_per_gpu(drv)
    w, proc, ref = _start(spec, group, simulate, drv, idle, idle_gpus)
    ok_exit = False
    try:
        warmup = None
        wm = group[0].warmup()
        if wm is not None:
            _say(f"{spec.name}: warm-up cycle by {wm.name} (it prepares its host memory once; reported apart)")
            wm.before_first(w.pids)
            ck, rs, _ = M.timed_cycle(wm, w.pids, used, park_s)
            staging_s = ck.get("phases_s", {}).get("staging")   # made by the plane before the handover
            warmup = {"checkpoint_s": ck["wall_s"], "restore_s": rs["wall_s"], "staging_s": staging_s,
                      "checkpoint": ck, "restore": rs, "correct": S.compare(ref, S.observe(w, spec)),
                      "staging_bytes": wm.staging_bytes(w.pids)}
            _say(f"{spec.name}: warm-up checkpoint {ck['wall_s']:.3f} s"
                 + (f" (staging {staging_s:.3f} s)" if staging_s is not None else "")
                 + f", restore {rs['wall_s']:.3f} s")
        proc["bytes_per_gpu"] = _bytes_per_gpu(group[0], w, proc)
        for k, m in enumerate(group):
            samples: list[dict[str, Any]] = []
            first = None
            try:
                if k > 0 and m.warmup() is m:   # its own first cycle (the server pins the staging): apart
                    m.before_first(w.pids)
                    ck, rs, _ = M.timed_cycle(m, w.pids, used, park_s)
                    first = {"checkpoint_s": ck["wall_s"], "restore_s": rs["wall_s"]}
                    _say(f"{spec.name} {m.name}: its first cycle (reported apart): checkpoint {ck['wall_s']:.3f} s, "
                         f"restore {rs['wall_s']:.3f} s")
                for i in range(repeat):
                    ck, rs, used_ck = M.timed_cycle(m, w.pids, used, park_s)
                    if i == repeat - 1:
                        m.close()   # what it started (a server) goes before the next method runs
                    row = R.metrics(m, ck, rs, proc["footprint_bytes"], ceiling)
                    row.update(R.per_gpu(row, m, proc["bytes_per_gpu"]))
                    row["gpu_held_checkpointed_bytes"] = _diff(used_ck, idle)
                    row["correct"] = S.compare(ref, S.observe(w, spec))
                    row["staging_bytes"] = m.staging_bytes(w.pids)   # after the check: what running grew it to
                    samples.append(row)
                    _say(f"{spec.name} {m.name} {i + 1}/{repeat}: checkpoint {row['checkpoint_s']:.3f} s, "
                         f"restore {row['restore_s']:.3f} s, correct: {'yes' if all(row['correct'].values()) else 'NO'}")
            except M.JobFailed as exc:
                _say(f"{spec.name} {m.name}: {exc.outcome} at {exc.step}: {exc}; the job is killed"
                     + ("" if k == len(group) - 1 else " and started again for the next method"))
                out[m.name] = {**_failed_entry(proc, exc, samples), "server_log": m.server_log()}
                saved()
                w.close(graceful=False)
                settle(used, idle)
                if k < len(group) - 1:
                    w, proc, ref = _start(spec, group[k + 1:], simulate, drv, idle, idle_gpus)
                    proc["bytes_per_gpu"] = _bytes_per_gpu(group[k + 1], w, proc)
                continue
            checks = [s["correct"] for s in samples] + ([warmup["correct"]] if warmup else [])
            out[m.name] = {"process": proc, "warmup": warmup, "samples": samples, "median": R.medians(samples),
                           "outcome": "ok", "correct": all(all(c.values()) for c in checks), "error": None,
                           "first_cycle": first,
                           "data_plane": samples[-1].get("data_plane") if samples else None,
                           "server_log": m.server_log()}
            saved()
        ok_exit = True
    finally:
        w.close(graceful=ok_exit)   # not graceful: it may be parked by a checkpoint half done
        settle(used, idle)


def _hugepages_for(a: argparse.Namespace, spec: S.Spec, group: list[M.Method], done: dict[str, Any],
                   results: dict[str, Any]) -> int | None:
    """Bytes of hugepages to reserve for gpucr's methods on this workload: the footprint its plain
    process showed, else the share of the GPU it may take (LLM) or its size (raw)."""
    if not group[0].under_agent:
        return None
    seen = [m["process"]["footprint_bytes"] for m in done.values()
            if m.get("process") and m["process"].get("footprint_bytes")]
    if seen:
        return max(seen)
    if spec.llm:
        return int(a.gpu_util * max(spec.gpus, spec.world) * (results["device"]["memory_total_bytes"] or 0)) or None
    return int((spec.gib or 0) * 2**30) or None


def _save(path: Path, results: dict[str, Any], wres: dict[str, Any], ceiling: dict | None) -> None:
    """Written after every method: a run cut short by a time limit keeps what it measured."""
    derive(wres, ceiling)
    _write(path, results)


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)


def _groups(ms: list[M.Method]) -> list[list[M.Method]]:
    """Plain-process methods together, agent methods with the same agent settings together, methods
    whose job needs other settings apart; in the order first asked for."""
    groups: dict[tuple, list[M.Method]] = {}
    for m in ms:
        groups.setdefault((m.under_agent, tuple(sorted(m.agent_env.items())), tuple(sorted(m.job_env.items())),
                           m.name if m.own_job else None), []).append(m)
    return list(groups.values())


def _runnable(spec: S.Spec, group: list[M.Method], out: dict[str, dict[str, Any]]) -> list[M.Method]:
    """The methods of `group` that can run on `spec` here; each other one is recorded in `out` as
    skipped, with its reason, and said on stderr."""
    keep = []
    for m in group:
        reason = "not an NCCL job" if m.job_env and not spec.nccl else m.unavailable(spec)
        if reason is None:
            keep.append(m)
            continue
        out[m.name] = {"skipped": reason, "correct": True, "error": None}
        if reason != "not an NCCL job":   # NCCL settings change nothing in a job without NCCL: no news
            _say(f"{spec.name}: {m.name} skipped: {reason}")
    return keep


def method_names(text: str | None, specs: list[S.Spec]) -> list[str]:
    """--methods, or the default: the multi-GPU set when a multi-GPU job is among the workloads."""
    if text is None:
        return list(M.JOB_METHODS if any(s.gpus > 1 for s in specs) else M.DEFAULT_METHODS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in M.METHODS:
            raise GpucrError(f"unknown method '{n}': use some of {', '.join(M.METHODS)}")
    return names


def main(a: argparse.Namespace) -> int:
    a.gpu_util = 0.5 if a.gpu_util is None else a.gpu_util
    if a.repeat < 1:
        raise GpucrError("--repeat must be at least 1")
    if not 0 < a.gpu_util < 1:
        raise GpucrError("--gpu-util is a share of the GPU, between 0 and 1")
    if not 0 <= a.park <= 3600:
        raise GpucrError("--park is a number of seconds from 0 to 3600")
    if a.driver_deadline <= 0:
        raise GpucrError("--driver-deadline is a number of seconds above 0")
    simulated = a.simulate or not gpu_present()
    specs = [S.parse_workload(w, a.gpu_util)
             for w in (a.workloads or (SIMULATED_WORKLOADS if simulated else DEFAULT_WORKLOADS)).split(",") if w.strip()]
    names = method_names(a.methods, specs)
    skipped: dict[str, str] = {}
    if simulated:
        _say(SIMULATED_BANNER)
        specs, skipped = _simulable(specs)
    if not specs:
        raise GpucrError("no workload to run")
    if M.ServerImageMethod.name in names and not Path(a.image_dir).is_dir():
        raise GpucrError(f"--image-dir {a.image_dir}: not a directory; give an existing one on the disk the images "
                         "should go to")
    drv = driver_for(str(simcuda_dir() / "libcuda.so.1") if simulated else "libcuda.so.1")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out or f"gpucr-bench-{'SIMULATED-' if simulated else ''}{stamp}.json")
    chart = Path(a.chart) if a.chart else out.with_suffix(".png")

    results: dict[str, Any] = {
        "schema": SCHEMA, "simulated": simulated, "warning": SIMULATED_BANNER if simulated else None,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **environment(drv, simulated),
        "settings": {"workloads": [s.name for s in specs], "skipped_workloads": list(skipped),
                     "skipped_why": skipped, "methods": names, "image_dir": a.image_dir,
                     "gpu_util": a.gpu_util, "repeat": a.repeat, "park_s": a.park, "generate_tokens": S.GENERATE_TOKENS,
                     "step_timeout_s": M.STEP_TIMEOUT_S,
                     "gpucr_staging": "2 MiB hugepages reserved by the bench for gpucr's methods"
                     if a.staging_hugepages else "the agent's default (hugepages if free, else shared memory)",
                     # the agent's settings the bench's environment gave its apps (e.g. GPUCR_PIECE_BYTES), else defaults
                     "agent_settings": {k: v for k, v in os.environ.items() if k in SETTINGS}},
        "ceiling": None, "workloads": {}}
    gib = a.ceiling_gib or (0.25 if simulated else 8.0)
    if "ceiling" in names:
        _say(f"measuring the pinned-copy ceiling ({gib:g} GiB)")
        results["ceiling"] = B.ceiling(simulated, gib)
        _say(f"ceiling: D2H {results['ceiling']['d2h_gbps']:.1f} GB/s, H2D {results['ceiling']['h2d_gbps']:.1f} GB/s")
    gpus = max(s.gpus for s in specs)
    if "ceiling" in names and gpus > 1:
        _say(f"measuring the pinned-copy ceiling of {gpus} GPUs' links at once ({gib:g} GiB each)")
        results["ceiling_all_gpus"] = c = B.ceiling_all(simulated, gib, gpus)
        _say(f"ceiling of {gpus} links at once: D2H {c['aggregate_d2h_gbps']:.1f} GB/s, H2D {c['aggregate_h2d_gbps']:.1f} GB/s "
             f"in all; per GPU " + ", ".join(f"{g['d2h_gbps']:.1f}/{g['h2d_gbps']:.1f}" for g in c["per_gpu"]))
    methods = [M.make(n, drv, simulated, a.driver_deadline, a.image_dir) for n in names if n != "ceiling"]
    failed = False
    try:   # a method may hold a server it started: given back whatever happens
        for spec in specs:
            wres: dict[str, Any] = {"module": spec.module, "args": list(spec.args), "methods": {}}
            results["workloads"][spec.name] = wres
            ceiling = _ceiling_of(spec.gpus, results)
            for group in _groups(methods):
                group = _runnable(spec, group, wres["methods"])
                if not group:
                    _save(out, results, wres, ceiling)
                    continue
                huge = _hugepages_for(a, spec, group, wres["methods"], results) if a.staging_hugepages else None
                try:
                    run_group(spec, group, simulated, drv, ceiling, a.repeat, wres["methods"],
                              hugepages_for=huge, saved=lambda: _save(out, results, wres, ceiling), park_s=a.park)
                except (GpucrError, RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
                    failed = True
                    _say(f"{spec.name}: {', '.join(m.name for m in group)} failed: {exc}")
                    for m in group:
                        wres["methods"].setdefault(m.name, {"error": str(exc), "correct": False, "server_log": m.server_log()})
                _measure_disk(a.image_dir, spec, wres)
                _save(out, results, wres, ceiling)
    finally:
        for m in methods:
            m.close()
    failed = failed or not all(r.get("correct") or r.get("outcome") in ("failed", "hung")
                               for w in results["workloads"].values() for r in w["methods"].values())
    try:
        report.chart(results, chart)
    except ImportError:
        chart = None
        _say("no chart: matplotlib is not installed (pip install 'gpucr[bench]')")
    print(report.markdown(results))
    _say(f"results: {out}" + (f", chart: {chart}" if chart else ""))
    if simulated:
        _say(SIMULATED_BANNER)
    return 1 if failed else 0


def _simulable(specs: list[S.Spec]) -> tuple[list[S.Spec], dict[str, str]]:
    """The workloads simcuda can run, and the others with why not (each said once)."""
    skipped = {s.name: s.needs_gpu for s in specs if s.needs_gpu}
    for why in dict.fromkeys(skipped.values()):
        _say(f"skipping {', '.join(n for n, w in skipped.items() if w == why)}: {why}")
    return [s for s in specs if not s.needs_gpu], skipped


def _measure_disk(image_dir: str, spec: S.Spec, wres: dict[str, Any]) -> None:
    """Once a workload's images were written and read: the disk's rate under the same directory, for as
    many bytes as its image had, to set the image's times against (the bound of gpucr-server-image)."""
    med = (wres["methods"].get(M.ServerImageMethod.name) or {}).get("median") or {}
    nbytes = med.get("image_bytes") or med.get("bytes_out")
    if not nbytes or "disk" in wres:
        return
    _say(f"{spec.name}: measuring the disk's rate under {image_dir} ({nbytes / 2**30:.2f} GiB written, then read)")
    try:
        wres["disk"] = d = B.disk_rate(image_dir, int(nbytes))
    except OSError as exc:
        wres["disk"] = {"dir": image_dir, "error": f"{exc.strerror or exc}"}
        _say(f"{spec.name}: the disk's rate could not be measured: {exc}")
        return
    _say(f"{spec.name}: disk: write + fsync {d['write_gbps']:.2f} GB/s, read {d['read_gbps']:.2f} GB/s"
         + ("" if d["direct_io"] else " (no O_DIRECT here)"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucr bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


if __name__ == "__main__":
    try:
        sys.exit(main(_parser().parse_args()))
    except GpucrError as exc:
        print(f"gpucr: error: {exc}", file=sys.stderr)
        sys.exit(1)
