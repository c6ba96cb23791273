"""The gpucr command."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from . import coordinator, gpus, paths
from .errors import GpucrError


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in phases.items())


def cmd_run(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        raise GpucrError("nothing to run: give a command after '--', e.g. gpucr run -- python3 app.py")
    env = paths.run_env(simulate=a.simulate)
    if a.staging:
        env["GPUCR_STAGING"] = a.staging
    if a.staging_ahead:
        env["GPUCR_STAGING_AHEAD"] = "1"
    if a.staging_policy:
        env["GPUCR_STAGING_POLICY"] = a.staging_policy
    if a.bounce is not None:
        if a.bounce != 0 and a.bounce < 128:
            raise GpucrError("--bounce takes the ring's size in MiB: 0 (no ring, staging pinned) or at least 128 "
                             "(two 64 MiB slots)")
        env["GPUCR_BOUNCE_MIB"] = str(a.bounce)
    if a.group:
        env["GPUCR_GROUP"] = a.group
    if a.simulate:
        print("gpucr: running on simcuda, the simulated driver (a test double; no GPU is used)", file=sys.stderr)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        raise GpucrError(f"cannot run {cmd[0]}: {exc.strerror}") from exc


def cmd_lib(a: argparse.Namespace) -> int:
    print(paths.simcuda_dir() / "libcuda.so.1" if a.simcuda else paths.agent_lib())
    return 0


def _image_dir(base: str, pid: int, count: int) -> str:
    """One directory per process when several are named: DIR/PID."""
    return os.path.join(base, str(pid)) if count > 1 else base


def _targets(a: argparse.Namespace) -> list[int]:
    """The processes named on the command line, or the members of --group."""
    if a.group:
        pids = [st["pid"] for st in coordinator.ps() if st.get("group") == a.group]
        if not pids:
            raise GpucrError(f"no process of group '{a.group}' is running under gpucr; see 'gpucr ps'")
        return sorted(set(pids) | set(a.pids))
    if not a.pids:
        raise GpucrError("name the processes (PID ...) or a group (--group NAME)")
    return a.pids


def _images(a: argparse.Namespace, pids: list[int]) -> dict[int, str] | None:
    return {pid: _image_dir(a.image, pid, len(pids)) for pid in pids} if a.image else None


def cmd_checkpoint(a: argparse.Namespace) -> int:
    pids = _targets(a)
    results = coordinator.checkpoint_many(pids, level=a.level, timeout=a.timeout, images=_images(a, pids))
    for r in results:
        if a.json:
            continue
        used = r["gpu_used_bytes"]
        print(f"process {r['pid']}: checkpointed (level {r['level']}); {_mib(r['bytes_moved'])} moved by gpucr, "
              f"{_mib(r['bytes_left_to_driver'])} left to the driver; GPU memory used {_mib(used['before'])} -> "
              f"{_mib(used['after'])}; {_fmt_phases(r['phases_s'])}")
        for w in r.get("warnings", []):
            print(f"gpucr: warning: process {r['pid']}: {w}", file=sys.stderr)
        if "image" in r:
            im = r["image"]
            print(f"  image {im['dir']}: {_mib(im['bytes'])} ({_mib(im['bytes_written'])} written, zero chunks skipped) "
                  f"in {im['seconds']:.2f} s, {im['gb_per_s']:.2f} GB/s{' (direct I/O)' if im['direct_io'] else ''}; "
                  "host staging released")
    if a.json:
        _print_json(results[0] if len(results) == 1 and not a.group else results)
    return 0


def cmd_restore(a: argparse.Namespace) -> int:
    pids = _targets(a)
    results = coordinator.restore_many(pids, timeout=a.timeout, drop_staging=a.drop_staging, force=a.force,
                                       images=_images(a, pids), gpu_map=gpus.parse_map(a.map or []))
    for r in results:
        if not a.json:
            print(f"process {r['pid']}: restored and running; {_mib(r.get('bytes_moved', 0))} copied back; "
                  f"{_fmt_phases(r['phases_s'])}")
    if a.json:
        _print_json(results[0] if len(results) == 1 and not a.group else results)
    return 0


def _status_lines(st: dict[str, Any]) -> list[str]:
    if st.get("state") == "unreachable":
        return [f"process {st['pid']}: unreachable: {st.get('error')}"]
    al = st.get("allocations", {})
    state = st["state"] + (f" (level {st['level']})" if st.get("level") else "")
    if st["state"] == "running" and st.get("gate_closed"):
        state += ", parked: a restore stopped before its last step (run 'gpucr restore' again)"
    ring = st.get("bounce_pinned_bytes", 0)
    bounce = f", copies through a {_mib(ring)} pinned bounce ring" if ring else ""
    lines = [f"process {st['pid']}: {state}" + ("" if st.get("cuda") else ", CUDA not loaded") +
             (" [simcuda]" if st.get("simulated") else ""),
             f"  command      {st.get('cmd', '')}",
             f"  tracked      {al.get('tracked', 0)} allocations, {_mib(al.get('tracked_bytes', 0))} moved by gpucr "
             f"({al.get('converted', 0)} converted, {al.get('app_vmm', 0)} application VMM)",
             f"  driver path  {_mib(st.get('bytes_left_to_driver', 0))} left to the driver's checkpoint "
             f"({al.get('native', 0)} small, {al.get('pool', 0)} pool, {al.get('vmm_left_to_driver', 0)} partial VMM)",
             f"  staging      {_mib(st.get('staging_bytes', 0))} in {st.get('staging_segments', 0)} segments "
             f"({st.get('staging')}, {_mib(st.get('staging_pinned_bytes', 0))} pinned"
             f"{', prepared ahead' if st.get('staging_ahead') else ''}{bounce})",
             f"  checkpoints  {st.get('generation', 0)} completed"]
    if st.get("devices"):
        lines.insert(2, "  gpus         " + ", ".join(f"device {d['ordinal']} {d['uuid']}" for d in st["devices"]))
    if st.get("bounce_problem"):
        lines.append(f"  ring         none: {st['bounce_problem']} (copies go through pageable memory)")
    cyc = st.get("last_cycle_ms") or {}
    if any(cyc.get(k) for k in ("gate", "copy_out", "data_in")):
        lines.append("  last cycle   " + ", ".join(
            f"{k.replace('_', ' ')} {cyc[k]:.1f} ms"
            for k in ("staging", "gate", "sync", "copy_out", "release", "driver_lock", "control_out", "control_in",
                      "driver_unlock", "data_in") if k in cyc))
    if st.get("refusal"):
        lines.append(f"  cannot checkpoint: {st['refusal']}")
    return lines


def cmd_status(a: argparse.Namespace) -> int:
    rows = [coordinator.status(a.pid)] if a.pid is not None else coordinator.ps()
    if a.json:
        _print_json(rows[0] if a.pid is not None else rows)
    elif not rows:
        print("no processes under gpucr")
    else:
        for st in rows:
            print("\n".join(_status_lines(st)))
    return 0


def cmd_ps(a: argparse.Namespace) -> int:
    rows = coordinator.ps()
    if a.json:
        _print_json(rows)
        return 0
    if not rows:
        print("no processes under gpucr")
        return 0
    print(f"{'PID':>8}  {'STATE':<14} {'LEVEL':<5} {'GROUP':<10} {'TRACKED':>12} {'DRIVER':>12}  COMMAND")
    for st in rows:
        al = st.get("allocations", {})
        state = st.get("state", "?") if st.get("cuda", True) else "no-cuda"
        print(f"{st['pid']:>8}  {state:<14} {st.get('level') or '-':<5} {(st.get('group') or '-')[:10]:<10} "
              f"{_mib(al.get('tracked_bytes')):>12} "
              f"{_mib(st.get('bytes_left_to_driver')):>12}  {st.get('cmd', st.get('error', ''))[:60]}")
    return 0


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
    print(f"  gpu          {taken_on}, driver CUDA {m['driver_version']}, level {m['level']}")
    for p in m["processes"]:
        al = p["allocations"]
        zero = sum(1 for a in p["data"] for c in a["chunks"] if c.get("zero"))
        chunks = sum(len(a["chunks"]) for a in p["data"])
        print(f"  process {p['pid']} (start time {p['start_time']}), checkpoint {p['generation']}")
        print(f"    moved by gpucr  {al['moved_by_gpucr']} allocations, {_mib(al['bytes'])}, {chunks} chunks ({zero} zero)")
        print(f"    left to driver  {al['left_to_driver']} allocations, {_mib(al['left_to_driver_bytes'])}")
        print("    domains         " + ", ".join(f"{k}: {v}" for k, v in p["domains"].items()))
        print(f"    unknown         {'; '.join(p['unknown']) or 'nothing'}")
    if "image" in m:
        im = m["image"]
        print(f"  written      {_mib(im['bytes_written'])} in {im['seconds']:.2f} s ({im['gb_per_s']:.2f} GB/s"
              f"{', direct I/O' if im['direct_io'] else ''})")
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from . import doctor
    return doctor.main(as_json=a.json)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucr", description="Checkpoint and restore the GPU state of running CUDA processes.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run a command under gpucr's agent")
    r.add_argument("--simulate", action="store_true", help="use simcuda, the simulated driver (test double), instead of a GPU")
    r.add_argument("--staging", metavar="KIND", help="host staging: auto (hugetlbfs when hugepages are free, else "
                   "shared memory; the default), hugetlbfs, shm, or file:DIR")
    r.add_argument("--staging-ahead", action="store_true",
                   help="prepare and pin staging in the background as allocations grow, so a checkpoint finds it ready")
    r.add_argument("--staging-policy", choices=("keep", "drop"),
                   help="after a restore, keep staging pinned for the next cycle (default) or give it back")
    r.add_argument("--bounce", type=int, metavar="MIB", help="the pinned ring that copies go through, staging left "
                   "unpinned (default 1024 MiB, less for a small process); 0: no ring, all of staging pinned instead")
    r.add_argument("--group", metavar="NAME", help="make the process a member of a group, checkpointed and restored together "
                   "with 'gpucr checkpoint --group NAME'")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    r.set_defaults(fn=cmd_run)

    lb = sub.add_parser("lib", help="print the agent's path, for LD_PRELOAD=$(gpucr lib) CMD")
    lb.add_argument("--simcuda", action="store_true", help="print the simulated driver's path instead")
    lb.set_defaults(fn=cmd_lib)

    def pid_cmd(name: str, fn: Callable, help_: str, level: bool) -> None:
        c = sub.add_parser(name, help=help_)
        c.add_argument("pids", type=int, nargs="*", metavar="PID")
        c.add_argument("--group", metavar="NAME", help="every process started with 'gpucr run --group NAME'")
        if level:
            c.add_argument("--level", choices=coordinator.LEVELS, default="full",
                           help="full: data and driver control state (GPU memory to the driver's floor); "
                                "data: data only, the CUDA context stays (faster both ways)")
        c.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                       help="deadline for draining calls in flight and each driver step (default 30)")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        c.add_argument("--image", metavar="DIR", help="checkpoint: also write the data to DIR and free the host staging; "
                       "restore: read the data back from DIR (checked against its manifest)")
        c.set_defaults(fn=fn)

    pid_cmd("checkpoint", cmd_checkpoint, "save a process's GPU memory and give the GPU back", True)
    pid_cmd("restore", cmd_restore, "put a checkpointed process's GPU memory back and let it run", False)
    sub.choices["restore"].add_argument("--drop-staging", action="store_true",
                                        help="give the host staging back after the restore (default: keep it for the next cycle)")
    sub.choices["restore"].add_argument("--map", action="append", metavar="OLD_UUID=NEW_UUID",
                                        help="restore onto other GPUs: the driver re-creates OLD's state on NEW (repeatable)")
    sub.choices["restore"].add_argument("--force", action="store_true",
                                        help="restore even if the manifest lists state it does not cover")

    ins = sub.add_parser("inspect", help="print a checkpoint image's manifest (its certificate)")
    ins.add_argument("dir", metavar="DIR")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("status", help="state, tracked memory and last cycle's timings of one or all processes")
    s.add_argument("pid", type=int, nargs="?", metavar="PID")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    ps = sub.add_parser("ps", help="list the processes under gpucr")
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(fn=cmd_ps)

    dr = sub.add_parser("doctor", help="report hugepages, pinned-memory limits, driver and checkpoint API, with advice")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(fn=cmd_doctor)

    d = sub.add_parser("demo", help="run, checkpoint and restore a small workload (on the GPU if there is one)")
    d.add_argument("--simulate", action="store_true", help="use simcuda even if a GPU is present")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_demo)

    from .bench.run import add_arguments as bench_arguments
    bn = sub.add_parser("bench", help="gpucr against the driver's own checkpoint, side by side (JSON, chart, table)")
    bench_arguments(bn)
    bn.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except GpucrError as exc:
        print(f"gpucr: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
