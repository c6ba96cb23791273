"""`gpucr bench --scenario swap` (issue 28): N model servers that together need more than the card, each under
`gpucr run --swap` through one `gpucr serve`, and a request stream (round-robin, then a seeded Zipf mix) that the
swap service serves by parking and resuming them on demand. Every request's times to first and last token, whether
its server was resident, and its tokens against that server's reference; beside it, in the same run, (a) gpucr's
switch one-way by hand, (b) a restart from safetensors and (c) the driver's own checkpoint (swap_ways.py); each
switch set against its bound, from the two-way link rate measured in the same run (bounds.two_way).

The results file is rewritten after every request, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..demo import gpu_present
from ..driver import SIMULATE_ENV, driver_for, gpu_memory
from ..errors import GpucrError
from ..paths import simcuda_dir
from ..server import client
from ..service_http import missing
from ..workloads.llm_app import MODELS
from . import bounds as B
from . import swap_report as report
from . import swap_ways as W
from .swap_fleet import SIM_CONTEXT, Fleet, shape_for
from .swap_watch import READ_EVERY_S, Watch, bench_counters, compare

SCHEMA = "gpucr-bench-swap/1"
STREAM_SHARE = 0.45      # of the time budget, for the setup and the request stream; the ways beside it get the rest:
ONE_WAY_SHARE = 0.05     # (a), on the servers already running: a few seconds a switch
RESTART_SHARE = 0.2      # (b): its weights written once, then a start each switch; (c), the driver's, gets what is left
MAX_STREAM_SHARE = 1 - ONE_WAY_SHARE - RESTART_SHARE
GPU_SLACK = 256 << 20    # room a server's start is given beyond its share on a GPU: the map of the staging pinned
SERVER_CONTEXT = 1 << 30  # the gpucr server's context on the H200 (about 520 MiB), with room to spare
SETTINGS = ("servers", "model", "gpu_util", "requests", "zipf_share", "zipf_s", "seed", "tokens", "reference_requests",
            "baseline_switches", "time_budget", "stream_share", "request_timeout", "host_budget", "weights_dir")
SWITCH_MODE = ("not measured yet: the service switches both ways at once where one app's park makes the room "
               "(docs/swap.md), (a) parks by hand, then resumes; the summary says how each switch went")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The scenario's own flags, beside run.py's (--gpu-util, --out, --chart, --simulate, --driver-deadline)."""
    g = p.add_argument_group("--scenario swap")
    g.add_argument("--scenario", choices=("swap",), default=None,
                   help="swap: N servers under the swap service and a request stream, against a restart and the driver")
    g.add_argument("--servers", type=int, default=4, help="servers under the swap service (default 4)")
    g.add_argument("--model", default="llama3-8b", help="their LLM shape on a GPU (default llama3-8b)")
    g.add_argument("--requests", type=int, default=60, help="requests of the stream (default 60)")
    g.add_argument("--zipf-share", type=float, default=0.25, help="share of them in the Zipf mix, after the "
                   "round-robin ones (default 0.25)")
    g.add_argument("--zipf-s", type=float, default=1.2, help="the Zipf mix's exponent (default 1.2)")
    g.add_argument("--seed", type=int, default=0, help="the Zipf mix's seed (default 0)")
    g.add_argument("--tokens", type=int, default=16, help="tokens each request asks for (default 16)")
    g.add_argument("--reference-requests", type=int, default=2, help="requests to each server just started, "
                   "resident: its reference tokens and resident time to first token (default 2)")
    g.add_argument("--baseline-switches", type=int, default=3, help="switches of each way beside the stream (default 3)")
    g.add_argument("--ways", default="one-way,restart,driver", help="the ways beside the stream (default all three)")
    g.add_argument("--time-budget", type=float, default=480.0, metavar="SECONDS", help="the whole scenario's "
                   "(default 480): the stream stops at --stream-share of it, and a way starts no switch past it")
    g.add_argument("--stream-share", type=float, default=STREAM_SHARE, help="share of --time-budget by which the "
                   f"setup and the stream end (default {STREAM_SHARE:g}); then (a) until {ONE_WAY_SHARE:g} more, (b) until "
                   f"{RESTART_SHARE:g} more, (c) until the end")
    g.add_argument("--weights-dir", default="/var/tmp", metavar="DIR", help="where the restart's safetensors are "
                   "written once (removed after; default /var/tmp)")
    g.add_argument("--host-budget", default="80%", metavar="SIZE", help="the --host-budget of the gpucr serve the "
                   "bench starts: one parked server and one in flight must fit in it (default 80%%)")
    g.add_argument("--prepare-staging", default="auto", metavar="SIZE", help="the --prepare-staging of the gpucr "
                   "serve the bench starts: staging a resumed server gives back goes back to its pool, pinned, and the "
                   "next park is lent it (default auto; 0: each park makes and pins its own)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS", help="a request not answered "
                   "by then is recorded as lost, and the stream stops (default 600)")
    g.add_argument("--watch", action="store_true", help="read the serve's page data, /metrics and event stream "
                   "through its HTTP API every second while the servers run, recorded beside --out "
                   "(NAME-watch.jsonl.gz), and set the metrics' counts against the bench's at the end "
                   "(needs gpucr[service])")
    g.add_argument("--two-way-gib", type=float, default=None, help="bytes each way of the two-way rate's copies "
                   "(default 4; 0.0625 on simcuda)")


def _say(msg: str) -> None:
    print(f"gpucr bench swap: {msg}", file=sys.stderr, flush=True)


def _check(a: argparse.Namespace) -> list[str]:
    ways = [w.strip() for w in a.ways.split(",") if w.strip()]
    for w in ways:
        if w not in ("one-way", "restart", "driver"):
            raise GpucrError(f"--ways: '{w}' is not one-way, restart or driver")
    if a.servers < 2 or a.requests < 1 or a.tokens < 1 or a.reference_requests < 1 or a.baseline_switches < 0:
        raise GpucrError("--servers is at least 2; --requests, --tokens and --reference-requests at least 1")
    if not 0 < a.gpu_util < 1 or not 0 <= a.zipf_share <= 1 or a.time_budget <= 0 or not 0 < a.stream_share <= MAX_STREAM_SHARE:
        raise GpucrError(f"--gpu-util is between 0 and 1, --zipf-share from 0 to 1, --stream-share above 0 to "
                         f"{MAX_STREAM_SHARE:g} (the ways beside it get the rest), "
                         "--time-budget above 0")
    if a.model not in MODELS:
        raise GpucrError(f"--model {a.model}: use one of {', '.join(MODELS)}")
    if "restart" in ways and not Path(a.weights_dir).is_dir():
        raise GpucrError(f"--weights-dir {a.weights_dir}: not a directory")
    return ways


class Run:
    """One run's results, written after every request."""

    def __init__(self, out: Path, results: dict[str, Any]) -> None:
        self.out, self.results = out, results

    def emit(self, rec: dict[str, Any]) -> None:
        self.results["requests"].append(rec)
        if not rec["answered"]:
            _say(f"{rec['method']} {rec['server']}: NOT ANSWERED: {rec['error']}")
        elif not rec["correct"]:
            _say(f"{rec['method']} {rec['server']}: WRONG TOKENS {rec['tokens'][:8]}...")
        self.save()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(self.out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        os.replace(tmp, self.out)


def _fleet_part(run: Run, fleet: Fleet, a: argparse.Namespace, ways: list[str], share: int, t0: float) -> None:
    """The servers started under the service (each one's references), the stream, then (a) on the same servers."""
    need = share + (0 if run.results["simulated"] else GPU_SLACK)
    names = [f"swapbench-{i}" for i in range(a.servers)]
    for i, name in enumerate(names):
        m = fleet.start(name, i, need)
        run.results["servers"][name] = {"pid": m.w.pid, "seed": i, "ready": m.w.info}
        _say(f"{name} started (pid {m.w.pid}); its reference tokens")
        W.references(W.GPUCR, m, a.reference_requests, a.tokens, t0, run.emit)
    run.results["pre_parks"], run.results["start_switches"] = fleet.pre_parks, fleet.starts
    stream_end = t0 + a.stream_share * a.time_budget
    plan = W.stream(names, a.requests, a.zipf_share, a.zipf_s, a.seed)
    for i, (mix, name) in enumerate(plan):
        if time.monotonic() > stream_end:
            run.results["stream_short"] = f"{i} of {len(plan)} requests sent: the stream's time ({a.stream_share:g} "\
                                          f"of --time-budget) was spent"
            _say(run.results["stream_short"])
            break
        rec = W.fleet_request(fleet, W.GPUCR, mix, fleet.members[name], a.tokens, t0, timeout=a.request_timeout)
        run.emit(rec)
        if not rec["answered"]:   # its server is stuck (its pipe has an answer owed): nothing more to learn
            raise GpucrError(f"request {i + 1} to {name} was not answered: {rec['error']}")
        _say(f"{i + 1}/{len(plan)} {mix} {name}: {'resident' if rec['resident'] else 'parked'}, first token "
             f"{rec['ttft_s']:.3f} s, {'right tokens' if rec['correct'] else 'WRONG TOKENS'}"   # said as it goes: a
             + (f" (parked {', '.join(rec['parked'])})" if rec["parked"] else ""))   # cut run's log still tells
    if "one-way" in ways:
        done = [r["switch_s"] for r in run.results["requests"] if r.get("switch_s") is not None]
        why = W.one_way(fleet, a.baseline_switches, a.tokens, t0, t0 + (a.stream_share + ONE_WAY_SHARE) * a.time_budget,
                        run.emit, _say, expect_s=statistics.median(done) if done else 0.0)
        if why:
            run.results["ways"][W.ONE_WAY] = {"short": why}


def main(a: argparse.Namespace) -> int:
    if a.gpu_util is None:
        a.gpu_util = 0.3
    ways = _check(a)
    if a.watch and missing():
        raise GpucrError(f"--watch: {missing()}")
    simulated = a.simulate or not gpu_present()
    if simulated:
        os.environ[SIMULATE_ENV] = "1"   # the servers, `gpucr run` and the requests to the service: all simcuda
        _say(report_banner())
    drv = driver_for(str(simcuda_dir() / "libcuda.so.1") if simulated else "libcuda.so.1")
    from .run import _version, environment
    mem = gpu_memory(drv)
    shape = shape_for(simulated, a.model, a.gpu_util, mem.total if mem else None)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out or f"gpucr-bench-swap-{'SIMULATED-' if simulated else ''}{stamp}.json")
    results: dict[str, Any] = {
        "schema": SCHEMA, "simulated": simulated, "warning": report_banner() if simulated else None,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **environment(drv, simulated),
        "settings": {**{k: getattr(a, k) for k in SETTINGS}, "ways": ways, "shape": shape.what},
        "switch_mode": SWITCH_MODE, "two_way": None, "serve": None, "servers": {}, "requests": [], "ways": {}}
    results["software"]["safetensors"] = _version("safetensors")   # the restart's loader, on a GPU
    run = Run(out, results)
    # a time limit's SIGTERM (scripts/gpu-check's timeout) unwinds like an error: the servers are killed, the
    # bench's gpucr serve stopped, what was measured kept (its summary: python3 -m gpucr.bench.swap_report FILE)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    gib = a.two_way_gib or (0.0625 if simulated else 4.0)
    _say(f"measuring the two-way link rate ({gib:g} GiB each way at once)")
    results["two_way"] = B.two_way(simulated, gib)
    _say(f"two-way: {results['two_way']['each_way_gbps']:.1f} GB/s each way")
    idle = gpu_memory(drv)
    flags = ["--host-budget", a.host_budget, "--prepare-staging", a.prepare_staging]
    fleet = Fleet(shape, simulated, flags, SIM_CONTEXT if simulated else SERVER_CONTEXT)
    results["serve"] = {"reused": fleet.reused, "flags": [] if fleet.reused else flags,
                        "host": fleet.view()["host"]}
    if fleet.reused and results["serve"]["host"].get("host_budget_bytes") is None:
        _say("WARNING: the gpucr serve already running has no --host-budget: every server parked once keeps its "
             "staging, and host memory may not hold them all (stop it, 'gpucr serve --stop', to let the bench start one)")
    failed, watch = False, None
    try:   # whatever ends it (a SIGTERM too), what was measured is summed up and kept
        try:
            watch = _watch(simulated, out) if a.watch else None
            _fleet_part(run, fleet, a, ways, int(a.gpu_util * mem.total), t0)
        except (GpucrError, RuntimeError, OSError, TimeoutError) as exc:
            failed = True
            results["error"] = f"the servers under the swap service: {exc}"
            _say(results["error"])
        finally:
            results["serve"]["log"] = fleet.server_log()
            if watch is not None:   # its last read before the servers go: their series go with them
                try:
                    _watched(watch, results, fleet.starts)
                except Exception as exc:   # noqa: BLE001 - the servers must still be closed and the results kept
                    results["watch"] = {"error": f"{type(exc).__name__}: {exc}"}
                    _say(f"watch: its end failed: {results['watch']['error']}")
            fleet.close()
            run.save()
        _settle(drv, idle)
        failed = _beside(run, a, ways, shape, drv, t0) or failed
    finally:
        results["elapsed_s"] = time.monotonic() - t0
        report.summarize(results)
        run.save()
    print(report.table(results))
    if a.chart:
        try:
            report.chart(results, Path(a.chart))
        except ImportError:
            _say("no chart: matplotlib is not installed (pip install 'gpucr[bench]')")
    _say(f"results: {out}" + (f", chart: {a.chart}" if a.chart else ""))
    return 1 if failed or not results["all_answered_correct"] else 0


def _beside(run: Run, a: argparse.Namespace, ways: list[str], shape: Any, drv: Any, t0: float) -> bool:
    """(b) and (c), once the servers under the service are gone; True when one failed. The driver's steps get at most
    what is left of the time budget (a minute at least) before they are called hung."""
    failed = False
    for way in ("restart", "driver"):
        if way not in ways:
            continue
        name = W.RESTART if way == "restart" else W.DRIVER
        share = a.stream_share + ONE_WAY_SHARE + RESTART_SHARE if way == "restart" else 1.0
        deadline = t0 + share * a.time_budget
        try:
            if way == "restart":
                got = W.restart(shape, run.results["simulated"], a.baseline_switches, a.tokens, a.reference_requests,
                                a.weights_dir, t0, deadline, run.emit, _say)
            else:
                step_s = min(a.driver_deadline, max(60.0, deadline - time.monotonic()))
                got = W.driver_switches(shape, run.results["simulated"], drv, step_s, a.baseline_switches, a.tokens,
                                        a.reference_requests, t0, deadline, run.emit, _say)
            run.results["ways"][name] = got
        except (GpucrError, RuntimeError, OSError, TimeoutError) as exc:
            failed = True
            run.results["ways"][name] = {"error": str(exc)}
            _say(f"{name} failed: {exc}")
        run.save()
    return failed


def _watch(simulated: bool, out: Path) -> Watch:
    """The watch on the serve's HTTP API (its Unix socket), recording beside the results."""
    info = client.info(simulated) or {}
    if not (info.get("http") or {}).get("socket"):
        raise GpucrError("--watch: the gpucr serve running serves no HTTP API (its 'service' extra is not installed "
                         "where it runs)")
    rec = out.with_name(f"{out.stem}-watch.jsonl.gz")
    _say(f"watching the service through {info['http']['socket']}, recorded in {rec}")
    return Watch(info["http"]["socket"], rec).start()


def _watched(watch: Watch, results: dict[str, Any], starts: list[dict[str, Any]]) -> None:
    """The watch stopped, and its last /metrics set against the bench's own counts of the servers' switches."""
    final = watch.finish()
    got = compare(final, bench_counters(results["requests"], starts))
    results["watch"] = {"recording": watch.out.name, "every_s": READ_EVERY_S, "reads": watch.reads,
                        "errors": watch.errors, "metrics_vs_bench": got}
    _say(f"watch: {watch.reads} reads; the metrics' counts {'EQUAL' if got['equal'] else 'NOT EQUAL'} to the bench's"
         + ("" if got["equal"] else f": {json.dumps(got['apps'])}"))


def _settle(drv: Any, idle: Any) -> None:
    """Wait until the GPU is back to what it held before the servers started (give or take 1 GiB): the ways after
    them start servers of their own, which would not fit beside memory the driver has not given back yet."""
    from .run import settle

    def used() -> int | None:
        m = gpu_memory(drv)
        return m.used if m is not None else None
    if not settle(used, idle.used if idle is not None else None, timeout=60.0, slack=1 << 30):
        _say("the GPU's memory is not back to idle a minute after the servers ended; going on")


def report_banner() -> str:
    from .run import SIMULATED_BANNER
    return SIMULATED_BANNER
