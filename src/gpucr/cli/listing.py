"""The commands that only read: status, ps (every process under gpucr, on either driver), wait and inspect (an
image's manifest)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .. import coverage, server_view
from ..driver import SIMULATE_ENV
from ..errors import GpucrError
from ..results import SCHEMA_VERSION, ProcessStatus, StatusResult, from_json, to_json
from ..server import route
from .cycle import settled
from .text import gbps, mib, plural, print_json

STATUS_WAIT_S = 10.0   # how long `status` waits for a process still starting under gpucr
ONE_KIND_ENV = "GPUCR_PS_ONE_KIND"   # internal: a `ps` listing for another, of its own driver kind only


def _host_memory_line(st: ProcessStatus) -> str:
    """The limits staging is admitted under: the user's budget (shared by all processes) and the cgroup."""
    budget = (f"budget {mib(st.host_budget_bytes)}, {mib(st.host_budget_used_bytes)} of it used by all processes "
              "under gpucr" if st.host_budget_bytes else
              f"no budget (GPUCR_HOST_BUDGET), {mib(st.host_budget_used_bytes)} staged by all processes under gpucr")
    cg = st.memory_cgroup
    cgroup = (f"; cgroup {cg.path} {cg.limit_file} {mib(cg.limit_bytes)}, {mib(cg.current_bytes)} used"
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
             f"  tracked      {plural(al.tracked, 'allocation', 'allocations')}, {mib(al.tracked_bytes)} moved by gpucr "
             f"({al.converted} converted, {al.app_vmm} application VMM)",
             f"  driver path  {mib(st.bytes_left_to_driver)} left to the driver's checkpoint "
             f"({al.native} small, {al.pool} pool, {al.vmm_left_to_driver} partial VMM)",
             *coverage.status_lines(st.coverage),
             f"  staging      {mib(st.staging_bytes)} in {plural(st.staging_segments, 'segment', 'segments')} "
             f"({st.staging_kind})",
             _host_memory_line(st),
             f"  checkpoints  {st.generation} completed"]
    for i, g in enumerate(st.gpus):
        lines.insert(2 + i, f"  gpu          device {g.ordinal} {g.uuid}: this process {mib(g.process_bytes)}, "
                            f"GPU used {mib(g.gpu_used_bytes)} of {mib(g.gpu_total_bytes)}")
    if al.pieces:   # each piece is its own memory, with an fd of its own (docs/swap.md, the two-way switch)
        lines.append(f"  pieces       {al.pieces} pieces of large allocations; the agent holds {al.own_fds} fds of GPU "
                     f"memory" + (f" (limit {al.fd_limit})" if al.fd_limit else ""))
    if al.not_exportable:
        lines.append(f"  exportable   {plural(al.not_exportable, 'allocation is', 'allocations are')} not: no file descriptor was left for them "
                     "(RLIMIT_NOFILE; raise 'ulimit -n' before starting the application)")
    cyc = st.last_cycle
    if cyc.gate_s or cyc.release_s:
        steps = ("gate", "sync", "release")
        lines.append("  last cycle   " + ", ".join(f"{k.replace('_', ' ')} {getattr(cyc, k + '_s'):.3f} s"
                                                  for k in steps))
    if st.refusal:
        lines.append(f"  cannot checkpoint: {st.refusal}")
    return lines


def cmd_status(a: argparse.Namespace) -> int:
    if a.pid is None:
        return cmd_ps(a, command="status")
    st = settled([a.pid], STATUS_WAIT_S, lambda: route.status(a.pid), need_cuda=False)
    if a.json:
        print_json(to_json(StatusResult(SCHEMA_VERSION, "status", [st])))
    else:
        print("\n".join(_status_lines(st)))
        print("\n".join(server_view.server_lines()))   # what the servers hold apart from the process
    return 0


def cmd_wait(a: argparse.Namespace) -> int:
    from .. import preflight
    t = preflight.wait_ready(a.pid, a.timeout)
    print(f"process {t.pid}: ready under gpucr, CUDA loaded" + (" [simcuda]" if t.simulated else ""))
    return 0


def _take_listed_kind() -> None:
    """When this controller was not told its driver: act through simcuda if every process under gpucr here
    that answers runs on it (one hello each: the kind must be known before the listing)."""
    from .. import target as targets
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
    from .. import target as targets
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
        print_json(to_json(rows))
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
              f"{mib(st.allocations.tracked_bytes):>12} {mib(st.bytes_left_to_driver):>12} "
              f"{mib(st.staging_bytes):>12}  {st.cmd[:60]}")
    for u in rows.unreachable:   # the whole reason: it is what the user needs to act on
        print(f"{u.pid:>8}  {'unreachable':<14} {'-':<5} {'-':<10} {'-':>12} {'-':>12} {'-':>12}  {u.error}")
    budgets = {st.host_budget_bytes for st in rows.processes if st.host_budget_bytes}
    if rows.processes:
        used = max(st.host_budget_used_bytes for st in rows.processes)
        print(f"host staging: {mib(used)} held by all processes under gpucr; budget "
              f"{', '.join(mib(b) for b in sorted(budgets)) if budgets else 'none (GPUCR_HOST_BUDGET)'}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from pathlib import Path
    from .. import manifest
    m = manifest.load(Path(a.dir))
    if a.json:
        print_json(m)
        return 0
    print(f"checkpoint {m['id']}, taken {m['created']} on {m['host']}" + (" [simcuda]" if m.get("simulated") else ""))
    taken_on = ", ".join(f"{g['name']} ({g['uuid']})" for g in m.get("gpus") or [m["gpu"]])
    print(f"  gpu          {taken_on}, driver CUDA {manifest.cuda_version(m['driver_version'])}, level {m['level']}")
    for p in m["processes"]:
        al = p["allocations"]
        zero = sum(1 for a in p["data"] for c in a["chunks"] if c.get("zero"))
        chunks = sum(len(a["chunks"]) for a in p["data"])
        print(f"  process {p['pid']} (start time {p['start_time']}), checkpoint {p['generation']}")
        print(f"    moved by gpucr  {plural(al['moved_by_gpucr'], 'allocation', 'allocations')}, {mib(al['bytes'])}, "
              f"{plural(chunks, 'chunk', 'chunks')} ({zero} zero)")
        print(f"    left to driver  {plural(al['left_to_driver'], 'allocation', 'allocations')}, {mib(al['left_to_driver_bytes'])}"
              f"{coverage.left_summary(coverage.manifest_left(p.get('coverage')))}")
        print("    domains         " + ", ".join(f"{k}: {v}" for k, v in p["domains"].items()))
        print(f"    unknown         {'; '.join(p['unknown']) or 'nothing'}")
    if "image" in m:
        im = m["image"]
        print(f"  written      {mib(im['bytes_written'])} of {mib(im['bytes'])} (zero chunks are not) in "
              f"{im['transfer_s']:.2f} s ({gbps(im['bytes_written'], im['transfer_s'])} on disk"
              f"{', direct I/O' if im['direct_io'] else ''})")
    return 0
