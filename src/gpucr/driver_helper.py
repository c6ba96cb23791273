"""The driver's calls on other processes (lock, checkpoint, restore, unlock, state), made from a helper process.

Why: the driver's checkpoint of a process slows when the process that asks for it is copying at the same time, and
not when another process copies. On one H100 (bench/results/2026-12-06-h100-driver-overlap-child.json, medians of 3)
a process's lock + checkpoint took 0.536 s alone, 1.061 s beside copies at the link's speed made by the asking
process, and 0.578 s beside the same copies made by a child of it. A gpucr server copies while the driver takes the
control state (in a two-way switch, A's checkpoint and B's restore beside copies both ways), so it asks from a
helper that copies nothing: a child with the driver loaded (cuInit) and no CUDA context.

The helper answers each request in a thread of its own (a switch asks for A's checkpoint and B's restore at once).
Requests and answers are JSON lines on its stdin and stdout, each with the id that pairs them. Should the helper end,
a call waiting on it fails (its outcome is then unknown, as for a driver that does not answer: the process's state
says what happened), and later calls are made in the server itself (Driver._ask)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import IO, Any

from .driver import controller_driver
from .errors import GpucrError

START_LIMIT_S = 30.0   # the helper's interpreter, imports and cuInit


class DriverHelper:
    """The server's side: call() sends one request and waits for its answer (the caller's own watch limits it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._lock = threading.Lock()   # one writer of requests at a time
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._next = 0
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="gpucr-driver-helper", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls) -> DriverHelper:
        """A helper with the same driver as this process (GPUCR_SIMULATE passes on), ready to answer."""
        # cwd /: `python -m` looks for the module in its working directory first
        proc = subprocess.Popen([sys.executable, "-m", "gpucr.driver_helper"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1, close_fds=True, cwd="/")
        helper = cls(proc)
        try:
            rc, _ = helper.call("ready", 0)
        except GpucrError:
            helper.close()
            raise
        if rc != 0:
            helper.close()
            raise GpucrError(f"the driver helper could not load the driver (CUDA error {rc})")
        return helper

    def alive(self) -> bool:
        return not self._ended

    def call(self, name: str, pid: int, **kw: Any) -> tuple[int, int]:
        """The driver's `name` call on process `pid`, made in the helper: (rc, the state read, or 0)."""
        done, box = threading.Event(), []
        if kw.get("pairs"):
            kw["pairs"] = [[old.hex(), new.hex()] for old, new in kw["pairs"]]
        with self._lock:   # one writer at a time, and no end while a request is being registered
            if self._ended:
                raise GpucrError("the driver helper has ended")
            self._next += 1
            ident = self._next
            self._waiting[ident] = (done, box)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"id": ident, "call": name, "pid": pid, **kw}) + "\n")
                self.proc.stdin.flush()
                sent = True
            except OSError:
                sent = False
        if not sent:
            self._end()
            raise GpucrError("the driver helper has ended")
        done.wait(START_LIMIT_S if name == "ready" else None)
        if not box:
            raise GpucrError("the driver helper ended before it answered" if self._ended else
                             "the driver helper did not start")
        answer = box[0]
        if "error" in answer:
            raise GpucrError(f"the driver helper: {answer['error']}")
        return int(answer["rc"]), int(answer.get("value", 0))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
                with self._lock:
                    done, box = self._waiting.pop(int(answer["id"]))
            except (ValueError, KeyError, TypeError):
                continue   # not an answer to a request of ours
            box.append(answer)
            done.set()
        self._end()

    def _end(self) -> None:
        """It ended: every call still waiting fails, and none is sent any more."""
        with self._lock:
            self._ended = True
            waiting, self._waiting = self._waiting, {}
        for done, _box in waiting.values():
            done.set()

    def close(self) -> None:
        """Stop it (the server's stop). A call it is still making in the driver goes on there until it returns."""
        self._ended = True
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _answer(out: IO[str], lock: threading.Lock, request: dict[str, Any]) -> None:
    reply: dict[str, Any] = {"id": request.get("id")}
    try:
        drv = controller_driver()
        if request["call"] == "ready":
            reply["rc"] = 0
        else:
            pairs = [(bytes.fromhex(o), bytes.fromhex(n)) for o, n in request.get("pairs") or []]
            reply["rc"], reply["value"] = drv.process_call(request["call"], int(request["pid"]),
                                                           int(request.get("timeout_ms", 0)), pairs or None)
    except (GpucrError, ValueError, KeyError, TypeError) as exc:
        reply["error"] = str(exc)
    with lock:
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    """The helper's side: each request line answered in a thread of its own, until stdin ends."""
    out, lock = sys.stdout, threading.Lock()
    sys.stdout = sys.stderr   # nothing else may write on the answers' pipe
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        threading.Thread(target=_answer, args=(out, lock, request), daemon=True).start()
    os._exit(0)   # a call still in the driver is not waited for: the server stopped asking


if __name__ == "__main__":
    main()
