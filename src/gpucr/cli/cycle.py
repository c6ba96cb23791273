"""The commands that change processes: checkpoint, restore (of one process, several, a group or a launcher's tree)
and recover (those a controller left stuck)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from .. import coverage, gpus
from ..errors import GpucrError
from ..results import (SCHEMA_VERSION, GpuMemoryChange, ImageTransfer, LeftOut, ProcessCheckpoint, ProcessRestore,
                       RecoverResult, to_json)
from ..server import route
from .text import gbps, mib, plural, print_json

T = TypeVar("T")


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in phases.items())


def _fmt_gpus(changes: list[GpuMemoryChange]) -> str:
    """Per GPU: this process's memory, and the whole GPU's, before -> after; the gpucr server's own apart."""
    return "; ".join(f"{g.uuid}: this process {_fmt_held(g.process_before_bytes, g.server_made_before_bytes)} -> "
                     f"{_fmt_held(g.process_after_bytes, g.server_made_after_bytes)}, "
                     f"GPU used {mib(g.gpu_used_before_bytes)} -> {mib(g.gpu_used_after_bytes)}"
                     f"{_fmt_server(g.server_before_bytes, g.server_after_bytes)}" for g in changes)


def _fmt_held(process: int | None, server_made: int) -> str:
    # nvidia-smi lists what gpucr's data plane made (the server's, or the CLI's with no server) under no process:
    # said, so that its figure can be matched
    return mib(process) + (f" ({mib(server_made)} of it re-made by gpucr)" if server_made else "")


def _fmt_server(before: int | None, after: int | None) -> str:
    if after is None:
        return ""   # not through a server
    return f"; gpucr server {mib(after) if before == after else f'{mib(before)} -> {mib(after)}'} (its context)"


def _fmt_image(im: ImageTransfer, verb: str) -> str:
    """An image's data: what went to or from disk (zero chunks are neither written nor read), and the rate
    of that data, so that an image of zeros does not read as an impossible speed."""
    on_disk = im.bytes_written if im.bytes_written is not None else im.bytes_read
    moved = "" if on_disk is None else (f" ({mib(on_disk)} {verb} on disk, {mib(im.bytes - on_disk)} of zero "
                                        "chunks skipped)" if on_disk < im.bytes else "")
    rate = f", {gbps(on_disk if on_disk is not None else im.bytes, im.transfer_s)} on disk" if im.transfer_s > 0 else ""
    return (f"  image {im.dir}: {mib(im.bytes)}{moved} {verb} in {im.transfer_s:.2f} s{rate}"
            f"{' (direct I/O)' if im.direct_io else ''}")


def _image_dir(base: str, pid: int, count: int) -> str:
    """One directory per process when several are named: DIR/PID."""
    return os.path.join(base, str(pid)) if count > 1 else base


def _targets(a: argparse.Namespace) -> tuple[list[int], list[LeftOut]]:
    """The processes named on the command line, or those of --group or --tree that hold GPU state;
    and the others, a launcher or a helper that never touched CUDA, left alone (and listed)."""
    from .. import jobs
    if a.group and a.tree:
        raise GpucrError("give either --group or --tree, not both")
    if (a.group or a.tree) and a.pids:
        raise GpucrError(f"give either PIDs or {'--group' if a.group else '--tree'}, not both (process "
                         f"{', '.join(map(str, a.pids))} was named with it)")
    if a.group or a.tree:
        job = jobs.of_group(a.group) if a.group else jobs.of_tree(a.tree)
        for x in job.left_out:
            print(f"gpucr: note: {x.line()}", file=sys.stderr)
        return sorted(job.pids), job.left_out
    if not a.pids:
        raise GpucrError("name the processes (PID ...), a group (--group NAME) or a launcher (--tree PID)")
    return a.pids, []


def settled(pids: list[int], timeout: float, ask: Callable[[], T], need_cuda: bool = True) -> T:
    """The request's answer, asked again when those still starting are up, or through the driver they run
    on (see gpucr.preflight.request)."""
    from .. import preflight
    return preflight.request(pids, timeout, ask, need_cuda)


def _images(a: argparse.Namespace, pids: list[int]) -> dict[int, str] | None:
    return {pid: _image_dir(a.image, pid, len(pids)) for pid in pids} if a.image else None


@contextmanager
def _working(what: str, show: bool) -> Iterator[None]:
    """A spinner with the time so far on a terminal, while a request that can take seconds runs; nothing
    when stderr is not a terminal."""
    if not (show and sys.stderr.isatty()):
        yield
        return
    from rich.console import Console
    with Console(stderr=True).status(f"{what} ..."):
        yield


def _timed(what: str, show: bool, request: Callable[[], T]) -> tuple[T, float]:
    """The request's result and its total time, as the user waited for it (server round trip included)."""
    t0 = time.monotonic()
    with _working(what, show):
        out = request()
    return out, round(time.monotonic() - t0, 3)


def _warn(processes: list) -> None:
    for r in processes:
        for w in r.warnings:
            print(f"gpucr: warning: process {r.pid}: {w}", file=sys.stderr)


def _cycled(a: argparse.Namespace, what: str, ask: Callable[[list[int]], T]) -> T | None:
    """A checkpoint or restore of the processes named (PIDs, --group or --tree), timed as the user waited for it,
    its warnings said; None when it was printed as JSON (--json), else the result for the caller to print."""
    pids, left_out = _targets(a)
    result, result.total_s = _timed(f"{what} {plural(len(pids), 'process', 'processes')}",
                                    not a.json and not a.image,   # an image shows its own bar
                                    lambda: settled(pids, a.timeout, lambda: ask(pids)))
    result.left_out = left_out
    _warn(result.processes)
    if a.json:
        print_json(to_json(result))
        return None
    return result


def _print_details(a: argparse.Namespace, r: ProcessCheckpoint | ProcessRestore, image_verb: str) -> None:
    if a.phases:
        print(f"  phases       {_fmt_phases(r.phases_s)}")
    if r.gpus:
        print(f"  memory       {_fmt_gpus(r.gpus)}")
    if r.image is not None:
        print(_fmt_image(r.image, image_verb) + ("; host staging released" if image_verb == "written" else ""))


def cmd_checkpoint(a: argparse.Namespace) -> int:
    result = _cycled(a, "checkpointing", lambda pids: route.checkpoint_many(
        pids, level=a.level, timeout=a.timeout, images=_images(a, pids), scan=not a.no_scan))
    for r in result.processes if result else []:
        print(f"process {r.pid}: checkpointed (level {r.level}) in {result.total_s:.2f} s; {mib(r.bytes_moved)} "
              f"moved by gpucr ({gbps(r.bytes_moved, result.total_s)} over that time), "
              f"{mib(r.bytes_left_to_driver)} left to the driver"
              f"{coverage.left_summary(r.coverage.left_to_driver if r.coverage else [])}")
        _print_details(a, r, "written")
    return 0


def cmd_restore(a: argparse.Namespace) -> int:
    gpu_map = gpus.parse_map(a.map or [])   # checked before any process is asked anything
    result = _cycled(a, "restoring", lambda pids: route.restore_many(
        pids, timeout=a.timeout, drop_staging=a.drop_staging, force=a.force, images=_images(a, pids), gpu_map=gpu_map,
        accept_mismatch=a.accept_mismatch))
    for r in result.processes if result else []:
        moved = "".join(f"; moved from {o} to {n}" for o, n in r.moved.items())
        print(f"process {r.pid}: restored and running in {result.total_s:.2f} s; {mib(r.bytes_moved)} copied back "
              f"({gbps(r.bytes_moved, result.total_s)} over that time){moved}")
        _print_details(a, r, "read")
    return 0


def _recover_chosen(a: argparse.Namespace) -> list:
    """recover --all or recover PID..., in-process: the server's recover takes every stuck process and leaves
    checkpoints made on purpose alone."""
    from .. import recover as recovery
    only = set(a.pids) if a.pids else None
    if a.list:
        return recovery.find(committed_too=a.all, only=only)
    return recovery.recover(a.timeout, committed_too=a.all, only=only)


def _take_kind_of_targets(pids: list[int] | None) -> None:
    """Act through the driver the processes under gpucr run on, as checkpoint and restore do, when not told which
    (`gpucr recover PID` on a simcuda process tried the system's driver, which the failure that advised it to run
    it may not have): the named ones, else every one listed, where all run on the same kind."""
    from .. import preflight, target as targets
    found = []
    for pid in pids or [pid for pid, _ in targets.list_sockets()]:
        try:
            found.append(targets.resolve(pid))
        except GpucrError:
            pass   # gone or not under gpucr: the recover itself says so
    if pids or len({t.simulated for t in found}) == 1:
        preflight.take_kind(found)


def cmd_recover(a: argparse.Namespace) -> int:
    _take_kind_of_targets(a.pids)
    stuck = _recover_chosen(a) if a.all or a.pids else route.recover(a.list, a.timeout)
    if a.json:
        print_json(to_json(RecoverResult(SCHEMA_VERSION, "recover", a.list, stuck)))
    elif not stuck:
        print("no stuck process: nothing is locked, checkpointed or parked without a controller")
    for s in ([] if a.json else stuck):
        print(f"process {s.pid} ({s.cmd[:60]}): {s.how}" + (f"; {s.outcome}" if s.outcome else ""))
    return 0 if a.list or all(s.ok for s in stuck) else 1
