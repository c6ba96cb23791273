"""The line protocol every workload speaks: a JSON 'ready' line, then one JSON answer per command."""
from __future__ import annotations

import json
import os
import sys
from typing import Callable


def serve(handle: Callable[[list[str]], dict], ready: dict) -> None:
    print(json.dumps({"ready": True, "pid": os.getpid(), **ready}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        try:
            out = handle(words)
        except Exception as exc:  # the driver of the test reads it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
