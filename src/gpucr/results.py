"""What gpucr's commands and its Python API return: one typed schema, the same in Python and in JSON.

The Python API returns these dataclasses; `--json` prints `to_json()` of the same objects
(dataclasses.asdict), and `from_json()` reads such JSON back, refusing any key or type that is not
the schema's. Units are in the field names (`_bytes`, `_s` seconds, `_gbps` 10^9 bytes per
second); a field that cannot be measured here is null. docs/api.md documents every field.
Every command prints an envelope with `schema_version`, `command` and a `processes` list, however
many processes it acted on. SCHEMA_VERSION changes when a field is renamed, removed or changes
type (a new field does not change it).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

SCHEMA_VERSION = 1


# ---- GPU memory ----

@dataclass
class GpuMemoryChange:
    """One GPU around a checkpoint or a restore: what this process held on it, what the gpucr server held
    itself, and the whole GPU. The process's, the server's and every other process's add up to the GPU's used."""
    uuid: str
    name: str
    process_before_bytes: int | None   # this process's device memory on this GPU: nvidia-smi's figure for it plus
    process_after_bytes: int | None    # server_made_*_bytes, which nvidia-smi lists under no process
    gpu_used_before_bytes: int | None  # the whole GPU's used memory, every process's (nvidia-smi's Memory-Usage)
    gpu_used_after_bytes: int | None
    gpu_total_bytes: int | None
    server_made_before_bytes: int = 0  # of process_*_bytes: memory the gpucr server made for it at a restore
    server_made_after_bytes: int = 0
    server_before_bytes: int | None = None   # the gpucr server's own memory on this GPU (its context); null when
    server_after_bytes: int | None = None    # the request did not go through a server


@dataclass
class GpuStatus:
    """One GPU a process uses, now."""
    ordinal: int                      # the process's own device ordinal for it
    uuid: str
    name: str
    vmm_bytes: int                    # gpucr-tracked memory (moved by gpucr) on it
    driver_bytes: int                 # plain and pool allocations on it (left to the driver's checkpoint)
    process_bytes: int | None         # this process's device memory on it (what the gpucr server made for it included)
    gpu_used_bytes: int | None        # the whole GPU's used memory, every process's
    gpu_total_bytes: int | None


# ---- checkpoint and restore ----

@dataclass
class ImageTransfer:
    """A checkpoint image written (checkpoint --image) or read (restore --image)."""
    dir: str
    id: str | None                    # the manifest's id
    bytes: int                        # the data, zero chunks included
    bytes_written: int | None         # written to disk (zero chunks are not); null on a read
    transfer_s: float
    gbps: float | None                # bytes / transfer_s / 1e9 (zero chunks included, which are neither written nor read)
    direct_io: bool
    bytes_read: int | None = None     # read from disk (zero chunks are not); null on a write
    bytes_zeroed: int | None = None   # zero chunks set on the GPU at a restore (memset, not copied); null on a write


@dataclass
class LeftOut:
    """A process of a --group or --tree that holds no GPU state, so was left alone."""
    pid: int
    cmd: str
    reason: str

    def line(self) -> str:
        return f"process {self.pid} ({self.cmd[:60] or '?'}) left out: {self.reason}"


# ---- coverage: which bytes gpucr moves, and which it leaves to the driver's checkpoint, and why ----

@dataclass
class LeftToDriver:
    """One kind of memory left to the driver's own checkpoint (correct, but ~2 GB/s)."""
    kind: str                         # small allocations | IPC pool | other stream-ordered pool | graph memory nodes | ...
    bytes: int
    count: int | None                 # allocations of this kind, where they are counted one by one
    reason: str                       # why gpucr leaves it to the driver


@dataclass
class StreamOrdered:
    """Stream-ordered allocation (cuMemAllocAsync, memory pools) as the agent serves it."""
    pools_served: int                 # pools whose memory the agent serves (and gpucr moves)
    pools_left_to_driver: int         # pools left to the driver (IPC-capable, imported, host)
    used_bytes: int                   # in use in the pools the agent serves
    reserved_bytes: int               # held by them (used, and free blocks kept for reuse)
    allocations: int                  # stream-ordered allocations made since the start
    cross_stream_waits: int           # blocks handed to another stream after making it wait for their free
    segments_released: int            # pieces of pool memory given back (threshold, TrimTo, before a checkpoint)
    captured_allocations: int         # allocations during stream capture: graph memory, the driver's
    ipc_exports: int                  # pools or pool pointers exported to other processes (a checkpoint refuses)
    ipc_imports: int


@dataclass
class Coverage:
    bytes_moved_by_gpucr: int
    bytes_left_to_driver: int
    left_to_driver: list[LeftToDriver]
    not_counted: str                  # what neither count holds (module globals, the context's own memory)
    stream_ordered: StreamOrdered


@dataclass
class ProcessCheckpoint:
    pid: int
    state: str                        # checkpointed
    level: str                        # full | data
    generation: int                   # checkpoints this process has completed
    bytes_moved: int                  # copied out by gpucr
    bytes_left_to_driver: int         # left to the driver's checkpoint (level full) or on the GPU (level data)
    phases_s: dict[str, float]        # the controller's phases: vet, prepare, data_out, then driver_lock, control_out (level full), commit, settle
    agent_phases_s: dict[str, float]  # inside the process: staging, gate, sync, release
    gpus: list[GpuMemoryChange]
    image: ImageTransfer | None
    warnings: list[str]
    coverage: Coverage | None = None  # what went which way, by kind (null from an agent that does not say)
    routes: dict[str, int] = field(default_factory=dict)   # bytes the server moved through each neighbour GPU
    data_plane: str = ""              # what moved the data: server | cli (the gpucr command's, no server) | agent
    bytes_zero_skipped: int = 0       # of bytes_moved, in 2 MiB chunks all zero on the GPU: not copied out
    bytes_unchanged_skipped: int = 0  # ... and in chunks not all zero that the staging held already (their digest
    #                                   unchanged since this server's last copy out of the process): not copied out
    scanned: bool = False             # the plane scanned the memory on the GPU (zero chunks, digests): false with --no-scan
    bytes_scanned: int = 0            # bytes that scan read
    staging_lent_bytes: int = 0       # staging this checkpoint got from the server's pool made ahead (pinned already)
    staging_made_bytes: int = 0       # ... and staging made for it at this checkpoint (faulted in, then pinned)


@dataclass
class ProcessRestore:
    pid: int
    state: str                        # running
    bytes_moved: int                  # copied back by gpucr
    phases_s: dict[str, float]        # vet, control_in, driver_unlock, data_in, adopt, finish (from an image:
                                      # stage, image_read before data_in), settle
    agent_phases_s: dict[str, float]  # empty: the agent copies nothing (kept for readers of schema 1)
    gpus: list[GpuMemoryChange]       # every GPU it was on or moved to
    moved: dict[str, str]             # {old UUID: new UUID} for each GPU it was moved off (restore --map)
    image: ImageTransfer | None
    warnings: list[str]
    routes: dict[str, int] = field(default_factory=dict)   # bytes the server moved through each neighbour GPU
    data_plane: str = ""              # server | cli | agent, as for a checkpoint ("" from a gpucr that did not say)
    checked: bool = False             # the memory put back was digested on the GPU and matched the checkpoint's
    chunks_checked: int = 0           # 2 MiB chunks compared
    bytes_zeroed: int = 0             # of bytes_moved, zero chunks set by a memset on the GPU (not copied over the link)


@dataclass
class CheckpointResult:
    schema_version: int
    command: str                      # checkpoint
    processes: list[ProcessCheckpoint]
    left_out: list[LeftOut] = field(default_factory=list)
    total_s: float | None = None      # the whole request, as its caller waited for it (set by the gpucr command)


@dataclass
class RestoreResult:
    schema_version: int
    command: str                      # restore
    processes: list[ProcessRestore]
    left_out: list[LeftOut] = field(default_factory=list)
    total_s: float | None = None      # the whole request, as its caller waited for it (set by the gpucr command)


# ---- status and ps ----

@dataclass
class Allocations:
    tracked: int                      # allocations gpucr moves
    tracked_bytes: int
    converted: int                    # of them, cuMemAlloc allocations gpucr made into VMM memory
    app_vmm: int                      # of them, the application's own VMM memory
    vmm_left_to_driver: int           # VMM allocations gpucr cannot move (left to the driver)
    vmm_left_to_driver_bytes: int
    native: int                       # small plain allocations, left to the driver
    native_bytes: int
    pool: int                         # stream-ordered pool allocations, left to the driver
    pool_bytes: int
    managed: int
    managed_bytes: int
    ipc_exports: int
    not_exportable: int = 0           # tracked allocations the agent holds no fd of (RLIMIT_NOFILE ran out)
    pieces: int = 0                   # of the tracked, pieces of allocations made in pieces (GPUCR_PIECE_BYTES)
    own_fds: int = 0                  # fds the agent holds of the memory (one per allocation or piece)
    fd_limit: int = 0                 # the process's soft RLIMIT_NOFILE (0: none)


@dataclass
class LastCycle:
    """The last checkpoint's steps inside the process (the data plane's copies and the driver's steps are in the
    controller's results)."""
    gate_s: float
    sync_s: float
    release_s: float
    bytes_out: int                    # handed to gpucr's data plane


@dataclass
class SharedMemory:
    """Memory the process exported to or imported from another process (CUDA IPC, VMM handles)."""
    role: str                         # exporter | importer
    key: int
    bytes: int
    unlinked: bool                    # given back by a checkpoint, not yet relinked
    open_fds: int                     # file descriptors of it the process still holds
    owner: int | None                 # importer: the exporter's pid


@dataclass
class MemoryCgroup:
    path: str                         # the cgroup whose memory limit binds (least room), as under /sys/fs/cgroup
    limit_file: str                   # memory.max | memory.high | memory.limit_in_bytes (cgroup v1)
    limit_bytes: int
    current_bytes: int


@dataclass
class ProcessStatus:
    pid: int
    state: str                        # running | checkpointed
    phase: str                        # the agent's: running | quiesced | handed | copied | parked | on disk
    level: str | None                 # full | data while checkpointed
    driver_state: str | None          # the driver's view: running | locked | checkpointed | failed; null without CUDA
    cmd: str
    start_time: int                   # clock ticks since boot (/proc/PID/stat): with pid, names the process
    cuda: bool                        # the process has loaded the CUDA driver
    simulated: bool                   # on simcuda, the test double
    group: str
    busy: bool                        # a checkpoint, restore or roll-back runs in it now
    rolling_back: bool
    committed: bool                   # checkpointed on purpose: its controller committed (recover leaves it alone)
    gate_closed: bool                 # CUDA calls are held (mid-checkpoint, or a restore stopped before its end)
    checkpoint_phase: str             # quiesced between a group's phases, handed (not committed yet), else empty
    staged: bool                      # a checkpoint's data is in host memory (not only in an image)
    generation: int
    allocations: Allocations
    bytes_left_to_driver: int
    gpus: list[GpuStatus]
    staging_kind: str                 # hugetlbfs | shm | file:DIR
    staging_bytes: int
    staging_segments: int
    last_cycle: LastCycle
    refusal: str | None               # why a checkpoint would be refused now
    shared: list[SharedMemory]
    certificate: dict[str, Any] | None  # while checkpointed: what the checkpoint covers (a manifest, see inspect)
    coverage: Coverage | None = None  # the bytes gpucr moves and those left to the driver, by kind with reasons
    host_budget_bytes: int | None = None  # GPUCR_HOST_BUDGET as this process enforces it; None: no budget
    host_budget_used_bytes: int = 0   # staging in host memory held by all of this user's processes under gpucr and the server's pool
    memory_cgroup: MemoryCgroup | None = None  # the memory cgroup limit staging is charged to; None: no limit


@dataclass
class Unreachable:
    pid: int
    error: str


@dataclass
class StatusResult:
    schema_version: int
    command: str                      # status | ps
    processes: list[ProcessStatus]
    unreachable: list[Unreachable] = field(default_factory=list)


# ---- recover ----

@dataclass
class Stuck:
    pid: int
    cmd: str
    how: str                          # driver locked | driver checkpointed | checkpointed | parked
    under_gpucr: bool
    outcome: str = ""                 # after recover: what became of it
    ok: bool = False


@dataclass
class RecoverResult:
    schema_version: int
    command: str                      # recover
    listed_only: bool                 # recover --list: nothing was done
    processes: list[Stuck]


# ---- a command that failed ----

@dataclass
class ErrorResult:
    """What `--json` prints when a command fails: the same envelope, no processes, and the error."""
    schema_version: int
    command: str
    processes: list[Any]              # always empty
    error: str                        # the line a user would read on stderr
    exit_status: int


# ---- JSON ----

def to_json(result: Any) -> dict[str, Any]:
    """The JSON form of a result: its fields, nested, as dataclasses.asdict gives them."""
    return dataclasses.asdict(result)


T = TypeVar("T")


def from_json(cls: type[T], data: Any) -> T:
    """A result read back from its JSON, strictly: every field present with its type, nothing else;
    raises ValueError naming the first field that is not."""
    return _parse(cls, data, cls.__name__)


def _parse(tp: Any, v: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise ValueError(f"{where}: an object is expected, not {type(v).__name__}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        missing, extra = [n for n in names if n not in v], [k for k in v if k not in names]
        if missing or extra:
            raise ValueError(f"{where}: " + "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                                                  f"unknown {', '.join(extra)}" if extra else "") if x))
        return tp(**{n: _parse(hints[n], v[n], f"{where}.{n}") for n in names})
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{where}: unsupported union {tp}")
        return _parse(inner[0], v, where)
    if origin is list:
        if not isinstance(v, list):
            raise ValueError(f"{where}: a list is expected, not {type(v).__name__}")
        return [_parse(args[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise ValueError(f"{where}: an object is expected, not {type(v).__name__}")
        return {k: _parse(args[1], x, f"{where}.{k}") for k, x in v.items()}
    if tp is Any:
        return v
    # bool is an int in Python, not in the schema; an int is not taken for a float (JSON keeps 1.0)
    if tp in (int, float, str, bool) and type(v) is tp:
        return v
    raise ValueError(f"{where}: {tp.__name__} expected, not {type(v).__name__} ({v!r})")
