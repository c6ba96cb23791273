"""Does the driver checkpoint one process while it restores another, or one after the other? (issue 28: a two-way
switch runs A's lock and checkpoint beside B's restore and unlock, since 953f8e4. In the H100 run of 2026-12-05, made
before that, A's took 0.70-0.82 s beside the copies against 0.43-0.51 s alone, and B's 0.23-0.40 s after it. If the
driver serialises the two, their sum is the switch's floor whatever the order we ask them in.)

Two processes without gpucr (the driver's own path: it copies their device memory too, so they hold little):
A running, B checkpointed by the driver. Each round times A's lock + checkpoint and B's restore + unlock alone,
then both at once from two threads (coordinator/switching.py's _at_once), each step's start and end on one clock; then
puts them back (A restored, B checkpointed) for the next round. Prints a table and writes $OUT/driver-overlap.json:
per round, the steps' [start, end] seconds, and the medians. Serialised steps show as overlap_s near 0 and
together_s near the sum of the two alone; overlapping ones as together_s near the longer.

Then, with --beside (default copies,makes), what a switch runs beside A's checkpoint, one at a time in this process
on A's GPU (WHAT@child: in a child process of its own, to tell a lock inside one process's driver from the
GPU's or the link's own limits): "copies" (a 1 GiB copy out then in, over and over, as the copies both ways), "chunks" (the same in
copies of 32 MiB) and "makes" (256 MiB of VMM memory made, mapped, unmapped and released, over and over, as the
memory made for B). A's lock + checkpoint beside
each, in the same rounds, is out_beside_<what>_s: the 2026-12-06 H100 run found the driver doing A out and B in at
once (0.394 s together), while in a switch A's checkpoint took 0.74 s against 0.41 s alone.

On one H100 (bench/results/2026-12-06-h100-driver-overlap-beside.json) A's checkpoint took 0.52-0.59 s alone, about
the same beside B's restore, 1.16-1.25 s beside the copies (1.24 s in 32 MiB chunks) and 0.96 s beside the makes.

    python3 scripts/driver_overlap.py [--rounds 5] [--workload torch_app] [--gib 0.25] [--beside copies,makes] [--simulate]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpucr.coordinator.switching import _at_once
from gpucr.driver import Driver, ProcessState, controller_driver
from gpucr.vmm import Vmm
from gpucr.workloads.runner import Workload

Span = tuple[float, float]


def _timed(step: Callable[[], None], t0: float) -> Span:
    start = time.monotonic() - t0
    step()
    return start, time.monotonic() - t0


def _out(drv: Driver, pid: int) -> None:
    drv.lock(pid, 30_000)
    drv.checkpoint(pid)


def _in(drv: Driver, pid: int) -> None:
    drv.restore(pid)
    drv.unlock(pid)


def _together(drv: Driver, a: int, b: int) -> tuple[Span, Span]:
    """A out and B in at once, through the switch's own _at_once: each one's [start, end] from the same origin."""
    t0 = time.monotonic()
    got: dict[str, Span] = {}
    _at_once(lambda: got.__setitem__("out", _timed(lambda: _out(drv, a), t0)),
             lambda: got.__setitem__("in", _timed(lambda: _in(drv, b), t0)))
    return got["out"], got["in"]


class Beside:
    """One activity of a switch's, run over and over in a thread of this process until stopped; `done` counts them.
    "WHAT@child": the same in a child process of its own (its own CUDA context and driver instance), which tells
    a slowdown inside one process's driver (a lock that the checkpoint call and the copies both take) from one on
    the GPU or its link."""
    PIECE = 256 << 20
    COPY = 1 << 30

    def __init__(self, vmm: Vmm, ctx: int, what: str) -> None:
        self.vmm, self.ctx, self.what, self.done = vmm, ctx, what.removesuffix("@child"), 0
        self.stop = threading.Event()
        self.child = what.endswith("@child")
        self.thread = threading.Thread(target=self._in_child if self.child else self._run)

    def _in_child(self) -> None:
        """The activity in a child, until this one closes its stdin; its count comes back on its stdout."""
        import subprocess
        code = ("import sys; sys.path.insert(0, %r); import driver_overlap as d; d.child_activity(%r)"
                % (str(Path(__file__).parent), self.what))
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        child.stdout.readline()   # its context made, the activity under way
        self.stop.wait()
        child.stdin.close()
        self.done = int(child.stdout.readline() or 0)
        child.wait()

    def _run(self) -> None:
        vmm = self.vmm
        vmm.use(self.ctx)
        if self.what in ("copies", "chunks"):   # chunks: the same bytes in copies of 32 MiB
            h = vmm.create(self.COPY, 0)
            va, host, s = vmm.map(h, self.COPY, 0), vmm.host_alloc(self.COPY), vmm.stream()
            step = self.COPY if self.what == "copies" else 32 << 20
            while not self.stop.is_set():
                for k in range(0, self.COPY, step):
                    vmm.d2h(host + k, va + k, step, s)
                for k in range(0, self.COPY, step):
                    vmm.h2d(va + k, host + k, step, s)
                vmm.sync(s)
                self.done += 1
            vmm.destroy_stream(s)
            vmm.host_free(host)
            vmm.unmap(va, self.COPY)
            vmm.release(h)
        else:
            while not self.stop.is_set():
                h = vmm.create(self.PIECE, 0)
                va = vmm.map(h, self.PIECE, 0)
                vmm.unmap(va, self.PIECE)
                vmm.release(h)
                self.done += 1

    def __enter__(self) -> "Beside":
        self.thread.start()
        time.sleep(1.5 if self.child else 0.05)   # under way before A's lock (a child makes its context first)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def child_activity(what: str) -> None:
    """A child's side of Beside(..., "WHAT@child"): the activity in a thread until stdin closes, then its count."""
    vmm = Vmm(controller_driver())
    act = Beside(vmm, vmm.retain_context(0), what)
    act.thread.start()
    print("ready", flush=True)
    sys.stdin.read()
    act.stop.set()
    act.thread.join()
    print(act.done, flush=True)


def one_round(drv: Driver, a: int, b: int, beside: tuple[str, ...] = (), vmm: Vmm | None = None,
              ctx: int = 0) -> dict[str, Any]:
    """A running and B checkpointed before and after it."""
    out_alone = _timed(lambda: _out(drv, a), time.monotonic())
    _in(drv, a)
    in_alone = _timed(lambda: _in(drv, b), time.monotonic())
    _out(drv, b)
    out, into = _together(drv, a, b)
    _in(drv, a)   # back as it was: A running, B checkpointed
    _out(drv, b)
    extra: dict[str, Any] = {}
    for what in beside:
        assert vmm is not None
        with Beside(vmm, ctx, what) as act:
            span = _timed(lambda: _out(drv, a), time.monotonic())
        _in(drv, a)
        extra[f"out_beside_{what}_s"], extra[f"{what}_done"] = span[1] - span[0], act.done
    return {**extra, "out_alone_s": out_alone[1] - out_alone[0], "in_alone_s": in_alone[1] - in_alone[0],
            "out_together_s": out[1] - out[0], "in_together_s": into[1] - into[0],
            "together_s": max(out[1], into[1]) - min(out[0], into[0]),
            "overlap_s": max(0.0, min(out[1], into[1]) - max(out[0], into[0])),
            "out_span": out, "in_span": into}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workload", default="torch_app", help="a gpucr.workloads module taking --gib (default torch_app)")
    ap.add_argument("--gib", default="0.25", help="what each process holds (the driver copies it too)")
    ap.add_argument("--beside", default="copies,makes", help="what runs beside A's checkpoint, in turn ('' for none); "
                    "WHAT@child runs it in a child process of its own")
    ap.add_argument("--simulate", action="store_true", help="on simcuda, the simulated driver (a test double)")
    a = ap.parse_args()
    if a.simulate:
        os.environ["GPUCR_SIMULATE"] = "1"
    module, size = (a.workload, ["--gib", a.gib]) if a.workload != "driver_app" else (a.workload, ["--sizes", "8M"])
    apps = [Workload(module, *size, simulate=a.simulate, agent=False) for _ in range(2)]
    try:
        drv = controller_driver()
        pa, pb = apps[0].proc.pid, apps[1].proc.pid
        beside = tuple(w for w in a.beside.split(",") if w)
        if {w.removesuffix("@child") for w in beside} - {"copies", "chunks", "makes"}:
            raise SystemExit(f"--beside: copies, chunks and/or makes (each may end in @child), not {a.beside}")
        vmm = Vmm(drv) if beside else None
        ctx = vmm.retain_context(0) if vmm is not None else 0
        _out(drv, pb)
        rounds = [one_round(drv, pa, pb, beside, vmm, ctx) for _ in range(a.rounds)]
        _in(drv, pb)
        assert drv.state(pa) == ProcessState.RUNNING and drv.state(pb) == ProcessState.RUNNING
        keys = ("out_alone_s", "in_alone_s", "out_together_s", "in_together_s", "together_s", "overlap_s",
                *(f"out_beside_{w}_s" for w in beside))
        medians = {k: statistics.median(r[k] for r in rounds) for k in keys}
        medians["serialised"] = medians["together_s"] > 0.85 * (medians["out_alone_s"] + medians["in_alone_s"])
        print(f"{'':22s}" + "".join(f"{k:>16s}" for k in keys))
        for i, r in enumerate(rounds):
            print(f"round {i + 1:<16d}" + "".join(f"{r[k]:16.3f}" for k in keys))
        print(f"{'median':22s}" + "".join(f"{medians[k]:16.3f}" for k in keys))
        print(f"A out beside B in: {'one after the other' if medians['serialised'] else 'at once'} "
              f"(together {medians['together_s']:.3f} s; alone {medians['out_alone_s']:.3f} + {medians['in_alone_s']:.3f} s)")
        out = Path(os.environ.get("OUT", ".")) / "driver-overlap.json"
        out.write_text(json.dumps({"workload": module, "size": size, "simulated": drv.simulated,
                                   "driver_version": drv.version(), "rounds": rounds, "medians": medians}, indent=1))
        for w in beside:
            print(f"A out beside {w}: {medians[f'out_beside_{w}_s']:.3f} s, alone {medians['out_alone_s']:.3f} s")
        print(f"written {out}")
    finally:
        for w in apps:
            w.proc.kill()
            w.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
