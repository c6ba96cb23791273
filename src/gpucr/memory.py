"""The GPU memory of a process, handed to the server as file descriptors.

The agent makes every device allocation it manages exportable as a POSIX fd and keeps one fd of each
(docs/server.md). Asked `memory`, it answers with each allocation (kind, size, device, where it is
mapped) and a dup of its fd over SCM_RIGHTS, so the server can import the memory into its own context
and copy it while the driver checkpoints the process. The fds received here keep that memory on the
GPU while they are open: the caller closes them (close_all) as soon as it is done with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .agent import close_held
from .vmm import AllocFlags


@dataclass
class Mapping:
    va: int
    bytes: int
    offset: int


@dataclass
class Managed:
    """One allocation the agent manages, as it reports it, with our fd of it (None: it has none)."""
    index: int
    kind: str                   # converted (cuMemAlloc) | pool (a stream-ordered pool segment) | app_vmm | imported
    bytes: int
    device: int                 # the ordinal of its context's GPU in that process (-1: unknown)
    released: bool              # its physical memory is given back (a checkpoint holds its data)
    not_exportable: bool        # no fd could be had for it (RLIMIT_NOFILE)
    maps: list[Mapping] = field(default_factory=list)
    fd: int | None = None
    uuid: str = ""              # its GPU's UUID ("" unknown): the same GPU in a process that numbers GPUs otherwise
    movable: bool = False       # its data is moved by gpucr at a checkpoint
    handable: bool = False      # ... and a gpucr server can take it (device memory with the agent's fd)
    flags: AllocFlags = field(default_factory=lambda: AllocFlags())   # made again with the same
    state: str = ""             # live | handed | parked | given (given back before its commit: a two-way switch)


def _entry(e: dict[str, Any], fds: list[int]) -> Managed:
    idx = e["fd_index"]
    return Managed(int(e["index"]), str(e["kind"]), int(e["bytes"]), int(e["device"]), bool(e["released"]),
                   bool(e["not_exportable"]),
                   [Mapping(int(m["va"]), int(m["bytes"]), int(m["offset"])) for m in e["maps"]],
                   fds[idx] if 0 <= idx < len(fds) else None, str(e.get("uuid", "")), bool(e.get("movable")),
                   bool(e.get("handable")),
                   AllocFlags(int(e.get("rdma", 0)), int(e.get("compression", 0)), int(e.get("usage", 0))),
                   str(e.get("state", "")))


def gather(agent: Any, timeout: float) -> list[Managed]:
    """Every allocation a process's agent manages, with our own fd of each (the caller closes them: close_all);
    `timeout` bounds the whole listing."""
    return agent.call_paged_with_fds("memory", "memory", _entry, "list of its GPU memory", timeout)


close_all = close_held   # until closed, our fds keep the memory on the GPU, even once the process frees it
