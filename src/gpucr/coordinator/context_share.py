"""What a full checkpoint freed beside the data gpucr moves: the process's CUDA context and the driver's own small
allocations, per GPU, kept until its restore so that the restore's room check counts them too.

The agent's status counts only the memory it tracks; a context (about 520 MiB a GPU on the H200, 64 MiB on simcuda)
is counted by nobody. A restore whose room check left it out could bring the context back and then fail to make the
data ("data in" out of memory), half way. So the driver's checkpoint is measured as it happens: each of the
process's GPUs' used memory just before and just after it (what the process gave back). Kept in this process (the
gpucr server, or the command that checkpointed it); a restore elsewhere falls back to the agent's count."""
from __future__ import annotations

import threading

from .. import gpus
from ..driver import Driver

_lock = threading.Lock()
_freed: dict[tuple[int, int], dict[str, int]] = {}   # (pid, start time) -> {GPU uuid: bytes its checkpoint freed}
KEPT_MAX = 4096   # processes remembered at once: the oldest go first (an ended one's entry is never asked again)


def used(drv: Driver, uuids: list[str], machine: list[gpus.Gpu]) -> dict[str, int]:
    """Each GPU's used memory now, as the driver says (NVML; simcuda's count), for the GPUs it can read."""
    out = {}
    for u in uuids:
        mem = gpus.memory_of(drv, u, machine)
        if mem is not None:
            out[u] = mem.used
    return out


def record(pid: int, start_time: int, before: dict[str, int], after: dict[str, int],
           bound: dict[str, int] | None = None) -> dict[str, int]:
    """Keep what the driver's checkpoint of the process freed on each GPU (never below 0: another process may have
    allocated meanwhile; never above `bound`, where known: another may have freed memory meanwhile); returns it."""
    bound = bound or {}
    freed = {u: max(0, min(before[u] - after[u], bound.get(u, before[u]))) for u in before if u in after}
    with _lock:
        _freed.pop((pid, start_time), None)
        while len(_freed) >= KEPT_MAX:
            _freed.pop(next(iter(_freed)))
        _freed[(pid, start_time)] = freed
    return freed


def freed(pid: int, start_time: int) -> dict[str, int]:
    """{GPU uuid: bytes} the process's last full checkpoint freed beside its data, or {} when not measured here."""
    with _lock:
        return dict(_freed.get((pid, start_time), {}))


def forget(pid: int, start_time: int) -> None:
    """Its restore put it back: the next checkpoint measures again."""
    with _lock:
        _freed.pop((pid, start_time), None)
