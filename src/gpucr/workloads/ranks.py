"""The distributed side of the parallel workloads: joining the job (under torchrun, from its
environment, or one rank per process from --rank/--world/--port) and serving the line protocol.

Under torchrun only rank 0 owns a usable stdin/stdout, so rank 0 reads each command, broadcasts it
to the other ranks over a gloo group of its own (CPU, so a rank waiting for the next command makes
no CUDA call and holds no NCCL collective open), runs it, and answers with every rank's answer
gathered over the same group. That group's timeout is a week: a job parked by a checkpoint waits for
its next command there. The NCCL group (the default one) gets --pg-timeout, PyTorch's watchdog limit.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO

from . import protocol

if TYPE_CHECKING:
    import torch

CONTROL_TIMEOUT = dt.timedelta(days=7)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rank", type=int, default=None, help="this process's rank (one process per rank); "
                    "without it, the rank comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)")
    ap.add_argument("--world", type=int, default=2, help="number of ranks, with --rank")
    ap.add_argument("--port", type=int, default=29511, help="rendezvous port on 127.0.0.1, with --rank")
    ap.add_argument("--pg-timeout", type=float, default=600.0, help="the NCCL process group's timeout in "
                    "seconds (PyTorch's watchdog aborts a collective that takes longer; default 600)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo on the CPU, to check the code paths without a GPU")


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    torchrun: bool
    device: "torch.device"
    control: Any        # the gloo group commands travel on (torchrun only)


def join(a: argparse.Namespace) -> Ranks:
    """Join the process group; the GPU of this rank is its local rank."""
    import torch
    import torch.distributed as dist
    torchrun = a.rank is None
    if torchrun:
        if "RANK" not in os.environ:
            raise SystemExit("give --rank R (one process per rank) or start this under torchrun")
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        init = "env://"
    else:
        rank, world, local = a.rank, a.world, a.rank
        init = f"tcp://127.0.0.1:{a.port}"
    if a.device == "cuda":
        n = torch.cuda.device_count()
        if local >= n:
            raise SystemExit(f"rank {rank} needs GPU {local}, but only {n} GPU(s) are visible")
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=a.pg_timeout))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if torchrun else None
    return Ranks(rank, world, local, torchrun, device, control)


def merge(answers: list[dict]) -> dict:
    """Rank 0's answer with every rank's under "ranks"; any rank's error is the answer's error."""
    out = {**answers[0], "ranks": answers}
    errors = [f"rank {i}: {a['error']}" for i, a in enumerate(answers) if a.get("error")]
    if errors:
        out["error"] = "; ".join(errors)
    return out


def serve(r: Ranks, handle: Callable[[list[str]], dict], ready: dict, out: TextIO) -> None:
    """The protocol for this job: each rank on its own pipe, or rank 0 for all under torchrun."""
    import torch.distributed as dist
    mine = {"rank": r.rank, "pid": os.getpid(), **ready}
    if not r.torchrun:
        protocol.serve(handle, mine, out)
        return
    everyone: list[Any] = [None] * r.world
    dist.all_gather_object(everyone, mine, group=r.control)

    def run(words: list[str]) -> dict:
        answers: list[Any] = [None] * r.world
        dist.all_gather_object(answers, protocol.answer(handle, words), group=r.control)
        return merge(answers)

    if r.rank == 0:
        def lead(words: list[str]) -> dict:
            dist.broadcast_object_list([words], src=0, group=r.control)
            return run(words)
        protocol.serve(lead, {**mine, "pids": [e["pid"] for e in everyone], "ranks": everyone}, out)
        dist.broadcast_object_list([["quit"]], src=0, group=r.control)   # stdin closed or quit: all ranks end
        return
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=r.control)
        if box[0][0] == "quit":
            return
        run(box[0])


def leave() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def local_rank_hint(a: argparse.Namespace) -> int:
    """This rank's GPU before joining (to read the GPU's memory before the context exists)."""
    return a.rank if a.rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
