"""simcuda (the simulated driver, a test double) with two devices: per-device VMM access, peer
access to cuMemAlloc memory, cuMemcpyPeer, and restoring a process onto other GPUs (gpuPairs).

The CUDA side runs in child processes that load simcuda's libcuda.so.1 through ctypes
(SIMCUDA_DEVICES=2); this process is the checkpoint controller and reads per-device usage the
way nvidia-smi would (simcudaDeviceMemUsed), without cuInit."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from gpucr import paths

MiB = 1 << 20
TOTAL = 512 * MiB
CTX = 32 * MiB

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY = 0, 1, 2
INVALID_DEVICE, INVALID_CONTEXT = 101, 201
ILLEGAL_ADDRESS, PEER_ALREADY_ENABLED, PEER_NOT_ENABLED = 700, 704, 705
RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2
NONE, READ, RW = 0, 1, 3

# Loaded into every child: ctypes bindings of the simcuda entry points the scenarios use, and
# small helpers. A helper that must succeed raises; the calls under test return their CUresult.
PRELUDE = r'''
import ctypes, json, sys
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p

cu = ctypes.CDLL("libcuda.so.1")
assert cu.simcudaIsSimulated() == 1
ptr = c_ulonglong
class Loc(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]
class Prop(ctypes.Structure):
    _fields_ = [("type", c_int), ("handleTypes", c_int), ("location", Loc), ("win32", c_void_p), ("flags", ctypes.c_ubyte * 8)]
class Desc(ctypes.Structure):
    _fields_ = [("location", Loc), ("flags", c_int)]
SIGS = {
    "cuInit": [c_uint], "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int], "cuDevicePrimaryCtxRelease_v2": [c_int],
    "cuCtxSetCurrent": [c_void_p], "cuCtxGetCurrent": [POINTER(c_void_p)],
    "cuCtxCreate_v2": [POINTER(c_void_p), c_uint, c_int], "cuCtxDestroy_v2": [c_void_p],
    "cuMemAlloc_v2": [POINTER(ptr), c_size_t], "cuMemFree_v2": [ptr],
    "cuMemAddressReserve": [POINTER(ptr), c_size_t, c_size_t, ptr, c_ulonglong],
    "cuMemCreate": [POINTER(c_ulonglong), c_size_t, POINTER(Prop), c_ulonglong],
    "cuMemMap": [ptr, c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemSetAccess": [ptr, c_size_t, POINTER(Desc), c_size_t],
    "cuMemGetAccess": [POINTER(c_ulonglong), POINTER(Loc), ptr],
    "cuModuleLoadData": [POINTER(c_void_p), c_char_p], "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [c_void_p] + [c_uint] * 7 + [c_void_p, POINTER(c_void_p), POINTER(c_void_p)],
    "cuMemcpyHtoD_v2": [ptr, c_void_p, c_size_t], "cuMemcpyDtoH_v2": [c_void_p, ptr, c_size_t],
    "cuMemcpyDtoD_v2": [ptr, ptr, c_size_t], "cuMemsetD32_v2": [ptr, c_uint, c_size_t],
    "cuStreamCreate": [POINTER(c_void_p), c_uint],
    "cuMemcpyPeer": [ptr, c_void_p, ptr, c_void_p, c_size_t],
    "cuMemcpyPeerAsync": [ptr, c_void_p, ptr, c_void_p, c_size_t, c_void_p],
    "cuDeviceCanAccessPeer": [POINTER(c_int), c_int, c_int],
    "cuCtxEnablePeerAccess": [c_void_p, c_uint], "cuCtxDisablePeerAccess": [c_void_p],
    "cuDeviceGetUuid_v2": [c_void_p, c_int], "cuDeviceGetPCIBusId": [c_char_p, c_int, c_int],
    "cuMemGetInfo_v2": [POINTER(c_size_t), POINTER(c_size_t)],
    "cuPointerGetAttribute": [c_void_p, c_int, ptr],
    "cuGetProcAddress": [c_char_p, POINTER(c_void_p), c_int, c_uint64],
}
for name, args in SIGS.items():
    getattr(cu, name).argtypes = args
    getattr(cu, name).restype = c_int

GRAN = 2 << 20
NONE, READ, RW = 0, 1, 3

def ok(rc, what="call"):
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")

def primary(dev):
    ctx = c_void_p()
    ok(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "retain")
    return ctx

def use(ctx):
    ok(cu.cuCtxSetCurrent(ctx), "set current")

def alloc(size):
    p = ptr()
    ok(cu.cuMemAlloc_v2(byref(p), size), "cuMemAlloc")
    return p.value

def vmm(dev, size):
    """Reserved, created on dev and mapped: no device has access yet."""
    va, h = ptr(), c_ulonglong()
    prop = Prop(type=1, location=Loc(1, dev))
    ok(cu.cuMemAddressReserve(byref(va), size, 0, 0, 0), "reserve")
    ok(cu.cuMemCreate(byref(h), size, byref(prop), 0), "create")
    ok(cu.cuMemMap(va.value, size, 0, h.value, 0), "map")
    return va.value

def set_access(va, size, *grants):
    """grants: (device, flags), applied in order."""
    descs = (Desc * len(grants))(*[Desc(Loc(1, d), f) for d, f in grants])
    return cu.cuMemSetAccess(va, size, descs, len(grants))

def get_access(va, dev):
    f = c_ulonglong(99)
    ok(cu.cuMemGetAccess(byref(f), byref(Loc(1, dev)), va), "get access")
    return f.value

_modules = {}
def kernel(name):
    """The builtin `name`, from a module loaded in the current context."""
    cur = c_void_p()
    ok(cu.cuCtxGetCurrent(byref(cur)), "current")
    if cur.value not in _modules:
        m = c_void_p()
        ok(cu.cuModuleLoadData(byref(m), b"simcuda-builtin"), "module")
        _modules[cur.value] = m
    f = c_void_p()
    ok(cu.cuModuleGetFunction(byref(f), _modules[cur.value], name.encode()), "function")
    return f

def launch(name, *args, stream=None):
    """Runs builtin `name` in the current context (or stream's); args: ctypes values."""
    params = (c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    return cu.cuLaunchKernel(kernel(name), 1, 1, 1, 1, 1, 1, 0, stream, params, None)

def fill(p, value, n, stream=None):
    return launch("fill_u32", ptr(p), c_uint(value), c_ulonglong(n), stream=stream)

def add(p, value, n, stream=None):
    return launch("add_u32", ptr(p), c_uint(value), c_ulonglong(n), stream=stream)

def checksum(p, n, out):
    return launch("checksum_u32", ptr(p), c_ulonglong(n), ptr(out))

def read_u32(p, n):
    buf = (c_uint * n)()
    ok(cu.cuMemcpyDtoH_v2(buf, p, 4 * n), "DtoH")
    return list(buf)

def write_u32(p, values):
    buf = (c_uint * len(values))(*values)
    ok(cu.cuMemcpyHtoD_v2(p, buf, 4 * len(values)), "HtoD")

def host_perms(va):
    """The page protection of the host's view of va, from /proc/self/maps ("rw-s", "---s")."""
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= va < hi:
            return line.split()[1]
    return None

def uuid(dev):
    buf = ctypes.create_string_buffer(16)
    ok(cu.cuDeviceGetUuid_v2(buf, dev), "uuid")
    return buf.raw.hex()

def bus_id(dev):
    buf = ctypes.create_string_buffer(32)
    ok(cu.cuDeviceGetPCIBusId(buf, 32, dev), "bus id")
    return buf.value.decode()

def mem_free():
    free, total = c_size_t(), c_size_t()
    ok(cu.cuMemGetInfo_v2(byref(free), byref(total)), "mem info")
    return free.value

def ordinal_of(p):
    d = c_int(-1)
    ok(cu.cuPointerGetAttribute(byref(d), 9, p), "device ordinal")  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return d.value

ok(cu.cuInit(0), "cuInit")
'''


@pytest.fixture(autouse=True)
def two_devices(monkeypatch):
    """Two simulated devices of 512 MiB, 32 MiB per context, for the children and for this process."""
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(TOTAL))
    monkeypatch.setenv("SIMCUDA_CTX_BYTES", str(CTX))


def child_env() -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=str(paths.simcuda_dir()))


def run_scenario(body: str) -> dict:
    """Runs PRELUDE + body in a child; body fills the dict R, which comes back."""
    code = PRELUDE + "R = {}\n" + body + "\nprint(json.dumps(R))\n"
    r = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


class Child:
    """A long-lived child: runs PRELUDE + setup, then answers each command (a Python expression
    over the child's globals) with its JSON value, one line each way."""

    def __init__(self, setup: str):
        loop = "\nfor line in sys.stdin:\n    print(json.dumps(eval(line)), flush=True)\n"
        self.proc = subprocess.Popen([sys.executable, "-c", PRELUDE + setup + loop], env=child_env(), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid

    def ask(self, expr: str):
        self.proc.stdin.write(expr + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the child died answering {expr!r} (rc {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def children():
    started: list[Child] = []

    def start(setup: str) -> Child:
        c = Child(setup)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


# ---- the controller side: this process, no cuInit ----

class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


def lib() -> ctypes.CDLL:
    return ctypes.CDLL(str(paths.simcuda_dir() / "libcuda.so.1"))


def state(pid: int) -> int:
    s = ctypes.c_int(-1)
    assert lib().cuCheckpointProcessGetState(pid, ctypes.byref(s)) == SUCCESS
    return s.value


def lock_and_checkpoint(pid: int) -> None:
    assert lib().cuCheckpointProcessLock(pid, None) == SUCCESS
    assert lib().cuCheckpointProcessCheckpoint(pid, None) == SUCCESS
    assert state(pid) == CHECKPOINTED


def restore(pid: int, pairs: list[tuple[str, str]] | None = None, count: int | None = None) -> int:
    """cuCheckpointProcessRestore with GPU pairs given as hex UUIDs; count overrides gpuPairsCount."""
    args = RestoreArgs()
    arr = None
    if pairs:
        arr = (GpuPair * len(pairs))()
        for i, (old, new) in enumerate(pairs):
            arr[i].oldUuid[:] = list(bytes.fromhex(old))
            arr[i].newUuid[:] = list(bytes.fromhex(new))
        args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(GpuPair))
    args.gpuPairsCount = len(pairs or []) if count is None else count
    return lib().cuCheckpointProcessRestore(pid, ctypes.byref(args))


def unlock(pid: int) -> None:
    assert lib().cuCheckpointProcessUnlock(pid, None) == SUCCESS
    assert state(pid) == RUNNING


def device_used(dev: int) -> int:
    """Bytes in use on physical device dev by every process, as nvidia-smi would show them."""
    used, total = ctypes.c_size_t(), ctypes.c_size_t()
    fn = lib().simcudaDeviceMemUsed
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    assert fn(dev, ctypes.byref(used), ctypes.byref(total)) == SUCCESS
    return used.value


def process_used(pid: int) -> int:
    used = ctypes.c_size_t()
    fn = lib().simcudaProcessMemUsed
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    assert fn(pid, ctypes.byref(used)) == SUCCESS
    return used.value


# ---- per-device access to VMM memory ----

def test_vmm_access_is_per_device():
    r = run_scenario(r'''
c0, c1 = primary(0), primary(1)
use(c0)
va = vmm(0, 2 * GRAN)
R["before_any"] = [get_access(va, 0), get_access(va, 1), host_perms(va)]
R["set0"] = set_access(va, 2 * GRAN, (0, RW))
R["access_dev0_only"] = [get_access(va, 0), get_access(va, 1), host_perms(va)]
R["fill_in_c0"] = fill(va, 7, 1024)

use(c1)  # device 1: no access yet
R["dev1_denied"] = [fill(va, 9, 1024), cu.cuMemsetD32_v2(va, 9, 16), cu.cuMemcpyHtoD_v2(va, (c_uint * 1)(9), 4)]
s1 = c_void_p()
ok(cu.cuStreamCreate(byref(s1), 0))
R["set1"] = set_access(va, 2 * GRAN, (1, RW))  # names device 1 only: device 0 keeps its access
R["access_both"] = [get_access(va, 0), get_access(va, 1)]
R["add_in_c1"] = add(va, 1, 1024)
use(c0)
R["values"] = read_u32(va, 2) + read_u32(va + 4 * 1023, 1)
R["stream_c1_from_c0"] = add(va, 1, 1, stream=s1)  # stream work runs in the stream's context

use(c1)
R["set1_read"] = set_access(va, 2 * GRAN, (1, READ))
out = alloc(8)  # device 1's own memory for the result
R["read_only_dev1"] = [fill(va, 3, 4), checksum(va, 4, out), read_u32(out, 2)]

R["revoke1"] = set_access(va, 2 * GRAN, (1, NONE))
R["after_revoke"] = [get_access(va, 0), get_access(va, 1), fill(va, 3, 4), checksum(va, 4, out)]
use(c0)
R["c0_still"] = [fill(va, 5, 1), read_u32(va, 1)]
R["stream_c1_revoked"] = fill(va, 6, 1, stream=s1)

# one call, several descriptors: later ones win per device; a bad device changes nothing
R["later_wins"] = set_access(va, GRAN, (1, RW), (0, READ), (1, NONE))
R["per_granule"] = [get_access(va, 0), get_access(va, 1), get_access(va + GRAN, 0), host_perms(va), host_perms(va + GRAN)]
R["bad_device"] = set_access(va, 2 * GRAN, (1, RW), (2, RW))
R["after_bad"] = [get_access(va, 1), get_access(va + GRAN, 1)]
R["revoke_all"] = set_access(va, 2 * GRAN, (0, NONE), (1, NONE))
R["host_none"] = host_perms(va)
''')
    assert r["before_any"] == [NONE, NONE, "---s"]
    assert r["set0"] == SUCCESS
    assert r["access_dev0_only"] == [RW, NONE, "rw-s"]
    assert r["fill_in_c0"] == SUCCESS
    # device 1 without access: the kernel faults, memset and copy are refused
    assert r["dev1_denied"] == [ILLEGAL_ADDRESS, INVALID_VALUE, INVALID_VALUE]
    assert r["set1"] == SUCCESS and r["access_both"] == [RW, RW]
    assert r["add_in_c1"] == SUCCESS and r["values"] == [8, 8, 8]
    assert r["stream_c1_from_c0"] == SUCCESS
    # read-only for device 1: it can read (checksum of four 7+1+... values) but not write
    assert r["set1_read"] == SUCCESS
    fill_rc, sum_rc, out = r["read_only_dev1"]
    assert fill_rc == ILLEGAL_ADDRESS and sum_rc == SUCCESS and out == [9 + 8 + 8 + 8, 0]
    assert r["revoke1"] == SUCCESS
    assert r["after_revoke"] == [RW, NONE, ILLEGAL_ADDRESS, ILLEGAL_ADDRESS]
    assert r["c0_still"] == [SUCCESS, [5]]
    assert r["stream_c1_revoked"] == ILLEGAL_ADDRESS, "a stream of device 1 must not reach it through device 0's context"
    assert r["later_wins"] == SUCCESS
    assert r["per_granule"] == [READ, NONE, RW, "r--s", "rw-s"]
    assert r["bad_device"] == INVALID_DEVICE and r["after_bad"] == [NONE, NONE]
    assert r["revoke_all"] == SUCCESS and r["host_none"] == "---s", "no device may touch it: the host view faults"


# ---- peer access to cuMemAlloc memory ----

def test_peer_access_to_native_allocations():
    r = run_scenario(r'''
c0, c1 = primary(0), primary(1)
can = c_int(-1)
R["can"] = []
for a, b in [(0, 1), (1, 0), (0, 0)]:
    R["can"].append([cu.cuDeviceCanAccessPeer(byref(can), a, b), can.value])
R["can_bad"] = [cu.cuDeviceCanAccessPeer(byref(can), 0, 2), cu.cuDeviceCanAccessPeer(byref(can), -1, 0)]

use(c0)
p0 = alloc(4096)
ok(fill(p0, 1, 1024))
shared = vmm(0, GRAN)
ok(set_access(shared, GRAN, (0, RW)))
use(c1)
p1 = alloc(4096)
R["before"] = [fill(p0, 2, 1024), cu.cuMemsetD32_v2(p0, 2, 4)]
R["enable_flags"] = cu.cuCtxEnablePeerAccess(c0, 1)
R["enable_self"] = cu.cuCtxEnablePeerAccess(c1, 0)
R["enable"] = cu.cuCtxEnablePeerAccess(c0, 0)
R["enable_again"] = cu.cuCtxEnablePeerAccess(c0, 0)
R["after"] = [fill(p0, 2, 1024), add(p0, 1, 1024), cu.cuMemsetD32_v2(p0 + 4, 5, 1)]
use(c0)
p0_later = alloc(4096)  # allocated after the enable: reachable too
R["values"] = read_u32(p0, 3)
R["one_way"] = fill(p1, 1, 1)  # c1 reaching c0 says nothing about c0 reaching c1
use(c1)
R["later"] = fill(p0_later, 4, 1)
R["vmm_not_covered"] = fill(shared, 1, 1)  # peer access is not for VMM memory

R["disable"] = cu.cuCtxDisablePeerAccess(c0)
R["disable_again"] = cu.cuCtxDisablePeerAccess(c0)
R["after_disable"] = [fill(p0, 3, 1), fill(p0_later, 3, 1)]

# two contexts of one device cannot be peers
c1b = c_void_p()
ok(cu.cuCtxCreate_v2(byref(c1b), 0, 1))  # becomes current
R["same_device"] = cu.cuCtxEnablePeerAccess(c1, 0)
ok(cu.cuCtxDestroy_v2(c1b))
R["destroyed_peer"] = cu.cuCtxEnablePeerAccess(c1b, 0)
# a context that goes away takes the peer access to it along: retained again, it starts without
use(c1)
ok(cu.cuCtxEnablePeerAccess(c0, 0))
ok(cu.cuDevicePrimaryCtxRelease_v2(0))
c0_again = primary(0)
use(c0_again)
fresh = alloc(4096)
use(c1)
R["peer_gone"] = [c0_again.value == c0.value, fill(fresh, 1, 1), cu.cuCtxDisablePeerAccess(c0_again)]

pfn = c_void_p()
R["procaddr"] = []
for name in [b"cuDeviceCanAccessPeer", b"cuCtxEnablePeerAccess", b"cuCtxDisablePeerAccess", b"cuMemcpyPeer", b"cuMemcpyPeerAsync"]:
    rc = cu.cuGetProcAddress(name, byref(pfn), 12000, 0)
    R["procaddr"].append([rc, pfn.value == ctypes.cast(getattr(cu, name.decode()), c_void_p).value])
ok(cu.cuGetProcAddress(b"cuMemcpyPeer", byref(pfn), 12000, 2))  # per-thread default stream flavour
R["ptds"] = pfn.value == ctypes.cast(cu.cuMemcpyPeer_ptds, c_void_p).value
''')
    assert r["can"] == [[SUCCESS, 1], [SUCCESS, 1], [SUCCESS, 0]]
    assert r["can_bad"] == [INVALID_DEVICE, INVALID_DEVICE]
    assert r["before"] == [ILLEGAL_ADDRESS, INVALID_VALUE]
    assert r["enable_flags"] == INVALID_VALUE and r["enable_self"] == INVALID_CONTEXT
    assert r["enable"] == SUCCESS and r["enable_again"] == PEER_ALREADY_ENABLED
    assert r["after"] == [SUCCESS, SUCCESS, SUCCESS]
    assert r["values"] == [3, 5, 3]
    assert r["one_way"] == ILLEGAL_ADDRESS
    assert r["later"] == SUCCESS
    assert r["vmm_not_covered"] == ILLEGAL_ADDRESS
    assert r["disable"] == SUCCESS and r["disable_again"] == PEER_NOT_ENABLED
    assert r["after_disable"] == [ILLEGAL_ADDRESS, ILLEGAL_ADDRESS]
    assert r["same_device"] == INVALID_DEVICE and r["destroyed_peer"] == INVALID_CONTEXT
    assert r["peer_gone"] == [True, ILLEGAL_ADDRESS, PEER_NOT_ENABLED]
    assert r["procaddr"] == [[SUCCESS, True]] * 5 and r["ptds"]


def test_copies_between_devices_need_no_peer_access():
    r = run_scenario(r'''
c0, c1 = primary(0), primary(1)
use(c0)
src = alloc(4096)
write_u32(src, list(range(100, 164)))
vmm0 = vmm(0, GRAN)
ok(set_access(vmm0, GRAN, (0, RW)))
use(c1)
dst, dst2, dst3 = alloc(4096), alloc(4096), alloc(4096)
s1 = c_void_p()
ok(cu.cuStreamCreate(byref(s1), 0))
R["no_peer"] = fill(src, 0, 1)  # no peer access: device 1's kernels cannot reach src
R["peer"] = cu.cuMemcpyPeer(dst, c1, src, c0, 256)
R["peer_async"] = cu.cuMemcpyPeerAsync(dst2 + 4, c1, src, c0, 8, s1)
R["copied"] = [read_u32(dst, 64) == list(range(100, 164)), read_u32(dst2, 3)]
# a plain copy of cuMemAlloc memory between devices goes through unified addressing
R["uva"] = cu.cuMemcpyDtoD_v2(dst3, src + 8, 4)
R["uva_value"] = read_u32(dst3, 1)
# VMM memory: each side is checked against its own context's device
R["vmm_wrong_ctx"] = cu.cuMemcpyPeer(vmm0, c1, src, c0, 4)
R["vmm_right_ctx"] = cu.cuMemcpyPeer(vmm0, c0, dst, c1, 4)
R["vmm_dtod_from_dev1"] = cu.cuMemcpyDtoD_v2(dst3, vmm0, 4)
use(c0)
R["vmm_value"] = read_u32(vmm0, 1)
R["bad_ctx"] = [cu.cuMemcpyPeer(dst, None, src, c0, 4), cu.cuMemcpyPeer(dst, c1, src, c_void_p(12345), 4)]
''')
    assert r["no_peer"] == ILLEGAL_ADDRESS
    assert r["peer"] == SUCCESS and r["peer_async"] == SUCCESS
    assert r["copied"] == [True, [0, 100, 101]]
    assert r["uva"] == SUCCESS and r["uva_value"] == [102]
    assert r["vmm_wrong_ctx"] == INVALID_VALUE and r["vmm_right_ctx"] == SUCCESS
    assert r["vmm_dtod_from_dev1"] == INVALID_VALUE
    assert r["vmm_value"] == [100]
    assert r["bad_ctx"] == [INVALID_CONTEXT, INVALID_CONTEXT]


# ---- restoring onto other GPUs ----

# Ordinal 0: a context + 4 MiB; ordinal 1: a context + 10 MiB + 2 MiB of VMM that only device 1
# may access. Patterns are kept to be checked after each restore.
TWO_GPU_APP = r'''
c0, c1 = primary(0), primary(1)
use(c0)
a = alloc(4 * 1024 * 1024)
ok(fill(a, 0xA0, 1024 * 1024))
use(c1)
b = alloc(10 * 1024 * 1024)
ok(fill(b, 0xB1, 10 * 256 * 1024))
v = vmm(1, GRAN)
ok(set_access(v, GRAN, (1, RW)))
ok(fill(v, 0xC1, 512 * 1024))
use(c0)

def check():
    use(c0)
    ra = read_u32(a, 2) + read_u32(a + 4 * 1024 * 1024 - 4, 1)
    ka = [add(a, 1, 1), add(a, -1 & 0xffffffff, 1)]  # kernels in c0 still reach a, nothing changes
    vm0 = fill(v, 0, 1)  # ordinal 0 still has no access to v
    free0 = mem_free()
    use(c1)
    rb = read_u32(b, 1) + read_u32(b + 10 * 1024 * 1024 - 4, 1)
    rv = read_u32(v, 1) + read_u32(v + GRAN - 4, 1)
    kv = [add(v, 0, 1)]
    free1 = mem_free()
    use(c0)
    return {"uuids": [uuid(0), uuid(1)], "bus": [bus_id(0), bus_id(1)], "a": ra, "b": rb, "v": rv,
            "kernels": ka + kv, "vmm_from_0": vm0, "free": [free0, free1],
            "ordinals": [ordinal_of(a), ordinal_of(b), ordinal_of(v)]}
'''

A_BYTES, B_BYTES = 4 * MiB, 12 * MiB   # per ordinal, contexts aside
INTACT = {"a": [0xA0, 0xA0, 0xA0], "b": [0xB1, 0xB1], "v": [0xC1, 0xC1], "kernels": [SUCCESS] * 3,
          "vmm_from_0": ILLEGAL_ADDRESS, "ordinals": [0, 1, 1]}


def assert_intact(got: dict) -> None:
    for key, want in INTACT.items():
        assert got[key] == want, key


def test_restore_onto_swapped_gpus_moves_devices_and_keeps_data(children):
    app = children(TWO_GPU_APP)
    start = app.ask("check()")
    assert_intact(start)
    u0, u1 = start["uuids"]
    assert u0 != u1 and start["bus"] == ["0000:10:00.0", "0000:11:00.0"]
    assert [device_used(0), device_used(1)] == [CTX + A_BYTES, CTX + B_BYTES]
    assert start["free"] == [TOTAL - CTX - A_BYTES, TOTAL - CTX - B_BYTES]

    lock_and_checkpoint(app.pid)
    assert [device_used(0), device_used(1)] == [0, 0]
    assert restore(app.pid, [(u0, u1), (u1, u0)]) == SUCCESS
    assert state(app.pid) == LOCKED
    # ordinal 0's memory now weighs on GPU 1 and the other way round, for every process to see
    assert [device_used(0), device_used(1)] == [CTX + B_BYTES, CTX + A_BYTES]
    unlock(app.pid)

    moved = app.ask("check()")
    assert_intact(moved)
    assert moved["uuids"] == [u1, u0], "ordinal 0 is now the GPU that was ordinal 1"
    assert moved["bus"] == ["0000:11:00.0", "0000:10:00.0"]
    assert moved["free"] == [TOTAL - CTX - A_BYTES, TOTAL - CTX - B_BYTES]
    # a new allocation on ordinal 0 lands on physical GPU 1
    assert app.ask("[use(c0), alloc(6 * 1024 * 1024)][1] > 0")
    assert [device_used(0), device_used(1)] == [CTX + B_BYTES, CTX + A_BYTES + 6 * MiB]
    assert app.ask("mem_free()") == TOTAL - CTX - A_BYTES - 6 * MiB
    # and another process on GPU 0 sees what the moved ordinal 1 holds there
    other = children("use(primary(0))\n")
    assert other.ask("mem_free()") == TOTAL - (CTX + B_BYTES) - CTX
    other.close()

    # identity pairs (by the UUIDs the process sees now) move nothing; then back, with the pairs in the other order
    _cycle_onto(app, [(u1, u1), (u0, u0)], [u1, u0], [CTX + B_BYTES, CTX + A_BYTES + 6 * MiB])
    _cycle_onto(app, [(u0, u1), (u1, u0)], [u0, u1], [CTX + A_BYTES + 6 * MiB, CTX + B_BYTES])


def _cycle_onto(app, pairs: list[tuple[str, str]], uuids: list[str], used: list[int]) -> None:
    """A checkpoint, then a restore onto `pairs`: the app sees `uuids`, its data intact, and each GPU holds `used`."""
    lock_and_checkpoint(app.pid)
    assert restore(app.pid, pairs) == SUCCESS
    unlock(app.pid)
    after = app.ask("check()")
    assert_intact(after)
    assert after["uuids"] == uuids
    assert [device_used(0), device_used(1)] == used


def test_refused_gpu_pairs_leave_the_process_checkpointed(children):
    app = children(TWO_GPU_APP)
    u0, u1 = app.ask("[uuid(0), uuid(1)]")
    bogus = "ab" * 16
    lock_and_checkpoint(app.pid)
    refusals = {
        "misses a checkpointed GPU": [(u0, u1)],
        "names only the identity of one GPU": [(u0, u0)],
        "unknown new UUID": [(u0, bogus), (u1, u0)],
        "unknown old UUID": [(bogus, u0), (u1, u1), (u0, u1)],
        "duplicate target": [(u0, u1), (u1, u1)],
        "duplicate old UUID": [(u0, u1), (u1, u0), (u0, u0)],
    }
    for why, pairs in refusals.items():
        assert restore(app.pid, pairs) == INVALID_VALUE, why
        assert state(app.pid) == CHECKPOINTED, why
        assert process_used(app.pid) == 0, why
    assert restore(app.pid, count=1) == INVALID_VALUE, "a pair count without pairs"
    assert restore(app.pid, [(u0, u1), (u1, u0)] * 9) == INVALID_VALUE, "more pairs than any process has GPUs"

    # GPU 0 has room for ordinal 0's 36 MiB but not for ordinal 1's 44 MiB: the swap is out of
    # memory, the identity restore fits
    holder = children("use(primary(0))\nheld = alloc(%d)\n" % (TOTAL - CTX - (CTX + A_BYTES + 4 * MiB)))
    assert holder.ask("mem_free()") == CTX + A_BYTES + 4 * MiB
    assert restore(app.pid, [(u0, u1), (u1, u0)]) == OUT_OF_MEMORY
    assert state(app.pid) == CHECKPOINTED and process_used(app.pid) == 0
    assert holder.ask("mem_free()") == CTX + A_BYTES + 4 * MiB, "a refused restore holds nothing on the device"

    assert restore(app.pid) == SUCCESS
    unlock(app.pid)
    after = app.ask("check()")
    assert_intact(after)
    assert after["uuids"] == [u0, u1]
    assert process_used(app.pid) == 2 * CTX + A_BYTES + B_BYTES
    assert holder.ask("mem_free()") == 4 * MiB


def test_a_one_gpu_process_moves_to_the_other_gpu(children):
    app = children(r'''
use(primary(0))
p = alloc(8 * 1024 * 1024)
ok(fill(p, 0x5a, 2 * 1024 * 1024))
''')
    u0, u1 = app.ask("[uuid(0), uuid(1)]")
    assert [device_used(0), device_used(1)] == [CTX + 8 * MiB, 0]
    lock_and_checkpoint(app.pid)
    # as on the driver (measured on a two-GPU H200 host): a pair for the used GPU alone is refused,
    # the pairs must be a permutation of every GPU of the machine; the refusal leaves it restorable
    assert restore(app.pid, [(u0, u1)]) == INVALID_VALUE
    assert state(app.pid) == CHECKPOINTED
    assert restore(app.pid, [(u0, u0)]) == INVALID_VALUE, "even the identity pair alone"
    assert restore(app.pid, [(u0, u1), (u1, u0)]) == SUCCESS
    unlock(app.pid)
    assert [device_used(0), device_used(1)] == [0, CTX + 8 * MiB]
    assert app.ask("[uuid(0), uuid(1)]") == [u1, u0]
    assert app.ask("read_u32(p, 1) + read_u32(p + 8 * 1024 * 1024 - 4, 1)") == [0x5a, 0x5a]
    assert app.ask("fill(p, 1, 1)") == SUCCESS
