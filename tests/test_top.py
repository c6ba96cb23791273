"""`gpucr top` under a pseudo-terminal (pexpect) against a real `gpucr serve` on simcuda with two swap apps: it shows
their rows and the GPU, refreshes, and its keys park and resume the selected app (issue 29 item 4)."""
from __future__ import annotations

import io
import os
import re
import sys

import pytest

import test_swap
from conftest import gpucr_cli
from test_swap import _state, _until

pexpect = pytest.importorskip("pexpect", reason="in gpucr's test extra: pip install -e .[test]")
swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


def _row(screen: str, name: str) -> str:
    """The last line drawn for app `name` (the screen holds every frame drawn so far)."""
    lines = [line.strip() for line in ANSI.sub("", screen).replace("\r", "\n").split("\n")
             if re.match(rf"{name}\s", line.strip())]
    assert lines, screen[-2000:]
    return lines[-1]


def test_top_shows_the_apps_and_its_keys_park_and_resume_the_selected_one(swap_server, swap_app):
    alpha, beta = swap_app("alpha"), swap_app("beta", "--priority", "3")
    alpha.ask("work 1")
    beta.ask("work 1")
    _until("both hold their memory", lambda: all(
        sum(a["held_bytes"].values()) >= 11 << 20 for a in swap_server.info()["swap"]) and len(swap_server.info()["swap"]) == 2)
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "40"}
    top = pexpect.spawn(sys.executable, ["-m", "gpucr.cli", "top", "--simulate", "--interval", "0.3"], env=env,
                        dimensions=(40, 140), encoding="utf-8", timeout=30)
    top.logfile_read = screen = io.StringIO()   # every frame drawn
    try:
        top.expect("up/down or j/k: select")
        # each row: its name, state, priority and GPU memory (its data and its context, as the driver counts them)
        assert re.search(r"alpha\s+resident\s+0\s+\d+ MiB", _row(screen.getvalue(), "alpha")), screen.getvalue()
        assert re.search(r"beta\s+resident\s+3\s+\d+ MiB", _row(screen.getvalue(), "beta")), screen.getvalue()
        assert "simcuda simulated GPU" in ANSI.sub("", screen.getvalue())
        top.send("j")   # the second row, beta
        top.send("p")
        top.expect("beta: parked")
        assert _state(swap_server, "beta") == "parked" and _state(swap_server, "alpha") == "resident"
        top.expect("gpucr top: server")   # a refresh after the park
        top.expect("gpucr top: server")
        assert re.search(r"beta\s+parked\s+3\s+0 MiB\s+\d+ MiB", _row(screen.getvalue(), "beta")), _row(screen.getvalue(), "beta")
        top.send("r")
        top.expect("beta: resident")
        top.send("k")   # back to alpha, then a park of it
        top.send("p")
        top.expect("alpha: parked")
        top.send("q")
        top.expect(pexpect.EOF)
    finally:
        top.close(force=True)
    assert top.exitstatus == 0, top.before
    log = swap_server.log.read_text()
    assert re.search(r"parked swap app beta \(pid \d+\): asked by gpucr top", log), log
    assert re.search(r"resuming swap app beta \(pid \d+\) asked by gpucr top", log), log


def test_top_once_prints_the_view_and_without_a_server_says_so(swap_server, swap_app):
    swap_app("solo").ask("work 1")
    _until("registered", lambda: swap_server.info()["swap"])
    r = gpucr_cli("top", "--simulate", "--once")
    assert r.returncode == 0 and re.search(r"solo\s+resident", r.stdout), r.stdout + r.stderr
    swap_server.stop()
    r = gpucr_cli("top", "--simulate")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "gpucr: error: gpucr top needs the gpucr server, and none runs: start one with 'gpucr serve'"], r.stderr
