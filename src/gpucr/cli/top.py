"""`gpucr top`: the swap service's view in a terminal, as the live page shows it (GPUs as memory bars split by app, the
apps with their state, the recent switches), refreshing; keys park or resume the selected app. It reads the server's
`swap_view` (what the server holds: no agent is asked anything at a tick) and parks and resumes through the server's
own requests, as the HTTP API does."""
from __future__ import annotations

import argparse
import os
import select
import sys
import termios
import time
import tty
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..errors import GpucrError
from ..server import route
from ..server_view import mib

BAR = 40
COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
KEYS_HELP = "up/down or j/k: select   p: park   r: resume   q: quit"
UP, DOWN = ("\x1b[A", "k"), ("\x1b[B", "j")


def _view() -> dict[str, Any]:
    return route.swap("swap_view", {"switches": 5}, "gpucr top", timeout=10.0)


def _ago(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _bar(g: dict[str, Any], colour: dict[str, str]) -> Text:
    """The GPU's memory as BAR cells: each app's share in its colour, the server's and the others' in grey."""
    total = g["total_bytes"] or 1
    bar = Text()
    parts = [(n, b, colour.get(n, "white")) for n, b in g["apps"].items()]
    parts += [("server", g["server_bytes"], "grey50"), ("others", g["others_bytes"] or 0, "grey35")]
    for _name, n, style in parts:
        bar.append("█" * round(BAR * n / total), style=style)
    return bar.append("·" * max(0, BAR - len(bar)), style="grey23")


def frame(view: dict[str, Any], selected: str | None, message: str) -> Group:
    colour = {a["name"]: COLOURS[i % len(COLOURS)] for i, a in enumerate(view["apps"])}
    sv = view["server"]
    head = Text(f"gpucr top: server pid {sv['pid']}{' (simcuda)' if sv['simulated'] else ''}, up {_ago(sv['up_s'])}; "
                f"host memory pinned {mib(view['host']['pinned_bytes'])}", style="bold")
    gpus = Table(box=None, pad_edge=False, show_header=False)
    for g in view["gpus"]:
        gpus.add_row(g["name"], _bar(g, colour), f"{mib(g['used_bytes'])} of {mib(g['total_bytes'])}")
    apps = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("APP", "STATE", "PRIO", "GPU MEM", "PARKED", "IDLE", "PARKS", "RESUMES", "NOTE"):
        apps.add_column(col, justify="right" if col in ("PRIO", "GPU MEM", "PARKED", "IDLE", "PARKS", "RESUMES") else "left")
    for a in view["apps"]:
        parked = a["parked_host_bytes"] or a["parked_disk_bytes"]
        apps.add_row(Text(a["name"], style=colour[a["name"]]), a["state"], str(a["priority"]), mib(a["resident_bytes"]),
                     mib(parked) if parked else "-", _ago(a["idle_s"]), str(a["switches"]["park"]),
                     str(a["switches"]["resume"]), a["waiting"] or a["why"],
                     style="reverse" if a["name"] == selected else None)
    if not view["apps"]:
        apps.add_row("(no swap app: start one with gpucr run --swap)")
    switches = [Text(f"{time.strftime('%H:%M:%S', time.localtime(s['at']))} {s['direction']:<6} {s['app']}: "
                     f"{mib(s['bytes_moved'])} in {s['seconds']:.3f} s", style="grey62") for s in view["switches"]]
    return Group(head, Text(""), gpus, Text(""), apps, Text(""), *switches, Text(""),
                 Text(message or KEYS_HELP, style="bold yellow" if message else "grey50"))


@contextmanager
def _keys() -> Iterator[int]:
    """stdin in cbreak mode (a key at a time, no echo), restored at the end."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _key(fd: int, timeout: float) -> str:
    """The next key pressed within timeout ("" if none); an arrow key's escape sequence read whole."""
    if not select.select([fd], [], [], timeout)[0]:
        return ""
    return os.read(fd, 8).decode(errors="replace")


def _move(names: list[str], selected: str | None, step: int) -> str | None:
    if not names:
        return None
    i = names.index(selected) if selected in names else 0
    return names[max(0, min(len(names) - 1, i + step))]


def _act(key: str, selected: str | None) -> str:
    """Park or resume the selected app; what to say of it."""
    op = {"p": "swap_park", "r": "swap_resume"}[key]
    if selected is None:
        return "no app selected"
    try:
        row = route.swap(op, {"name": selected, "by": "gpucr top"}, "gpucr top")
        return f"{selected}: {row['state']}"
    except GpucrError as exc:
        return str(exc)


def cmd_top(a: argparse.Namespace) -> int:
    console = Console()
    view = _view()
    if a.once or not sys.stdin.isatty():
        console.print(frame(view, None, ""))
        return 0
    selected: str | None = view["apps"][0]["name"] if view["apps"] else None
    message = ""
    with _keys() as fd, Live(frame(view, selected, message), console=console, auto_refresh=False, screen=True) as live:
        while True:
            key = _key(fd, a.interval)
            names = [x["name"] for x in view["apps"]]
            if key in ("q", "\x03"):
                return 0
            if key in UP or key in DOWN:
                selected = _move(names, selected, -1 if key in UP else 1)
            elif key in ("p", "r"):
                live.update(frame(view, selected, f"{'parking' if key == 'p' else 'resuming'} {selected}..."), refresh=True)
                message = _act(key, selected)
            view = _view()
            names = [x["name"] for x in view["apps"]]
            selected = selected if selected in names else (names[0] if names else None)
            live.update(frame(view, selected, message), refresh=True)
