"""The gpucr command: its parser and entry point (`gpucr.cli:main`, and `python -m gpucr.cli`). The commands are
in the modules beside it: launch (run, lib, serve, demo, bench, doctor), cycle (checkpoint, restore, recover),
listing (status, ps, wait, inspect); args holds the argument types and the settings' limits."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .. import server_view, version
from ..agent_tables import SETTINGS
from ..errors import GpucrError
from ..levels import LEVELS
from ..results import SCHEMA_VERSION, ErrorResult, to_json
from ..server import route
from .args import (CONTROLLER_FLAGS, GROUP_MAX_BYTES, JSON_HELP, RETIRED_ENV, STAGING_KINDS, Parser, Retired, image_dir,
                   add_controller_flags, check_controller_env, group_name, host_budget, loopback, prepare_staging,
                   positive_seconds, staging_kind)
from .cycle import cmd_checkpoint, cmd_recover, cmd_restore
from .launch import cmd_bench, cmd_demo, cmd_doctor, cmd_lib, cmd_run, cmd_serve
from .listing import cmd_inspect, cmd_ps, cmd_status, cmd_wait
from .text import mib as _mib, print_json

# What other code and the tests reach through gpucr.cli: the entry point, the parsers, the settings' limits.
__all__ = ["main", "_parser", "_bench_parser", "cmd_serve", "host_budget", "_mib", "CONTROLLER_FLAGS", "GROUP_MAX_BYTES",
           "STAGING_KINDS", "RETIRED_ENV"]



def cmd_top(args: argparse.Namespace) -> int:
    """`gpucr top`, imported when asked: rich is needed there only, and every other command runs without it."""
    from .top import cmd_top as top
    return top(args)

def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="gpucr", description="Checkpoint and restore the GPU state of running CUDA processes.")
    p.add_argument("--version", action="version", version=f"gpucr {version.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run a command under gpucr's agent")
    r.add_argument("--simulate", action="store_true", help="use simcuda, the simulated driver (test double), instead of a GPU")
    r.add_argument("--staging", metavar="KIND", type=staging_kind, help="host staging: auto (hugetlbfs when hugepages "
                   "are free, else shared memory; the default), hugetlbfs, shm, or file:DIR (an existing directory)")
    r.add_argument("--staging-ahead", "--no-staging-ahead", action=Retired)
    r.add_argument("--staging-policy", choices=SETTINGS["GPUCR_STAGING_POLICY"].accepted.split("|"),
                   help="after a restore, keep staging for the next cycle (default) or give it back")
    r.add_argument("--bounce", action=Retired, nargs=1)
    r.add_argument("--host-budget", metavar="SIZE", type=host_budget, help="the most host memory the staging of all "
                   "your processes under gpucr may hold together: a size (64G) or a share of MemTotal (50%%); a "
                   "checkpoint that would pass it is refused before anything is touched (GPUCR_HOST_BUDGET)")
    r.add_argument("--group", metavar="NAME", type=group_name, help="make the process a member of a group, checkpointed "
                   f"and restored together with 'gpucr checkpoint --group NAME' (up to {GROUP_MAX_BYTES} bytes)")
    r.add_argument("--no-server", action="store_true", help="do not start the gpucr server (checkpoints of this "
                   f"process then run in-process unless one runs anyway; the same as {route.NO_SERVER_ENV}=1)")
    server_view.add_swap_flags(r, positive_seconds)
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
        add_controller_flags(c, json=False)
        c.add_argument("--group", metavar="NAME", type=group_name,
                       help="the processes started with 'gpucr run --group NAME' that hold GPU state (others are listed)")
        c.add_argument("--tree", metavar="PID", type=int, help="the processes of the tree under PID (a launcher such as "
                       "torchrun, a shell script) that hold GPU state under gpucr; the others are left alone and listed")
        if level:
            c.add_argument("--level", choices=LEVELS, default="full",
                           help="full: data and driver control state (GPU memory to the driver's floor); "
                                "data: data only, the CUDA context stays (faster both ways)")
        c.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                       help="deadline for draining calls in flight and each driver step (default 30)")
        c.add_argument("--json", action="store_true", help=JSON_HELP)
        c.add_argument("-v", "--phases", action="store_true", help="also print the time of each phase")
        c.add_argument("--image", metavar="DIR", type=image_dir, help=image_help)
        c.set_defaults(fn=fn)

    pid_cmd("checkpoint", cmd_checkpoint, "save a process's GPU memory and give the GPU back", True,
            "also write the data to DIR (one DIR/PID per process when several are named), then free the host staging")
    pid_cmd("restore", cmd_restore, "put a checkpointed process's GPU memory back and let it run", False,
            "read the data back from the image in DIR, once its manifest's checks pass (same process, generation "
            "and GPU model, every chunk's digest)")
    sub.choices["checkpoint"].add_argument("--no-scan", action="store_true",
                                           help="no scan of the memory on the GPU: zero chunks cross the link too, and no "
                                                "digests are taken, so the restore of this checkpoint checks nothing "
                                                "(default: zero chunks skipped, the restore checked)")
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
    rc.add_argument("--timeout", type=positive_seconds, default=60.0, metavar="SECONDS", help="deadline for each step (default 60)")
    add_controller_flags(rc)
    rc.set_defaults(fn=cmd_recover)

    sv = sub.add_parser("serve", help="run the gpucr server (per user: checkpoints without a fresh interpreter and "
                        "cuInit each time); 'gpucr run' starts one when none runs")
    sv.add_argument("--simulate", action="store_true", help="serve on simcuda, the simulated driver (test double)")
    sv.add_argument("--idle-exit", type=positive_seconds, metavar="SECONDS", help="exit after SECONDS with no process under "
                    "gpucr and no request (default: run until stopped)")
    sv.add_argument("--no-data-plane", action=Retired)
    sv.add_argument("--give-back-context", action="store_true", help="give back the server's GPU context and unpin "
                    "the staging after each checkpoint and restore, so the card holds nothing of the server's between "
                    "cycles (each cycle then pins the staging again; default: kept, for fast restores)")
    sv.add_argument("--no-routes", action="store_true", help="copy only over each process's own GPU's host link "
                    "(default: also through idle GPUs joined to it by NVLink, over their host links too)")
    sv.add_argument("--host-budget", metavar="SIZE", type=host_budget, help="the most host memory the swap apps "
                    "parked in host memory hold: 64G or 50%% of MemTotal; past it, the least recently used goes to disk "
                    "(--park-dir; default: no budget, docs/swap.md)")
    sv.add_argument("--prepare-staging", metavar="SIZE", type=prepare_staging, help="staging made, faulted in and "
                    "pinned when the server starts, lent to each app's first checkpoint (then as fast as the later ones) "
                    "and refilled: a size as --host-budget takes it, auto (what --host-budget and the memory available "
                    "allow, leaving max(4 GiB, 10%% of MemTotal) of the memory available) or 0 (the default: the server pins nothing ahead "
                    "unasked)")
    sv.add_argument("--reserve-hugepages", action="store_true", help="as root, reserve --prepare-staging's SIZE in 2 MiB "
                    "hugepages when the server starts and give them back when it stops: staging made ahead is then on "
                    "hugepages, ready sooner after the start (docs/server.md)")
    sv.add_argument("--skip-unchanged", action="store_true", help="a checkpoint copies out only the 2 MiB chunks "
                    "whose digest changed since this server's last copy out of the process into the same staging, not "
                    "only those not all zero (default: every chunk not all zero, so each cycle moves the same bytes; "
                    "docs/server.md)")
    sv.add_argument("--park-dir", metavar="DIR", help="where parked swap apps past --host-budget go as images: a "
                    "directory of yours, mode 0700 (default: gpucr/parked under $XDG_STATE_HOME or ~/.local/state)")
    sv.add_argument("--http", metavar="HOST:PORT", type=loopback, help="also serve the HTTP API, /metrics and the "
                    "live page on loopback TCP (127.0.0.1:PORT or [::1]:PORT; PORT 0: any free one), every request "
                    "with the token it writes in the runtime dir; it prints the page's address (docs/api.md). "
                    "Without it, they are served on a Unix socket beside the server's only")
    sv.add_argument("--show-http", action="store_true", help="print where the running server's HTTP API listens, as "
                    "shell assignments (GPUCR_SOCK, GPUCR_URL, GPUCR_TOKEN_FILE, GPUCR_PAGE): "
                    "eval \"$(gpucr serve --show-http)\"")
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
    add_controller_flags(s)
    s.set_defaults(fn=cmd_status)

    w = sub.add_parser("wait", help="wait until a process started under gpucr is ready for a checkpoint (its agent "
                       "answers and it has loaded CUDA); exit status 1 at the deadline")
    w.add_argument("pid", type=int, metavar="PID")
    w.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS", help="the deadline (default 30)")
    w.set_defaults(fn=cmd_wait)

    ps = sub.add_parser("ps", help="list the processes under gpucr")
    add_controller_flags(ps)
    ps.set_defaults(fn=cmd_ps)

    tp = sub.add_parser("top", help="the swap service's apps and GPUs, refreshing; keys park and resume the selected app")
    tp.add_argument("--simulate", action="store_true", help="the server on simcuda, the simulated driver (test double)")
    tp.add_argument("--interval", type=positive_seconds, default=1.0, metavar="SECONDS",
                    help="refresh every SECONDS (default 1)")
    tp.add_argument("--once", action="store_true", help="print the view once and exit (the default when stdin is "
                    "not a terminal)")
    tp.set_defaults(fn=cmd_top)

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
    from ..bench.run import add_arguments
    from ..bench.swap_scenario import add_arguments as add_swap_arguments
    p = Parser(prog="gpucr bench", description=BENCH_HELP)
    add_arguments(p)
    add_swap_arguments(p)
    p.set_defaults(fn=cmd_bench, command="bench")
    return p


def _fail(args: argparse.Namespace, exc: GpucrError) -> int:
    """A refusal or failure: one line on stderr, and under --json the same as an object on stdout."""
    print(f"gpucr: error: {exc}", file=sys.stderr)
    if getattr(args, "json", False):
        print_json(to_json(ErrorResult(SCHEMA_VERSION, args.command, [], str(exc), exc.code)))
    return exc.code


def _run(argv: list[str]) -> int:
    if not argv:
        _parser().print_help()
        return 2   # as argparse exits when a command is missing
    args = _bench_parser().parse_args(argv[1:]) if argv[:1] == ["bench"] else _parser().parse_args(argv)
    try:
        check_controller_env(dict(os.environ))
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
