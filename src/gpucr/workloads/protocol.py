"""The line protocol every workload speaks: a JSON 'ready' line, then one JSON answer per command."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from typing import Callable, Iterable, TextIO


def answer(handle: Callable[[list[str]], dict], words: list[str]) -> dict:
    """One command's answer; an exception becomes {"error": ...}, which the driver of the test reads."""
    try:
        return handle(words)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def claim_stdout() -> TextIO:
    """A private copy of stdout for the protocol, with fd 1 pointed at stderr: whatever else writes
    to stdout (NCCL_DEBUG, a library's print) then cannot break the one-JSON-line-per-answer stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def serve(handle: Callable[[list[str]], dict], ready: dict, out: TextIO | None = None,
          lines: Iterable[str] | None = None) -> None:
    out = out or sys.stdout
    # SIGUSR1: every Python thread's stack on stderr, for a test that finds the workload stuck (tests/gpu)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(json.dumps({"ready": True, "pid": os.getpid(), **ready}), file=out, flush=True)
    for line in lines if lines is not None else sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        print(json.dumps(answer(handle, words)), file=out, flush=True)
