"""The line protocol every workload speaks: a JSON 'ready' line, then one JSON answer per command."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterable, TextIO


def sized_parser(module: str, size: str, default: float, seed: int = 0) -> argparse.ArgumentParser:
    """A workload's parser with the two arguments every one takes: how much it holds (--gib or --mib) and the --seed
    of its data, so that a restore that loses a byte shows in its digest."""
    ap = argparse.ArgumentParser(prog=f"python3 -m gpucr.workloads.{module}")
    ap.add_argument(f"--{size}", type=float, default=default)
    ap.add_argument("--seed", type=int, default=seed)
    return ap


def weights_arguments(ap: argparse.ArgumentParser, what: str, where: str) -> None:
    """--weights and --save-weights: a swap bench server loads `what` from a safetensors `where` (file or directory),
    as a restarted model server loads its checkpoint, and writes it there once."""
    ap.add_argument("--weights", type=Path, default=None, help=f"load {what} from this safetensors {where}")
    ap.add_argument("--save-weights", type=Path, default=None, help=f"write {what} to this safetensors {where}")


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
