"""Threads that watch the GPU every few ms, one per family of calls, as a watchdog, a serving loop or a
busy-wait on events does (issue 24): the commands `poll start [MS] | poll counts | poll stop` of a workload.
A workload names its families and says how a thread enters the GPU and makes one call."""
from __future__ import annotations

import threading
from typing import Any


class Pollers:
    FAMILIES: tuple[str, ...] = ()
    DEFAULT_MS = 5.0

    def __init__(self) -> None:
        self.stop_flag = threading.Event()
        self.threads: list[threading.Thread] = []
        self.counts = dict.fromkeys(self.FAMILIES, 0)
        self.errors: list[str] = []

    def enter(self) -> Any:
        """In the new thread, before its first call: enter the context; returns what call() is given."""
        raise NotImplementedError

    def call(self, family: str, state: Any) -> None:
        """One call of the family; raises on a failure."""
        raise NotImplementedError

    def _run(self, family: str, every_s: float) -> None:
        try:
            state = self.enter()
            while not self.stop_flag.wait(every_s):
                self.call(family, state)
                self.counts[family] += 1
        except Exception as exc:  # reported by "poll counts" and "poll stop"
            self.errors.append(f"{family}: {type(exc).__name__}: {exc}")

    def command(self, words: list[str]) -> dict:
        """poll start [MS [FAMILY,...]] | poll counts | poll stop"""
        if words[0] == "start":
            every_s = (float(words[1]) if len(words) > 1 else self.DEFAULT_MS) / 1e3
            families = words[2].split(",") if len(words) > 2 else list(self.FAMILIES)
            unknown = set(families) - set(self.FAMILIES)
            if unknown:
                raise ValueError(f"no such family of calls: {', '.join(sorted(unknown))} (known: {', '.join(self.FAMILIES)})")
            self.counts = dict.fromkeys(families, 0)
            self.threads = [threading.Thread(target=self._run, args=(f, every_s), daemon=True) for f in families]
            for t in self.threads:
                t.start()
            return {"started": families}
        if words[0] == "stop":
            self.stop_flag.set()
            for t in self.threads:
                t.join()
        return {"counts": dict(self.counts), "errors": list(self.errors)}
