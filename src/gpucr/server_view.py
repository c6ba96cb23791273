"""What the CLI shows of the gpucr servers (their holdings and their swap apps), and `gpucr run --swap`'s flags and
registration with the server's swap service (docs/swap.md)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from .levels import LEVELS
from .server import route


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def add_swap_flags(r: argparse.ArgumentParser, seconds: Callable[[str], float]) -> None:
    r.add_argument("--swap", action="store_true", help="put the app under the gpucr server's swap service: parked "
                   "when idle or when another needs the GPU, resumed at its first call that needs the GPU (docs/swap.md)")
    r.add_argument("--name", metavar="NAME", help="with --swap: the app's name in 'gpucr ps' (default: CMD-PID)")
    r.add_argument("--priority", type=int, default=0, metavar="N", help="with --swap: apps of lower priority are "
                   "parked first, and never one of higher priority than the app that needs room (default 0)")
    r.add_argument("--min-resident", type=seconds, default=0.0, metavar="SECONDS", help="with --swap: once resumed, "
                   "the app is not parked again for this long (default 0)")
    r.add_argument("--idle-park", type=seconds, metavar="SECONDS", help="with --swap: park the app once it has "
                   "submitted no work to the GPU for this long (polling and synchronizing do not count; default: never)")
    r.add_argument("--park-deadline", type=seconds, default=30.0, metavar="SECONDS", help="with --swap: a park waits "
                   "this long for the app's calls in flight (a long kernel) to return; past it the app stays resident "
                   "(default 30)")
    r.add_argument("--wait-limit", type=seconds, metavar="SECONDS", help="with --swap: an allocation that waits "
                   "longer than this for room or for the app's resume fails with out-of-memory, as without the "
                   "service; other calls (a launch) keep waiting (default: no limit)")
    r.add_argument("--park-level", choices=LEVELS, default="full", help="with --swap: what a park saves: full (data "
                   "and the CUDA context, the app's GPU memory goes to zero) or data (data only: its context stays on "
                   "the GPU, a resume is quicker; default full)")
    r.add_argument("--any-gpu", action="store_true", help="with --swap: the app may be resumed on another GPU of the "
                   "same chip with room when its own has none; its device pointers keep their values (docs/swap.md)")


FIRST_WATCH_MS = 10000   # the server watches a registered app within a tick or two (0.5 s each)


def register_swap(a: argparse.Namespace, cmd: list[str], env: dict[str, str]) -> None:
    """This process (the app, once exec'd) registered with the server's swap service."""
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in env:
        # JAX takes 0.75 of the card at first use and never gives it back: nothing could be parked for it
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        print("gpucr: --swap: XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX would otherwise hold 0.75 of the GPU)",
              file=sys.stderr)
    if a.wait_limit is not None:   # the agent ends the wait itself: the server may be busy, or gone
        env["GPUCR_SWAP_WAIT_LIMIT_MS"] = str(max(1, round(a.wait_limit * 1000)))
    # an allocation that fails before the server's first watch on the app (its next tick) waits for it
    env.setdefault("GPUCR_SWAP_FIRST_WATCH_MS", str(FIRST_WATCH_MS))
    name = a.name or f"{os.path.basename(cmd[0])}-{os.getpid()}"
    route.register_swap(a.simulate, {"pid": os.getpid(), "name": name, "priority": a.priority,
                                     "min_resident": a.min_resident, "idle_park": a.idle_park,
                                     "park_deadline": a.park_deadline, "wait_limit": a.wait_limit,
                                     "any_gpu": a.any_gpu, "park_level": a.park_level})


def server_lines() -> list[str]:
    """Each gpucr server that runs (one on the system's driver, one on simcuda), apart from the processes.
    What a server holds for the processes (pinned staging and its owners) and its swap apps go under its line."""
    from .server import client
    if not route.server_wanted():
        return ["server: not used (--no-server)"]
    lines = [line for info in (client.info(False), client.info(True)) if info is not None
             for line in (server_line(info), *_holdings(info), *_swap_apps(info))]
    return lines or ["server: not running (checkpoints run in-process)"]


def _holdings(info: dict[str, Any]) -> list[str]:
    """What a server holds of each process's staging (mapped and pinned in it), by the process that owns it;
    staging the driver did not unpin (stuck) is named as such."""
    held = info.get("staging") or []
    lines = [f"  holds for process {h['pid']}: {mib(h['mapped_bytes'])} of staging mapped, "
             f"{mib(h['pinned_bytes'])} pinned" + (" (STUCK: the driver did not unpin it; see its log)"
                                                   if h["stuck"] else "") for h in held]
    return lines or ["  holds no staging of any process"]


def _swap_apps(info: dict[str, Any]) -> list[str]:
    """The server's swap apps: state, GPU memory held now and at its peak, time since it last submitted work, and
    the last wake's time from its demanding call to its restore's start."""
    apps = info.get("swap") or []
    if not apps:
        return []
    host = info.get("swap_host") or {}
    lines = [f"  swap host memory: {mib(host['host_bytes'])} of --host-budget {mib(host['host_budget_bytes'])} held by "
             f"parked apps; {host['on_disk']} on disk in {host['park_dir']}"] if host.get("host_budget_bytes") else []
    lines += [f"  swap apps: {'NAME':<16} {'PID':>8} {'PRIO':>4} {'STATE':<9} {'HELD':>10} {'PEAK':>10} {'IDLE':>8} "
             f"{'PARKS':>5} {'WAKE':>9}"]
    for a in apps:
        wake = "-" if a["last_wake_ms"] is None else f"{a['last_wake_ms']:.1f} ms"
        lines.append(f"             {a['name'][:16]:<16} {a['pid']:>8} {a['priority']:>4} {a['state']:<9} "
                     f"{mib(sum(a['held_bytes'].values())):>10} {mib(sum(a['peak_bytes'].values())):>10} "
                     f"{a['idle_s']:>7.1f}s {a['parks']:>5} {wake:>9}" + _swap_note(a))
    return lines


def _swap_note(app: dict[str, Any]) -> str:
    """Its image when on disk; what it waits for (room, or its resume) and for how long, else its last refusal or
    failure."""
    image = f"  [{app['image']}]" if app.get("image") else ""
    if app.get("waiting"):
        return f"{image}  (WAITING {app['waiting_s']:.1f} s for {app['waiting']})"
    return image + (f"  ({app['why']})" if app["why"] else "")


def server_line(info: dict[str, Any]) -> str:
    """A server: its pid and the GPU memory it holds (measured for its pid)."""
    held = "unknown (no per-process count here)" if info["gpu_bytes"] is None else mib(info["gpu_bytes"])
    ctx = info.get("contexts") or []
    return (f"server: pid {info['pid']}{' [simcuda]' if info['simulated'] else ''}, up {info['up_s']:.0f} s, "
            f"{info['requests']} requests; GPU memory it holds (apart from the processes): {held} "
            f"on {len(info['gpus'])} GPU{'s' if len(info['gpus']) != 1 else ''} "
            f"({f'its data-plane context on {len(ctx)}' if ctx else 'no context'}; "
            f"{mib(info.get('pinned_staging_bytes', 0))} of staging pinned)")


def service_lines(info: dict[str, Any]) -> list[str]:
    """`gpucr serve --status`: the server, where its HTTP API listens, and its swap apps."""
    http = info.get("http") or {}
    where = (f"  HTTP API: {http['socket']}" + (f" and {http['url']} (its token in {http['token_file']})"
                                                if http.get("url") else "")) if http else "  HTTP API: off (its log says why)"
    return [server_line(info), where, *_swap_apps(info)]
