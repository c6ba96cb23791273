"""The GPUs a process runs on, those this machine has, and a restore's --map between them.

A process names its GPUs by ordinal, but ordinals differ between processes (CUDA_VISIBLE_DEVICES,
CUDA_DEVICE_ORDER), so everything here goes by UUID, as the agent reports it from inside the process.
The driver's restore takes UUID pairs and wants one for every GPU the process was checkpointed on;
a map is checked against that, and against this machine's GPUs, before anything is touched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .driver import (Driver, GpuMemory, controller_driver, device_count, device_info, gpu_memory, nvml_device_node,
                     nvml_gpu_list, processes_gpu_memory, simulated_device_node, uuid_text)
from .errors import GpucrError


@dataclass(frozen=True)
class Gpu:
    ordinal: int      # this controller's ordinal: for reading its memory
    uuid: str         # GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    name: str


def machine_gpus(drv: Driver) -> list[Gpu]:
    """Every GPU of this machine. The driver's restore wants a pair for each of them, so they are
    listed by NVML, which ignores this controller's CUDA_VISIBLE_DEVICES (the driver's list does not);
    on simcuda, or without NVML, the driver's own list."""
    if not drv.simulated:
        found = nvml_gpus()
        if found:
            return found
    return [Gpu(i, info["uuid"], info["name"]) for i in range(device_count(drv)) for info in [device_info(drv, i)]]


def restore_pairs(moves: dict[str, str], machine: list[Gpu]) -> list[tuple[str, str]]:
    """The driver's gpuPairs for a restore that moves a process's GPUs as `moves` says: a permutation
    of every GPU of the machine, as driver 580 wants even for a process that used one GPU (measured on
    a two-GPU H200 host: [(0,0)] alone is refused; [(0,0),(1,1)] restores in place, [(0,1),(1,0)] moves).
    GPUs the process did not use keep their place where they can, else take the places left free."""
    every = [g.uuid for g in machine]
    unknown = [u for u in [*moves, *moves.values()] if u not in every]
    if unknown:
        raise GpucrError(f"{unknown[0]} is not a GPU of this machine (nvidia-smi -L lists them)")
    pairs = dict(moves)
    free_new = [u for u in every if u not in moves.values()]
    rest = [u for u in every if u not in moves]
    for u in rest:
        if u in free_new:
            pairs[u] = u
            free_new.remove(u)
    for u in rest:
        if u not in pairs:
            pairs[u] = free_new.pop(0)
    return [(u, pairs[u]) for u in every]


def nvml_gpus() -> list[Gpu]:
    """The machine's GPUs as NVML lists them; [] without NVML."""
    return [Gpu(i, uuid, name) for i, (uuid, name) in enumerate(nvml_gpu_list())]


def to_bytes(uuid: str) -> bytes:
    """A GPU UUID's 16 bytes (GPU- and dashes optional, any case); raises ValueError if it is not one."""
    hexdigits = uuid.strip().lower().removeprefix("gpu-").replace("-", "")
    if len(hexdigits) != 32 or any(c not in "0123456789abcdef" for c in hexdigits):
        raise ValueError(uuid)
    return bytes.fromhex(hexdigits)


def normalise(uuid: str) -> str:
    """A UUID as nvidia-smi -L prints it; raises ValueError if it is not one."""
    return uuid_text(to_bytes(uuid))


def parse_map(items: list[str]) -> dict[str, str]:
    """--map OLD_UUID=NEW_UUID items into {old: new}."""
    pairs = []
    for item in items:
        old, sep, new = item.partition("=")
        pairs.append((old, new) if sep else (item, None))
    return _checked_map(pairs)


def check_map(gpu_map: dict[str, str]) -> dict[str, str]:
    """The API's gpu_map {old UUID: new UUID}, checked and written as --map's are."""
    return _checked_map(list(gpu_map.items()))


def _checked_map(pairs: list[tuple[str, str | None]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for old, new in pairs:
        try:
            if new is None:
                raise ValueError(old)
            old, new = normalise(old), normalise(new)
        except (ValueError, AttributeError):
            shown = old if new is None else f"{old}={new}"
            raise GpucrError(f"--map takes OLD_UUID=NEW_UUID, each GPU- and 32 hex digits as nvidia-smi -L prints "
                             f"them (e.g. GPU-1a2b...=GPU-3c4d...), not '{shown}'") from None
        if out.get(old, new) != new:
            raise GpucrError(f"--map names {old} twice, with different targets")
        out[old] = new
    return out


def process_gpus(status: dict[str, Any], machine: list[Gpu]) -> list[dict[str, Any]]:
    """The GPUs a process uses (the agent's view), with their names from this machine."""
    names = {g.uuid: g.name for g in machine}
    return [{"ordinal": d["ordinal"], "uuid": d["uuid"], "name": names.get(d["uuid"], "unknown"),
             "vmm_bytes": d.get("vmm_bytes", 0), "driver_bytes": d.get("driver_bytes", 0),
             "resident_bytes": d.get("resident_bytes", 0)}
            for d in status.get("devices", [])]


def moves_for(pid: int, used: list[dict[str, Any]], gpu_map: dict[str, str], machine: list[Gpu]) -> dict[str, str]:
    """{old: new} for one process: one for each GPU it uses, as the driver wants (the map may name
    others, for other processes of the same restore). Raises, naming what is wrong."""
    if not gpu_map:
        return {}
    here = {g.uuid: g for g in machine}
    moves: dict[str, str] = {}
    targets: dict[str, str] = {}
    for d in used:
        new = gpu_map.get(d["uuid"])
        if new is None:
            raise GpucrError(f"process {pid} was checkpointed on {d['uuid']} (its device {d['ordinal']}), which --map does "
                             f"not name: the driver needs a pair for every GPU of the process; add {d['uuid']}=NEW_UUID "
                             f"(or {d['uuid']}={d['uuid']} to keep it there)")
        if new not in here:
            raise GpucrError(f"--map target {new} is not a GPU of this machine (nvidia-smi -L lists them)")
        if d["uuid"] in here and here[d["uuid"]].name != here[new].name:
            raise GpucrError(f"--map {d['uuid']}={new}: a {here[d['uuid']].name} cannot be restored onto a "
                             f"{here[new].name} (the driver needs the same chip)")
        if new in targets:
            raise GpucrError(f"--map puts two GPUs of process {pid} ({targets[new]} and {d['uuid']}) onto {new}")
        targets[new] = d["uuid"]
        moves[d["uuid"]] = new
    return moves


def device_nodes(drv: Driver, uuids: set[str]) -> set[str]:
    """The device files of these GPUs (/dev/nvidiaN; simcuda's stand-ins when simulated): every
    process with a CUDA context on a GPU holds its node open."""
    out = set()
    for g in machine_gpus(drv):
        if g.uuid in uuids:
            node = simulated_device_node(drv, g.ordinal) if drv.simulated else nvml_device_node(g.uuid)
            if node:
                out.add(node)
    return out


def memory_of(drv: Driver, uuid: str, machine: list[Gpu]) -> GpuMemory | None:
    g = next((g for g in machine if g.uuid == uuid), None)
    return gpu_memory(drv, g.ordinal, uuid) if g else None


@dataclass(frozen=True)
class Usage:
    """One GPU's memory at one moment: one process's part of it, the gpucr server's own, and the whole GPU's."""
    uuid: str
    name: str
    process: int | None   # bytes the process holds on it, server_made included (None: cannot be read)
    server_made: int      # of those, bytes the gpucr server made for it at a restore (see usage)
    server: int | None    # bytes the gpucr server holds on it itself (None: not read through a server)
    used: int | None      # bytes every process holds on it
    total: int | None


def usage(drv: Driver, pid: int, uuids: list[str], machine: list[Gpu], server_made: dict[str, int] | None = None,
          server_pid: int | None = None) -> dict[str, Usage]:
    """Each of these GPUs' memory now, with process `pid`'s own part and, given `server_pid`, the gpucr server's.
    `server_made` {uuid: bytes}: memory the server made at a restore and the process maps now (the agent's count).
    Per-process counts charge memory to the process that made it, while it holds it, and then to nobody (simcuda
    does; so does NVML, measured on the H200), so the process's own count leaves that memory out: it is added."""
    here = {g.uuid: g for g in machine}
    out = {}
    for uuid in uuids:
        g = here.get(uuid)
        mem = gpu_memory(drv, g.ordinal, uuid) if g else None
        held = processes_gpu_memory(drv, [pid] + ([server_pid] if server_pid is not None else []), g.ordinal,
                                    uuid) if g else {}
        own, server = held.get(pid), held.get(server_pid) if server_pid is not None else None
        made = (server_made or {}).get(uuid, 0)
        out[uuid] = Usage(uuid, g.name if g else "unknown", None if own is None else own + made, made, server,
                          mem.used if mem else None, mem.total if mem else None)
    return out


def process_usage(pid: int, uuids: list[str], status: dict[str, Any], server_pid: int | None = None) -> dict[str, Usage]:
    """These GPUs' memory now, with this process's part (its agent's `status` says what of it the gpucr server made)
    and, given `server_pid`, the server's own; read at a result's edges, never inside a phase."""
    if not uuids:
        return {}
    drv = controller_driver()
    made = {d["uuid"]: int(d.get("adopted_bytes", 0)) for d in status.get("devices", [])}
    return usage(drv, pid, uuids, machine_gpus(drv), made, server_pid)
