"""The gpucr command."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn, TypeVar

from . import coverage, gpus, paths, server_view, sizes, version
from .agent_tables import SETTINGS
from .levels import LEVELS
from .server import route
from .server_view import mib as _mib
from .driver import SIMULATE_ENV
from .errors import GpucrError
from .results import (SCHEMA_VERSION, ErrorResult, GpuMemoryChange, ImageTransfer, LeftOut, ProcessStatus, RecoverResult,
                      StatusResult, from_json, to_json)

T = TypeVar("T")
STATUS_WAIT_S = 10.0   # how long `status` waits for a process still starting under gpucr
ONE_KIND_ENV = "GPUCR_PS_ONE_KIND"   # internal: a `ps` listing for another, of its own driver kind only
# The agent's limits for the settings `gpucr run` passes on, from its table (native/agent/settings.def)
GROUP_MAX_BYTES = SETTINGS["GPUCR_GROUP"].hi
STAGING_KINDS = tuple(w for w in SETTINGS["GPUCR_STAGING"].accepted.split("|") if w != "file:DIR")
# Settings of the controller, read from its own environment: checked before anything runs.
CONTROLLER_FLAGS = ("GPUCR_SIMULATE", route.NO_SERVER_ENV)
NO_SERVER_HELP = ("act in-process, not through the gpucr server even when one runs (the same as "
                  f"{route.NO_SERVER_ENV}=1)")
CONTROLLER_SIMULATE_HELP = ("act through simcuda, the simulated driver (test double), on processes started with "
                            "'gpucr run --simulate' (the same as GPUCR_SIMULATE=1)")


JSON_HELP = "print the result as JSON (docs/api.md); an error, too, is printed as a JSON object"


class _Parser(argparse.ArgumentParser):
    """argparse with gpucr's one-line errors, `gpucr: error: ...` (its default prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gpucr: error: {message}; see '{self.prog} --help'\n")


def _staging_kind(v: str) -> str:
    """--staging: auto, hugetlbfs, shm or file:DIR with DIR an existing directory (made absolute)."""
    if v in STAGING_KINDS:
        return v
    if v.startswith("file:") and len(v) > 5:
        d = os.path.abspath(v[5:])
        if not os.path.isdir(d):
            raise argparse.ArgumentTypeError(f"'{v}': {d} is not a directory")
        return f"file:{d}"
    raise argparse.ArgumentTypeError(f"'{v}' is not one of {', '.join(STAGING_KINDS)} or file:DIR")


# Settings and options of the in-process copy engine, deleted (issue 25): gpucr's data plane copies outside the
# application, which pins nothing and runs no thread of gpucr's but its channel. Said once, then ignored.
RETIRED_ENV = ("GPUCR_BOUNCE_MIB", "GPUCR_BOUNCE_THREADS", "GPUCR_PIN_THREADS", "GPUCR_STAGING_AHEAD",
               "GPUCR_UNPIN_FOR_DRIVER")
RETIRED_WHY = ("gpucr's data plane copies outside the application now (the server's, or the CLI's own), so the "
               "application pins nothing: it has no effect and is ignored")


class _Retired(argparse.Action):
    """An option of the deleted in-process copy engine: accepted (scripts keep working), said, ignored."""

    def __init__(self, option_strings: list[str], dest: str, nargs: int | str | None = 0, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=nargs, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"gpucr: {option_string}: {RETIRED_WHY}", file=sys.stderr)


def _say_retired_env(env: dict[str, str]) -> None:
    for name in RETIRED_ENV:
        if name in env:
            print(f"gpucr: {name}: {RETIRED_WHY}", file=sys.stderr)


def host_budget(v: str) -> str:
    """--host-budget: the agent's GPUCR_HOST_BUDGET form (gpucr.sizes)."""
    why = sizes.budget_problem(v)
    if why:
        raise argparse.ArgumentTypeError(why)
    return v


def _group_name(v: str) -> str:
    """--group: what the agent keeps whole (it refuses a longer name rather than cut it)."""
    n = len(v.encode())
    if not v or n > GROUP_MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a group name is 1 to {GROUP_MAX_BYTES} bytes, not {n}")
    return v


def _seconds(v: str) -> float:
    try:
        t = float(v)
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise argparse.ArgumentTypeError(f"the timeout must be a positive number of seconds, not '{v}'")
    return t


def _check_controller_env(env: dict[str, str]) -> None:
    """The controller's own settings, as strictly as the agent's: 0 or 1, or unset."""
    for name in CONTROLLER_FLAGS:
        if env.get(name, "") not in ("", "0", "1"):
            raise GpucrError(f"{name}={env[name]} is not valid: use 0 or 1 (or leave it unset)")


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in phases.items())


def _fmt_gpus(changes: list[GpuMemoryChange]) -> str:
    """Per GPU: this process's memory, and the whole GPU's, before -> after; the gpucr server's own apart."""
    return "; ".join(f"{g.uuid}: this process {_fmt_held(g.process_before_bytes, g.server_made_before_bytes)} -> "
                     f"{_fmt_held(g.process_after_bytes, g.server_made_after_bytes)}, "
                     f"GPU used {_mib(g.gpu_used_before_bytes)} -> {_mib(g.gpu_used_after_bytes)}"
                     f"{_fmt_server(g.server_before_bytes, g.server_after_bytes)}" for g in changes)


def _fmt_held(process: int | None, server_made: int) -> str:
    # nvidia-smi lists what the server made under no process: said, so that its figure can be matched
    return _mib(process) + (f" ({_mib(server_made)} of it re-made by gpucr's server)" if server_made else "")


def _fmt_server(before: int | None, after: int | None) -> str:
    if after is None:
        return ""   # not through a server
    return f"; gpucr server {_mib(after) if before == after else f'{_mib(before)} -> {_mib(after)}'} (its context)"


def _fmt_image(im: ImageTransfer, verb: str) -> str:
    """An image's data: what went to or from disk (zero chunks are neither written nor read), and the rate
    of that data, so that an image of zeros does not read as an impossible speed."""
    on_disk = im.bytes_written if im.bytes_written is not None else im.bytes_read
    moved = "" if on_disk is None else (f" ({_mib(on_disk)} {verb} on disk, {_mib(im.bytes - on_disk)} of zero "
                                        "chunks skipped)" if on_disk < im.bytes else "")
    rate = f", {_gbps(on_disk if on_disk is not None else im.bytes, im.transfer_s)} on disk" if im.transfer_s > 0 else ""
    return (f"  image {im.dir}: {_mib(im.bytes)}{moved} {verb} in {im.transfer_s:.2f} s{rate}"
            f"{' (direct I/O)' if im.direct_io else ''}")


def _check_driver_loads() -> None:
    """Before the application starts: without a loadable driver it would only crash on its own, later."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GpucrError(f"no CUDA driver can be loaded here ({exc}): install the NVIDIA driver, or add --simulate "
                         "to run on simcuda, the simulated driver (a test double)") from None


def cmd_run(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        raise GpucrError("nothing to run: give a command after '--', e.g. gpucr run -- python3 app.py")
    if not a.simulate:
        _check_driver_loads()
    env = paths.run_env(simulate=a.simulate)
    if a.staging:
        env["GPUCR_STAGING"] = a.staging
    if a.staging_policy:
        env["GPUCR_STAGING_POLICY"] = a.staging_policy
    if a.group:
        env["GPUCR_GROUP"] = a.group
    if a.host_budget:
        env["GPUCR_HOST_BUDGET"] = a.host_budget
    if a.swap and not route.server_wanted():
        raise GpucrError("--swap needs the gpucr server: drop --no-server (and GPUCR_NO_SERVER=1)")
    if route.server_wanted():
        from .server import client
        problem = client.ensure_running(a.simulate)
        if problem and a.swap:
            raise GpucrError(f"--swap needs the gpucr server: {problem}")
        if problem:
            route.note(problem)
    if a.swap:
        server_view.register_swap(a, cmd, env)
    _say_retired_env(env)
    if a.simulate:
        print("gpucr: running on simcuda, the simulated driver (a test double; no GPU is used)", file=sys.stderr)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        raise GpucrError(f"cannot run {cmd[0]}: {exc.strerror}") from exc


def cmd_lib(a: argparse.Namespace) -> int:
    print(paths.simcuda_dir() / "libcuda.so.1" if a.simulate else paths.agent_lib())
    return 0


def _image_dir(base: str, pid: int, count: int) -> str:
    """One directory per process when several are named: DIR/PID."""
    return os.path.join(base, str(pid)) if count > 1 else base


def _targets(a: argparse.Namespace) -> tuple[list[int], list[LeftOut]]:
    """The processes named on the command line, or those of --group or --tree that hold GPU state;
    and the others, a launcher or a helper that never touched CUDA, left alone (and listed)."""
    from . import jobs
    if a.group and a.tree:
        raise GpucrError("give either --group or --tree, not both")
    if (a.group or a.tree) and a.pids:
        raise GpucrError(f"give either PIDs or {'--group' if a.group else '--tree'}, not both (process "
                         f"{', '.join(map(str, a.pids))} was named with it)")
    if a.group or a.tree:
        job = jobs.of_group(a.group) if a.group else jobs.of_tree(a.tree)
        for x in job.left_out:
            print(f"gpucr: note: {x.line()}", file=sys.stderr)
        return sorted(job.pids), job.left_out
    if not a.pids:
        raise GpucrError("name the processes (PID ...), a group (--group NAME) or a launcher (--tree PID)")
    return a.pids, []


def _settled(pids: list[int], timeout: float, ask: Callable[[], T], need_cuda: bool = True) -> T:
    """The request's answer, asked again when those still starting are up, or through the driver they run
    on (see gpucr.preflight.request)."""
    from . import preflight
    return preflight.request(pids, timeout, ask, need_cuda)


def _images(a: argparse.Namespace, pids: list[int]) -> dict[int, str] | None:
    return {pid: _image_dir(a.image, pid, len(pids)) for pid in pids} if a.image else None


@contextmanager
def _working(what: str, show: bool) -> Iterator[None]:
    """A spinner with the time so far on a terminal, while a request that can take seconds runs; nothing
    when stderr is not a terminal."""
    if not (show and sys.stderr.isatty()):
        yield
        return
    from rich.console import Console
    with Console(stderr=True).status(f"{what} ..."):
        yield


def _timed(what: str, show: bool, request: Callable[[], T]) -> tuple[T, float]:
    """The request's result and its total time, as the user waited for it (server round trip included)."""
    t0 = time.monotonic()
    with _working(what, show):
        out = request()
    return out, round(time.monotonic() - t0, 3)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def _warn(processes: list) -> None:
    for r in processes:
        for w in r.warnings:
            print(f"gpucr: warning: process {r.pid}: {w}", file=sys.stderr)


def cmd_checkpoint(a: argparse.Namespace) -> int:
    pids, left_out = _targets(a)
    result, result.total_s = _timed(f"checkpointing {_plural(len(pids), 'process', 'processes')}",
                                    not a.json and not a.image,   # an image shows its own bar
                                    lambda: _settled(pids, a.timeout, lambda: route.checkpoint_many(
                                        pids, level=a.level, timeout=a.timeout, images=_images(a, pids))))
    result.left_out = left_out
    _warn(result.processes)
    if a.json:
        _print_json(to_json(result))
        return 0
    for r in result.processes:
        print(f"process {r.pid}: checkpointed (level {r.level}) in {result.total_s:.2f} s; {_mib(r.bytes_moved)} "
              f"moved by gpucr ({_gbps(r.bytes_moved, result.total_s)} over that time), "
              f"{_mib(r.bytes_left_to_driver)} left to the driver"
              f"{coverage.left_summary(r.coverage.left_to_driver if r.coverage else [])}")
        if a.phases:
            print(f"  phases       {_fmt_phases(r.phases_s)}")
        if r.gpus:
            print(f"  memory       {_fmt_gpus(r.gpus)}")
        if r.image is not None:
            print(_fmt_image(r.image, "written") + "; host staging released")
    return 0


def cmd_restore(a: argparse.Namespace) -> int:
    pids, left_out = _targets(a)
    gpu_map = gpus.parse_map(a.map or [])   # checked before any process is asked anything
    result, result.total_s = _timed(f"restoring {_plural(len(pids), 'process', 'processes')}",
                                    not a.json and not a.image,
                                    lambda: _settled(pids, a.timeout, lambda: route.restore_many(
                                        pids, timeout=a.timeout, drop_staging=a.drop_staging, force=a.force,
                                        images=_images(a, pids), gpu_map=gpu_map,
                                        accept_mismatch=a.accept_mismatch)))
    result.left_out = left_out
    _warn(result.processes)
    if a.json:
        _print_json(to_json(result))
        return 0
    for r in result.processes:
        moved = "".join(f"; moved from {o} to {n}" for o, n in r.moved.items())
        print(f"process {r.pid}: restored and running in {result.total_s:.2f} s; {_mib(r.bytes_moved)} copied back "
              f"({_gbps(r.bytes_moved, result.total_s)} over that time){moved}")
        if a.phases:
            print(f"  phases       {_fmt_phases(r.phases_s)}")
        if r.gpus:
            print(f"  memory       {_fmt_gpus(r.gpus)}")
        if r.image is not None:
            print(_fmt_image(r.image, "read"))
    return 0


def _host_memory_line(st: ProcessStatus) -> str:
    """The limits staging is admitted under: the user's budget (shared by all processes) and the cgroup."""
    budget = (f"budget {_mib(st.host_budget_bytes)}, {_mib(st.host_budget_used_bytes)} of it used by all processes "
              "under gpucr" if st.host_budget_bytes else
              f"no budget (GPUCR_HOST_BUDGET), {_mib(st.host_budget_used_bytes)} staged by all processes under gpucr")
    cg = st.memory_cgroup
    cgroup = (f"; cgroup {cg.path} {cg.limit_file} {_mib(cg.limit_bytes)}, {_mib(cg.current_bytes)} used"
              if cg else "; no memory cgroup limit")
    return f"  host memory  {budget}{cgroup}"


def _status_lines(st: ProcessStatus) -> list[str]:
    al = st.allocations
    state = st.state + (f" (level {st.level})" if st.level else "")
    if st.state == "running" and st.gate_closed:
        state += ", parked: a restore stopped before its last step (run 'gpucr restore' again)"
    lines = [f"process {st.pid}: {state}" + ("" if st.cuda else ", CUDA not loaded") +
             (" [simcuda]" if st.simulated else ""),
             f"  command      {st.cmd}",
             f"  tracked      {_plural(al.tracked, 'allocation', 'allocations')}, {_mib(al.tracked_bytes)} moved by gpucr "
             f"({al.converted} converted, {al.app_vmm} application VMM)",
             f"  driver path  {_mib(st.bytes_left_to_driver)} left to the driver's checkpoint "
             f"({al.native} small, {al.pool} pool, {al.vmm_left_to_driver} partial VMM)",
             *coverage.status_lines(st.coverage),
             f"  staging      {_mib(st.staging_bytes)} in {_plural(st.staging_segments, 'segment', 'segments')} "
             f"({st.staging_kind})",
             _host_memory_line(st),
             f"  checkpoints  {st.generation} completed"]
    for i, g in enumerate(st.gpus):
        lines.insert(2 + i, f"  gpu          device {g.ordinal} {g.uuid}: this process {_mib(g.process_bytes)}, "
                            f"GPU used {_mib(g.gpu_used_bytes)} of {_mib(g.gpu_total_bytes)}")
    if al.not_exportable:
        lines.append(f"  exportable   {_plural(al.not_exportable, 'allocation is', 'allocations are')} not: no file descriptor was left for them "
                     "(RLIMIT_NOFILE; raise 'ulimit -n' before starting the application)")
    cyc = st.last_cycle
    if cyc.gate_s or cyc.release_s:
        steps = ("staging", "gate", "sync", "release")
        lines.append("  last cycle   " + ", ".join(f"{k.replace('_', ' ')} {getattr(cyc, k + '_s'):.3f} s"
                                                  for k in steps))
    if st.refusal:
        lines.append(f"  cannot checkpoint: {st.refusal}")
    return lines


def cmd_status(a: argparse.Namespace) -> int:
    if a.pid is None:
        return cmd_ps(a, command="status")
    st = _settled([a.pid], STATUS_WAIT_S, lambda: route.status(a.pid), need_cuda=False)
    if a.json:
        _print_json(to_json(StatusResult(SCHEMA_VERSION, "status", [st])))
    else:
        print("\n".join(_status_lines(st)))
        print("\n".join(server_view.server_lines()))   # what the servers hold apart from the process
    return 0


def cmd_wait(a: argparse.Namespace) -> int:
    from . import preflight
    t = preflight.wait_ready(a.pid, a.timeout)
    print(f"process {t.pid}: ready under gpucr, CUDA loaded" + (" [simcuda]" if t.simulated else ""))
    return 0


def _take_listed_kind() -> None:
    """When this controller was not told its driver: act through simcuda if every process under gpucr here
    that answers runs on it (one hello each: the kind must be known before the listing)."""
    from . import target as targets
    kinds = set()
    for pid, _sock in targets.list_sockets():
        try:
            kinds.add(targets.resolve(pid).simulated)
        except GpucrError:
            pass   # the listing says why
    if kinds == {True}:
        os.environ[SIMULATE_ENV] = "1"


def _of_kind(simulated: bool, pids: list[int]) -> list[int]:
    """Those of `pids` whose agents say they run on that driver kind (only the rows the listing could not
    ask are looked at again: one of the other kind is among them)."""
    from . import target as targets
    out = []
    for pid in pids:
        try:
            if targets.resolve(pid).simulated == simulated:
                out.append(pid)
        except GpucrError:
            pass
    return out


def _listed_apart(simulated: bool, pids: list[int]) -> StatusResult:
    """The rows of processes on the other driver, from a gpucr of this installation acting through that one
    (this process never loads both drivers). That one lists its own kind only: it never starts another."""
    env = dict(os.environ, **{SIMULATE_ENV: "1" if simulated else "0", ONE_KIND_ENV: "1"})
    r = subprocess.run([sys.executable, "-m", "gpucr.cli", "ps", "--json"], env=env, capture_output=True, text=True,
                       timeout=120)
    try:
        rows = from_json(StatusResult, json.loads(r.stdout))
    except ValueError:
        raise GpucrError(f"listing the processes on {'simcuda' if simulated else 'the system driver'} failed: "
                         f"{r.stderr.strip() or r.stdout.strip()}") from None
    rows.processes = [st for st in rows.processes if st.pid in pids]
    rows.unreachable = [u for u in rows.unreachable if u.pid in pids]
    return rows


def _ps_rows() -> StatusResult:
    """Every process under gpucr: those on simcuda listed through simcuda, the others through the driver."""
    if os.environ.get(SIMULATE_ENV, "") == "":
        _take_listed_kind()
    rows = route.ps()
    if os.environ.get(ONE_KIND_ENV) == "1":
        return rows
    here = os.environ.get(SIMULATE_ENV) == "1"
    apart = _of_kind(not here, [u.pid for u in rows.unreachable])
    if apart:
        other = _listed_apart(not here, apart)
        rows.processes += other.processes
        rows.unreachable = [u for u in rows.unreachable if u.pid not in apart] + other.unreachable
    return rows


def cmd_ps(a: argparse.Namespace, command: str = "ps") -> int:
    rows = _ps_rows()
    rows.command = command
    if a.json:
        _print_json(to_json(rows))
        return 0
    print("\n".join(server_view.server_lines()))
    if not rows.processes and not rows.unreachable:
        print("no processes under gpucr")
        return 0
    if command == "status":
        for st in rows.processes:
            print("\n".join(_status_lines(st)))
        for u in rows.unreachable:
            print(f"process {u.pid}: unreachable: {u.error}")
        return 0
    print(f"{'PID':>8}  {'STATE':<14} {'LEVEL':<5} {'GROUP':<10} {'TRACKED':>12} {'DRIVER':>12} {'STAGING':>12}  "
          "COMMAND")
    for st in rows.processes:
        state = (st.state if st.cuda else "no-cuda") + (" [sim]" if st.simulated else "")
        print(f"{st.pid:>8}  {state:<14} {st.level or '-':<5} {(st.group or '-')[:10]:<10} "
              f"{_mib(st.allocations.tracked_bytes):>12} {_mib(st.bytes_left_to_driver):>12} "
              f"{_mib(st.staging_bytes):>12}  {st.cmd[:60]}")
    for u in rows.unreachable:   # the whole reason: it is what the user needs to act on
        print(f"{u.pid:>8}  {'unreachable':<14} {'-':<5} {'-':<10} {'-':>12} {'-':>12} {'-':>12}  {u.error}")
    budgets = {st.host_budget_bytes for st in rows.processes if st.host_budget_bytes}
    if rows.processes:
        used = max(st.host_budget_used_bytes for st in rows.processes)
        print(f"host staging: {_mib(used)} held by all processes under gpucr; budget "
              f"{', '.join(_mib(b) for b in sorted(budgets)) if budgets else 'none (GPUCR_HOST_BUDGET)'}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from .server import client, daemon
    if a.stop:
        pid = client.stop(a.simulate)
        print("no gpucr server runs" if pid is None else f"gpucr server (pid {pid}) stopped")
        return 0
    if a.status:
        info = client.info(a.simulate)
        if a.json:
            _print_json({"running": True, **info} if info else {"running": False, "simulated": a.simulate})
        else:
            print(server_view.server_line(info) if info else "server: not running")
        return 0 if info else 3
    return daemon.main(a.idle_exit, keep_context=not a.give_back_context, routes=not a.no_routes,
                       host_budget=a.host_budget, park_dir=a.park_dir)


def cmd_demo(a: argparse.Namespace) -> int:
    from . import demo
    return demo.main(simulate=a.simulate, as_json=a.json)


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import run
    return run.main(a)


def cmd_inspect(a: argparse.Namespace) -> int:
    from pathlib import Path
    from . import manifest
    m = manifest.load(Path(a.dir))
    if a.json:
        _print_json(m)
        return 0
    print(f"checkpoint {m['id']}, taken {m['created']} on {m['host']}" + (" [simcuda]" if m.get("simulated") else ""))
    taken_on = ", ".join(f"{g['name']} ({g['uuid']})" for g in m.get("gpus") or [m["gpu"]])
    print(f"  gpu          {taken_on}, driver CUDA {manifest.cuda_version(m['driver_version'])}, level {m['level']}")
    for p in m["processes"]:
        al = p["allocations"]
        zero = sum(1 for a in p["data"] for c in a["chunks"] if c.get("zero"))
        chunks = sum(len(a["chunks"]) for a in p["data"])
        print(f"  process {p['pid']} (start time {p['start_time']}), checkpoint {p['generation']}")
        print(f"    moved by gpucr  {_plural(al['moved_by_gpucr'], 'allocation', 'allocations')}, {_mib(al['bytes'])}, "
              f"{_plural(chunks, 'chunk', 'chunks')} ({zero} zero)")
        print(f"    left to driver  {_plural(al['left_to_driver'], 'allocation', 'allocations')}, {_mib(al['left_to_driver_bytes'])}"
              f"{coverage.left_summary(coverage.manifest_left(p.get('coverage')))}")
        print("    domains         " + ", ".join(f"{k}: {v}" for k, v in p["domains"].items()))
        print(f"    unknown         {'; '.join(p['unknown']) or 'nothing'}")
    if "image" in m:
        im = m["image"]
        print(f"  written      {_mib(im['bytes_written'])} of {_mib(im['bytes'])} (zero chunks are not) in "
              f"{im['transfer_s']:.2f} s ({_gbps(im['bytes_written'], im['transfer_s'])} on disk"
              f"{', direct I/O' if im['direct_io'] else ''})")
    return 0


def _recover_chosen(a: argparse.Namespace) -> list:
    """recover --all or recover PID..., in-process: the server's recover takes every stuck process and leaves
    checkpoints made on purpose alone."""
    from . import recover as recovery
    only = set(a.pids) if a.pids else None
    if a.list:
        return recovery.find(committed_too=a.all, only=only)
    return recovery.recover(a.timeout, committed_too=a.all, only=only)


def cmd_recover(a: argparse.Namespace) -> int:
    stuck = _recover_chosen(a) if a.all or a.pids else route.recover(a.list, a.timeout)
    if a.json:
        _print_json(to_json(RecoverResult(SCHEMA_VERSION, "recover", a.list, stuck)))
    elif not stuck:
        print("no stuck process: nothing is locked, checkpointed or parked without a controller")
    for s in ([] if a.json else stuck):
        print(f"process {s.pid} ({s.cmd[:60]}): {s.how}" + (f"; {s.outcome}" if s.outcome else ""))
    return 0 if a.list or all(s.ok for s in stuck) else 1


def cmd_doctor(a: argparse.Namespace) -> int:
    from . import doctor
    return doctor.main(as_json=a.json)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpucr", description="Checkpoint and restore the GPU state of running CUDA processes.")
    p.add_argument("--version", action="version", version=f"gpucr {version.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run a command under gpucr's agent")
    r.add_argument("--simulate", action="store_true", help="use simcuda, the simulated driver (test double), instead of a GPU")
    r.add_argument("--staging", metavar="KIND", type=_staging_kind, help="host staging: auto (hugetlbfs when hugepages "
                   "are free, else shared memory; the default), hugetlbfs, shm, or file:DIR (an existing directory)")
    r.add_argument("--staging-ahead", "--no-staging-ahead", action=_Retired)
    r.add_argument("--staging-policy", choices=SETTINGS["GPUCR_STAGING_POLICY"].accepted.split("|"),
                   help="after a restore, keep staging for the next cycle (default) or give it back")
    r.add_argument("--bounce", action=_Retired, nargs=1)
    r.add_argument("--host-budget", metavar="SIZE", type=host_budget, help="the most host memory the staging of all "
                   "your processes under gpucr may hold together: a size (64G) or a share of MemTotal (50%%); a "
                   "checkpoint that would pass it is refused before anything is touched (GPUCR_HOST_BUDGET)")
    r.add_argument("--group", metavar="NAME", type=_group_name, help="make the process a member of a group, checkpointed "
                   f"and restored together with 'gpucr checkpoint --group NAME' (up to {GROUP_MAX_BYTES} bytes)")
    r.add_argument("--no-server", action="store_true", help="do not start the gpucr server (checkpoints of this "
                   f"process then run in-process unless one runs anyway; the same as {route.NO_SERVER_ENV}=1)")
    server_view.add_swap_flags(r, _seconds)
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    r.set_defaults(fn=cmd_run)

    lb = sub.add_parser("lib", help="print the agent's path, for LD_PRELOAD=$(gpucr lib) CMD")
    lb.add_argument("--simulate", action="store_true",
                    help="print the path of simcuda, the simulated driver (test double), instead")
    lb.add_argument("--simcuda", dest="simulate", action="store_true", help=argparse.SUPPRESS)   # its old name
    lb.set_defaults(fn=cmd_lib)

    def pid_cmd(name: str, fn: Callable, help_: str, level: bool, image_help: str) -> None:
        c = sub.add_parser(name, help=help_)
        c.add_argument("pids", type=int, nargs="*", metavar="PID")
        c.add_argument("--simulate", action="store_true", help=CONTROLLER_SIMULATE_HELP)
        c.add_argument("--no-server", action="store_true", help=NO_SERVER_HELP)
        c.add_argument("--group", metavar="NAME", type=_group_name,
                       help="the processes started with 'gpucr run --group NAME' that hold GPU state (others are listed)")
        c.add_argument("--tree", metavar="PID", type=int, help="the processes of the tree under PID (a launcher such as "
                       "torchrun, a shell script) that hold GPU state under gpucr; the others are left alone and listed")
        if level:
            c.add_argument("--level", choices=LEVELS, default="full",
                           help="full: data and driver control state (GPU memory to the driver's floor); "
                                "data: data only, the CUDA context stays (faster both ways)")
        c.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS",
                       help="deadline for draining calls in flight and each driver step (default 30)")
        c.add_argument("--json", action="store_true", help=JSON_HELP)
        c.add_argument("-v", "--phases", action="store_true", help="also print the time of each phase")
        c.add_argument("--image", metavar="DIR", help=image_help)
        c.set_defaults(fn=fn)

    pid_cmd("checkpoint", cmd_checkpoint, "save a process's GPU memory and give the GPU back", True,
            "also write the data to DIR (one DIR/PID per process when several are named), then free the host staging")
    pid_cmd("restore", cmd_restore, "put a checkpointed process's GPU memory back and let it run", False,
            "read the data back from the image in DIR, once its manifest's checks pass (same process, generation "
            "and GPU model, every chunk's digest)")
    sub.choices["restore"].add_argument("--drop-staging", action="store_true",
                                        help="give the host staging back after the restore (default: keep it for the next cycle)")
    sub.choices["restore"].add_argument("--map", action="append", metavar="OLD_UUID=NEW_UUID",
                                        help="restore onto other GPUs: the driver re-creates OLD's state on NEW (repeatable)")
    sub.choices["restore"].add_argument("--force", action="store_true",
                                        help="restore even if the manifest lists state it does not cover")
    sub.choices["restore"].add_argument("--accept-mismatch", action="store_true",
                                        help="restore even where the memory put back differs from the digests taken at "
                                             "the checkpoint (default: refused, the process stays checkpointed)")

    rc = sub.add_parser("recover", help="bring back every process of yours (everyone's, for root) left locked, "
                        "checkpointed or parked with no controller at work on it")
    rc.add_argument("pids", nargs="*", type=int, metavar="PID", help="only these processes (default: every one)")
    rc.add_argument("--list", action="store_true", help="only list them")
    rc.add_argument("--all", action="store_true", help="also processes checkpointed on purpose (a completed "
                    "'gpucr checkpoint'), left alone otherwise")
    rc.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS", help="deadline for each step (default 60)")
    rc.add_argument("--json", action="store_true", help=JSON_HELP)
    rc.add_argument("--simulate", action="store_true", help=CONTROLLER_SIMULATE_HELP)
    rc.add_argument("--no-server", action="store_true", help=NO_SERVER_HELP)
    rc.set_defaults(fn=cmd_recover)

    sv = sub.add_parser("serve", help="run the gpucr server (per user: checkpoints without a fresh interpreter and "
                        "cuInit each time); 'gpucr run' starts one when none runs")
    sv.add_argument("--simulate", action="store_true", help="serve on simcuda, the simulated driver (test double)")
    sv.add_argument("--idle-exit", type=_seconds, metavar="SECONDS", help="exit after SECONDS with no process under "
                    "gpucr and no request (default: run until stopped)")
    sv.add_argument("--no-data-plane", action=_Retired)
    sv.add_argument("--give-back-context", action="store_true", help="give back the server's GPU context and unpin "
                    "the staging after each checkpoint and restore, so the card holds nothing of the server's between "
                    "cycles (each cycle then pins the staging again; default: kept, for fast restores)")
    sv.add_argument("--no-routes", action="store_true", help="copy only over each process's own GPU's host link "
                    "(default: also through idle GPUs joined to it by NVLink, over their host links too)")
    sv.add_argument("--host-budget", metavar="SIZE", type=host_budget, help="the most host memory the swap apps "
                    "parked in host memory hold: 64G or 50%% of MemTotal; past it, the least recently used goes to disk "
                    "(--park-dir; default: no budget, docs/swap.md)")
    sv.add_argument("--park-dir", metavar="DIR", help="where parked swap apps past --host-budget go as images: a "
                    "directory of yours, mode 0700 (default: gpucr/parked under $XDG_STATE_HOME or ~/.local/state)")
    sv.add_argument("--stop", action="store_true", help="stop the running server")
    sv.add_argument("--status", action="store_true", help="say whether a server runs, its pid and what it holds "
                    "(exit status 3 when none runs)")
    sv.add_argument("--json", action="store_true", help="with --status: " + JSON_HELP)
    sv.set_defaults(fn=cmd_serve)

    ins = sub.add_parser("inspect", help="print a checkpoint image's manifest (its certificate)")
    ins.add_argument("dir", metavar="DIR")
    ins.add_argument("--json", action="store_true", help=JSON_HELP)
    ins.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("status", help="state, tracked memory and last cycle's timings of one or all processes")
    s.add_argument("pid", type=int, nargs="?", metavar="PID")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.add_argument("--simulate", action="store_true", help=CONTROLLER_SIMULATE_HELP)
    s.add_argument("--no-server", action="store_true", help=NO_SERVER_HELP)
    s.set_defaults(fn=cmd_status)

    w = sub.add_parser("wait", help="wait until a process started under gpucr is ready for a checkpoint (its agent "
                       "answers and it has loaded CUDA); exit status 1 at the deadline")
    w.add_argument("pid", type=int, metavar="PID")
    w.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS", help="the deadline (default 30)")
    w.set_defaults(fn=cmd_wait)

    ps = sub.add_parser("ps", help="list the processes under gpucr")
    ps.add_argument("--json", action="store_true", help=JSON_HELP)
    ps.add_argument("--simulate", action="store_true", help=CONTROLLER_SIMULATE_HELP)
    ps.add_argument("--no-server", action="store_true", help=NO_SERVER_HELP)
    ps.set_defaults(fn=cmd_ps)

    dr = sub.add_parser("doctor", help="report hugepages, pinned-memory limits, driver and checkpoint API, with advice")
    dr.add_argument("--json", action="store_true", help=JSON_HELP)
    dr.add_argument("--simulate", action="store_true", help="check simcuda, the simulated driver (test double), "
                    "as 'gpucr run --simulate' uses it, instead of the system's driver and GPU")
    dr.set_defaults(fn=cmd_doctor)

    d = sub.add_parser("demo", help="run, checkpoint and restore a small workload (on the GPU if there is one)")
    d.add_argument("--simulate", action="store_true", help="use simcuda even if a GPU is present")
    d.add_argument("--json", action="store_true", help=JSON_HELP)
    d.set_defaults(fn=cmd_demo)

    sub.add_parser("bench", help=BENCH_HELP)   # its arguments: _bench_parser
    return p


BENCH_HELP = "gpucr against the driver's own checkpoint, side by side (JSON, chart, table)"


def _bench_parser() -> argparse.ArgumentParser:
    """`gpucr bench`'s own parser. Its arguments import the bench (and the coordinator), so they are built
    only for it: the other commands, whose requests may go to the server, do not pay for those imports."""
    from .bench.run import add_arguments
    p = _Parser(prog="gpucr bench", description=BENCH_HELP)
    add_arguments(p)
    p.set_defaults(fn=cmd_bench, command="bench")
    return p


def _fail(args: argparse.Namespace, exc: GpucrError) -> int:
    """A refusal or failure: one line on stderr, and under --json the same as an object on stdout."""
    print(f"gpucr: error: {exc}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json(to_json(ErrorResult(SCHEMA_VERSION, args.command, [], str(exc), exc.code)))
    return exc.code


def _run(argv: list[str]) -> int:
    if not argv:
        _parser().print_help()
        return 2   # as argparse exits when a command is missing
    args = _bench_parser().parse_args(argv[1:]) if argv[:1] == ["bench"] else _parser().parse_args(argv)
    try:
        _check_controller_env(dict(os.environ))
        if getattr(args, "simulate", False) and args.command != "run":
            os.environ["GPUCR_SIMULATE"] = "1"   # the controller itself is told (never by its target)
        if getattr(args, "no_server", False):
            os.environ[route.NO_SERVER_ENV] = "1"
        return args.fn(args)
    except GpucrError as exc:
        return _fail(args, exc)
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()   # here, not at exit: a reader that went away (| head) is caught below
        return code
    except BrokenPipeError:
        # the reader of our output is gone (gpucr ps | head -1): stop quietly, as a shell tool does; stdout
        # goes to /dev/null so that Python's own flush at exit finds nothing to complain about
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13   # killed by SIGPIPE, as the shell would report it


if __name__ == "__main__":
    sys.exit(main())
