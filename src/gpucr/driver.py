"""ctypes binding of the CUDA driver's process checkpoint API, and of what gpucr reads about the GPU.

All ctypes signatures live here and in vmm.py (the data plane's half: memory, copies, events, kernels). One `Driver` is one initialised driver (cuInit once); the
coordinator keeps it for every action it takes, so each step does not pay a fresh cuInit.
"""
from __future__ import annotations

import ctypes
import enum
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from .agent_tables import UUID_TEXT
from .errors import GpucrError
from .proc import check_not_stopped


class ProcessCaller(Protocol):
    """Another process that makes the driver's calls on processes for this one (driver_helper.DriverHelper)."""
    def alive(self) -> bool: ...
    def call(self, name: str, pid: int, **kw: Any) -> tuple[int, int]: ...


class ProcessState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Args8(ctypes.Structure):  # CUcheckpointCheckpointArgs and CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


assert ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_Args8) == 64 and ctypes.sizeof(_RestoreArgs) == 64

CUDA_ERROR_TIMEOUT = 909
WATCH_EVERY_S = 0.05   # how often a driver call into a process looks whether the process was stopped
ANSWER_LIMIT_S = 60.0  # a state query or an unlock (beyond a lock's own timeout): the driver answers these at once
MOVE_LIMIT_S = 600.0   # a checkpoint or restore: it copies what gpucr did not take at 2 GB/s, 1.2 TB in that time
TEST_LIMIT_ENV = "GPUCR_TEST_DRIVER_LIMIT_S"   # the test suite's shorter limit for every driver call
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3


class DriverError(GpucrError):
    def __init__(self, what: str, rc: int, text: str, hint: str = "") -> None:
        super().__init__(f"{what} failed: {text} (CUDA error {rc})" + (f"; {hint}" if hint else ""))
        self.rc = rc


class DriverSilent(GpucrError):
    """The driver did not answer a request about a process within its limit: it may still finish it."""


CUDA_ERROR_NOT_SUPPORTED = 801
LOCK_NOT_SUPPORTED = ("the driver does not checkpoint a process run under a CUDA tool such as compute-sanitizer or a "
                      "debugger: `--level data` moves its data and leaves its context alone")


@dataclass(frozen=True)
class GpuMemory:
    used: int
    total: int

    @property
    def free(self) -> int:
        return self.total - self.used


def _sig(lib: ctypes.CDLL, name: str, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int


class Driver:
    """The checkpoint half of the CUDA driver API, for acting on other processes."""

    def __init__(self, libpath: str | Path = "libcuda.so.1") -> None:
        self.path = str(libpath)
        try:
            self._cu = ctypes.CDLL(self.path)
        except OSError as exc:
            raise GpucrError(f"cannot load the CUDA driver {self.path}: {exc}") from exc
        cu = self._cu
        pid, p = ctypes.c_int, ctypes.c_void_p
        for name, args in (("cuInit", (ctypes.c_uint,)), ("cuDriverGetVersion", (ctypes.POINTER(ctypes.c_int),)),
                           ("cuGetErrorString", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))):
            try:
                _sig(cu, name, *args)
            except AttributeError:
                raise GpucrError(f"{self.path} is not a CUDA driver library (it has no {name}); install the NVIDIA "
                                 "driver, whose libcuda.so.1 gpucr uses") from None
        try:
            _sig(cu, "cuCheckpointProcessLock", pid, p)
            _sig(cu, "cuCheckpointProcessCheckpoint", pid, p)
            _sig(cu, "cuCheckpointProcessRestore", pid, p)
            _sig(cu, "cuCheckpointProcessUnlock", pid, p)
            _sig(cu, "cuCheckpointProcessGetState", pid, ctypes.POINTER(ctypes.c_int))
        except AttributeError as exc:
            raise GpucrError(f"the CUDA driver {self.path} has no checkpoint API (driver 555 or newer is needed)") from exc
        self.simulated = hasattr(cu, "simcudaIsSimulated")
        self.helper: ProcessCaller | None = None   # where process calls are made from, if not here (driver_helper.py)
        self._check(cu.cuInit(0), "cuInit")

    # ---- helpers ----
    def _errstr(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self._cu.cuGetErrorString(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode(errors="replace")
        return "unknown error"

    def _check(self, rc: int, what: str, hint: str = "") -> None:
        if rc != 0:
            raise DriverError(what, rc, self._errstr(rc), hint)

    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self._cu.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value

    # ---- the process checkpoint API ----
    def process_call(self, name: str, pid: int, timeout_ms: int = 0,
                     pairs: list[tuple[bytes, bytes]] | None = None) -> tuple[int, int]:
        """One of the driver's calls on another process (lock, checkpoint, restore, unlock, state), made here, in
        this process: (rc, the state read, or 0). The driver helper (driver_helper.py) makes them with this."""
        cu = self._cu
        if name == "lock":
            return cu.cuCheckpointProcessLock(pid, ctypes.byref(_LockArgs(timeoutMs=max(1, timeout_ms)))), 0
        if name == "checkpoint":
            return cu.cuCheckpointProcessCheckpoint(pid, ctypes.byref(_Args8())), 0
        if name == "unlock":
            return cu.cuCheckpointProcessUnlock(pid, ctypes.byref(_Args8())), 0
        if name == "state":
            s = ctypes.c_int()
            rc = cu.cuCheckpointProcessGetState(pid, ctypes.byref(s))
            return rc, s.value
        if name != "restore":
            raise ValueError(f"no driver process call {name!r}")
        args = _RestoreArgs()
        if pairs:
            table = (_GpuPair * len(pairs))()
            for i, (old, new) in enumerate(pairs):
                table[i].oldUuid[:] = list(old)
                table[i].newUuid[:] = list(new)
            args.gpuPairs = ctypes.cast(table, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(pairs)
        return cu.cuCheckpointProcessRestore(pid, ctypes.byref(args)), 0

    def _ask(self, name: str, pid: int, what: str, limit: float, **kw: object) -> tuple[int, int]:
        """process_call, through the helper where this process has one (a server: it copies while it asks), watched
        as _asking says."""
        helper = self.helper
        if helper is not None and helper.alive():
            return self._asking(pid, what, lambda: helper.call(name, pid, **kw), limit)
        return self._asking(pid, what, lambda: self.process_call(name, pid, **kw), limit)   # type: ignore[arg-type]

    def _asking(self, target_pid: int, what: str, call: Callable[[], tuple[int, int]], limit: float) -> tuple[int, int]:
        """call() (a request the target process's own driver threads answer) in a thread of its own, watched, so
        that no target hangs its controller (a server serving many): a process stopped meanwhile (SIGSTOP, a
        debugger) cannot answer until it runs again, so it is named at once; a driver that has not answered within
        `limit` seconds is given up on. The call itself cannot be taken back: it goes on, and the driver may finish
        it later (its state then says so, which `gpucr recover` reads)."""
        got: list[tuple[int, int]] = []
        failed: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                got.append(call())
            except GpucrError as exc:   # the helper ended before it answered
                failed.append(exc)
            finally:
                done.set()
        threading.Thread(target=run, name=f"gpucr-driver-{target_pid}", daemon=True).start()
        limit = float(os.environ.get(TEST_LIMIT_ENV) or limit)
        end = time.monotonic() + limit
        while not done.wait(WATCH_EVERY_S):
            check_not_stopped(target_pid)
            if time.monotonic() > end:
                raise DriverSilent(f"the driver did not answer the {what} of process {target_pid} within {limit:.0f} s "
                                   "(the driver may still finish it)")
        if failed:
            raise GpucrError(f"the driver's {what} of process {target_pid}: {failed[0]}")
        if not got:
            raise GpucrError(f"the driver's {what} of process {target_pid} failed inside ctypes")
        return got[0]

    def state(self, target_pid: int) -> ProcessState:
        rc, s = self._ask("state", target_pid, "state query", ANSWER_LIMIT_S)
        self._check(rc, f"reading the CUDA state of process {target_pid}")
        return ProcessState(s)

    def lock(self, target_pid: int, timeout_ms: int) -> None:
        ms = max(1, int(timeout_ms))
        rc, _ = self._ask("lock", target_pid, "lock", ms / 1000 + ANSWER_LIMIT_S, timeout_ms=ms)
        # measured on the H200: the driver refuses a process run under compute-sanitizer this way
        self._check(rc, f"driver lock of process {target_pid}", LOCK_NOT_SUPPORTED if rc == CUDA_ERROR_NOT_SUPPORTED else "")

    def checkpoint(self, target_pid: int) -> None:
        rc, _ = self._ask("checkpoint", target_pid, "checkpoint", MOVE_LIMIT_S)
        self._check(rc, f"driver checkpoint of process {target_pid}")

    def restore(self, target_pid: int, gpu_pairs: list[tuple[bytes, bytes]] | None = None) -> None:
        rc, _ = self._ask("restore", target_pid, "restore", MOVE_LIMIT_S, pairs=gpu_pairs)
        self._check(rc, f"driver restore of process {target_pid}")

    def unlock(self, target_pid: int) -> None:
        rc, _ = self._ask("unlock", target_pid, "unlock", ANSWER_LIMIT_S)
        self._check(rc, f"driver unlock of process {target_pid}")


_drivers: dict[str, Driver] = {}
_drivers_lock = threading.Lock()


SIMULATE_ENV = "GPUCR_SIMULATE"


def controller_simulated() -> bool:
    """Whether this controller itself was told to use simcuda (its own --simulate, or GPUCR_SIMULATE=1 in its
    own environment). Nothing a target says chooses the driver library a controller loads."""
    v = os.environ.get(SIMULATE_ENV, "")
    if v not in ("", "0", "1"):
        raise GpucrError(f"{SIMULATE_ENV}={v!r} is not 0 or 1")
    return v == "1"


def controller_driver() -> Driver:
    """The driver this controller acts through: the system's libcuda.so.1, or the simcuda bundled with gpucr when
    the controller itself is simulated."""
    if controller_simulated():
        from .paths import simcuda_dir
        return driver_for(str(simcuda_dir() / "libcuda.so.1"))
    try:
        return driver_for("libcuda.so.1")
    except GpucrError as exc:
        if "cannot load" not in str(exc):
            raise
        raise GpucrError(f"{exc}; install the NVIDIA driver, or, for processes started with 'gpucr run --simulate', "
                         "add --simulate") from None


def driver_for(libpath: str) -> Driver:
    """One initialised Driver per driver library, reused for every action of this process."""
    with _drivers_lock:
        if libpath not in _drivers:
            _drivers[libpath] = Driver(libpath)
        return _drivers[libpath]


def gpu_memory(driver: Driver, device: int = 0, uuid: str | None = None) -> GpuMemory | None:
    """Device memory in use by everyone, as nvidia-smi shows it (NVML; simcuda's own count when simulated).

    `device` is this process's CUDA ordinal; NVML numbers GPUs its own way, so give the GPU's `uuid`
    too where it is known. Needs no CUDA context, so reading it costs the card nothing.
    """
    if driver.simulated:
        used, total = ctypes.c_size_t(), ctypes.c_size_t()
        fn = driver._cu.simcudaDeviceMemUsed
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        if fn(device, ctypes.byref(used), ctypes.byref(total)) != 0:
            return None
        return GpuMemory(used.value, total.value)
    return _nvml_memory(device, uuid)


def sim_pageable_async_copies(driver: Driver) -> int:
    """simcuda only (the tests): this process's asynchronous copies so far whose host side was not inside
    one pinned range, which the real driver copies as pageable memory, through its own buffers and slowly."""
    if not driver.simulated:
        raise GpucrError("only simcuda counts pageable copies")
    n = ctypes.c_ulonglong()
    fn = driver._cu.simcudaPageableAsyncCopies
    fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    driver._check(fn(ctypes.byref(n)), "simcudaPageableAsyncCopies")
    return n.value


def process_gpu_memory(driver: Driver, pid: int, device: int = 0, uuid: str | None = None) -> int | None:
    """Device memory that process `pid` holds on one GPU, as nvidia-smi lists it per process (NVML's
    compute processes; simcuda's accounting per pid when simulated); 0 when it holds none there, None
    when it cannot be read. NVML lists host pids: in a container with its own pid namespace a process
    is never found there and this reads 0."""
    return processes_gpu_memory(driver, [pid], device, uuid)[pid]


def processes_gpu_memory(driver: Driver, pids: list[int], device: int = 0,
                         uuid: str | None = None) -> dict[int, int | None]:
    """process_gpu_memory of each of `pids`, from one reading of the GPU's process list (where NVML asks the driver)."""
    if driver.simulated:
        fn = driver._cu.simcudaProcessDeviceMemUsed
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        out: dict[int, int | None] = {}
        for pid in pids:
            used = ctypes.c_size_t()
            out[pid] = used.value if fn(pid, device, ctypes.byref(used)) == 0 else None
        return out
    return _nvml_processes_memory(pids, device, uuid)


def nvml_process_memory(pid: int, device: int = 0, uuid: str | None = None) -> int | None:
    """process_gpu_memory as NVML reads it, with no driver loaded here (an application asking about itself)."""
    return _nvml_processes_memory([pid], device, uuid)[pid]


def _nvml_processes_memory(pids: list[int], device: int, uuid: str | None) -> dict[int, int | None]:
    infos = _nvml_compute_processes(device, uuid)
    if infos is None:
        return dict.fromkeys(pids)
    out: dict[int, int | None] = {}
    for pid in pids:
        used = [i.usedGpuMemory for i in infos if i.pid == pid]
        out[pid] = None if any(u == NVML_VALUE_NOT_AVAILABLE for u in used) else sum(used)
    return out


def gpu_processes(driver: Driver, device: int, uuid: str | None = None) -> list[int] | None:
    """The processes with a CUDA context or memory on one GPU, as nvidia-smi lists its compute processes
    (NVML; simcuda's accounting when simulated, `device` then its physical number); None when it cannot be
    read. NVML lists host pids: in a container with its own pid namespace they are not this one's."""
    if driver.simulated:
        fn = driver._cu.simcudaDeviceProcesses
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        for room in (64, 4096):
            pids, n = (ctypes.c_int * room)(), ctypes.c_int(room)
            if fn(device, pids, ctypes.byref(n)) != 0:
                return None
            if n.value <= room:
                return list(pids[:n.value])
        return None
    infos = _nvml_compute_processes(device, uuid)
    return None if infos is None else sorted({int(i.pid) for i in infos})


NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 2, 0


def nvlinked(driver: Driver, a: tuple[int, str | None], b: tuple[int, str | None]) -> bool:
    """Whether two GPUs, each (ordinal, UUID), are joined by NVLink: NVML's P2P status over NVLink
    (simcuda's SIMCUDA_NVLINK when simulated); False when it cannot be read."""
    if driver.simulated:
        joined = ctypes.c_int(0)
        fn = driver._cu.simcudaDevicesNvlinked
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        return fn(a[0], b[0], ctypes.byref(joined)) == 0 and joined.value == 1
    ha, hb = _nvml_handle(*a), _nvml_handle(*b)
    if ha is None or hb is None:
        return False
    status = ctypes.c_int(-1)
    rc = _nvml.nvmlDeviceGetP2PStatus(ha, hb, NVML_P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
    return rc == 0 and status.value == NVML_P2P_STATUS_OK


class _NvmlProcessInfo(ctypes.Structure):   # nvmlProcessInfo_t (v2 and v3 of the call share it)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


def _nvml_compute_processes(device: int, uuid: str | None) -> list[_NvmlProcessInfo] | None:
    handle = _nvml_handle(device, uuid)
    if handle is None:
        return None
    fn = getattr(_nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None) or \
        getattr(_nvml, "nvmlDeviceGetComputeRunningProcesses_v2", None)
    if fn is None:
        return None
    count = ctypes.c_uint(0)
    infos = (_NvmlProcessInfo * 0)()
    for _ in range(3):   # the list may grow between asking its size and reading it
        rc = fn(handle, ctypes.byref(count), infos)
        if rc != NVML_ERROR_INSUFFICIENT_SIZE:
            break
        infos = (_NvmlProcessInfo * (count.value + 8))()
        count = ctypes.c_uint(len(infos))
    return list(infos[:count.value]) if rc == 0 else None


def _nvml_handle(device: int, uuid: str | None) -> ctypes.c_void_p | None:
    """NVML's handle of a GPU, by UUID where known (NVML numbers GPUs its own way); None without NVML."""
    try:
        if _nvml_lib() is None:
            return None
    except OSError:
        return None
    handle = ctypes.c_void_p()
    rc = (_nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) if uuid else
          _nvml.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(handle)))
    return handle if rc == 0 else None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


_nvml: ctypes.CDLL | None = None


def _nvml_memory(device: int, uuid: str | None = None) -> GpuMemory | None:
    handle = _nvml_handle(device, uuid)
    if handle is None:
        return None
    mem = _NvmlMemory()
    if _nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
        return None
    return GpuMemory(mem.used, mem.total)


def _nvml_lib() -> ctypes.CDLL | None:
    global _nvml
    if _nvml is None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        if lib.nvmlInit_v2() != 0:
            return None
        _nvml = lib
    return _nvml


_nvml_gpus: tuple[tuple[str, str], ...] | None = None


def nvml_gpu_list() -> list[tuple[str, str]]:
    """(UUID, name) of every GPU of the machine, in NVML's order; [] without NVML. NVML, unlike the
    driver, ignores CUDA_VISIBLE_DEVICES: this is the whole machine. Read once (NVML lists the GPUs it
    found at its init): a two-way switch asks three times, before its first copy."""
    global _nvml_gpus
    if not _nvml_gpus:
        _nvml_gpus = tuple(_read_nvml_gpu_list())
    return list(_nvml_gpus)


def _read_nvml_gpu_list() -> list[tuple[str, str]]:
    nvml = _nvml_lib()
    if nvml is None:
        return []
    n = ctypes.c_uint()
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
        return []
    out = []
    for i in range(n.value):
        handle = ctypes.c_void_p()
        uuid, name = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
        if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0 or
                nvml.nvmlDeviceGetUUID(handle, uuid, 96) != 0 or nvml.nvmlDeviceGetName(handle, name, 96) != 0):
            return []
        out.append((uuid.value.decode(), name.value.decode(errors="replace")))
    return out


def nvml_device_node(uuid: str) -> str | None:
    """/dev/nvidiaN of a GPU (N its minor number), or None without NVML."""
    nvml = _nvml_lib()
    handle, minor = ctypes.c_void_p(), ctypes.c_uint()
    if (nvml is None or nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0 or
            nvml.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor)) != 0):
        return None
    return f"/dev/nvidia{minor.value}"


def simulated_device_node(driver: Driver, ordinal: int) -> str | None:
    """simcuda's stand-in for /dev/nvidiaN of its GPU `ordinal` (the test double's own extension)."""
    buf = ctypes.create_string_buffer(4096)
    fn = driver._cu.simcudaDeviceNode
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    return buf.value.decode() if fn(ordinal, buf, len(buf)) == 0 else None


def uuid_text(raw: bytes) -> str:
    """A GPU's 16-byte UUID as nvidia-smi -L prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), as the agent
    writes it (the format's one home is native/agent/rules.h)."""
    return UUID_TEXT % tuple(raw)


def device_count(driver: Driver) -> int:
    n = ctypes.c_int()
    return n.value if driver._cu.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def device_info(driver: Driver, ordinal: int = 0) -> dict[str, str]:
    """Name and UUID of a GPU, through the driver (no context needed)."""
    cu = driver._cu
    dev = ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    uuid = (ctypes.c_ubyte * 16)()
    out = {"name": "unknown", "uuid": "unknown"}
    if cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return out
    if cu.cuDeviceGetName(name, 256, dev) == 0:
        out["name"] = name.value.decode(errors="replace")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or getattr(cu, "cuDeviceGetUuid")
    if get_uuid(ctypes.byref(uuid), dev) == 0:
        out["uuid"] = uuid_text(bytes(uuid))
    return out
