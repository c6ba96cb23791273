"""What the agent (libgpucr.so) does itself, now that gpucr's data plane runs in another process (issue 25): the
driver functions its own code calls are an allow-list with no copy and no pin, and a parked application runs no
thread of gpucr's but the channel's."""
from __future__ import annotations

import re
import time
from pathlib import Path

import gpucr
from conftest import ROOT

AGENT = ROOT / "native" / "agent"

# What the agent resolves for its own calls (struct gpucr_driver in agent.h): contexts, devices, VMM address
# space, stream-ordered pools' events, error names. No copy, no memset, no pinning of host memory.
OWN = {"cuGetProcAddress_v2", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxGetDevice", "cuCtxSynchronize",
       "cuMemAddressReserve", "cuMemAddressFree", "cuMemGetAllocationGranularity", "cuMemGetInfo_v2", "cuStreamSynchronize",
       "cuEventCreate", "cuEventRecord", "cuGetErrorString", "cuGetErrorName", "cuDeviceGetAttribute",
       "cuDeviceGetUuid", "cuPointerGetAttribute", "cuDevicePrimaryCtxGetState", "cuDeviceGetCount",
       "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuStreamWaitEvent", "cuEventQuery",
       "cuStreamIsCapturing", "cuDeviceGetMemPool", "cuDeviceGetDefaultMemPool", "cuDeviceGraphMemTrim",
       "cuDeviceGetGraphMemAttribute", "simcudaIsSimulated"}
# The wrapped entry points the agent calls by name (REAL(x)) besides passing an application's call through: the
# handle life cycle (release, re-create, import, map, adopt), the pools, peer access. One memset: an import whose
# exporter ended is replaced by zeroed memory at its addresses (dp_orphan), on the device, no host memory.
BY_NAME = {"cuMemUnmap", "cuMemSetAccess", "cuMemRelease", "cuMemMap", "cuMemCreate", "cuMemPoolTrimTo",
           "cuMemExportToShareableHandle", "cuMemRetainAllocationHandle", "cuMemImportFromShareableHandle",
           "cuCtxDisablePeerAccess", "cuMulticastCreate", "cuMemPoolSetAttribute", "cuMemPoolSetAccess",
           "cuMemPoolImportPointer", "cuMemPoolImportFromShareableHandle", "cuMemPoolGetAttribute",
           "cuMemPoolExportToShareableHandle", "cuMemPoolExportPointer", "cuMemPoolDestroy", "cuMemPoolCreate",
           "cuMemGetAllocationPropertiesFromHandle", "cuMemFree_v2", "cuMemAlloc_v2", "cuMemAllocPitch_v2",
           "cuMemAllocManaged", "cuIpcGetMemHandle", "cuGetProcAddress_v2", "cuGetProcAddress", "cuEventSynchronize",
           "cuCtxSynchronize_v2", "cuCtxSynchronize", "cuCtxEnablePeerAccess", "cuCtxDestroy_v2", "cuMemsetD8_v2",
           "cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset", "cuCtxSetCurrent",
           # an application's context made again once the swap service made room for it (context.c)
           "cuDevicePrimaryCtxRetain", "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4"}
COPY_OR_PIN = re.compile(r"Memcpy|HostRegister|HostUnregister|HostAlloc|MemAllocHost|Prefetch|MemsetD(?!8_v2$)")
MACRO_ARGS = {"sym", "poolsym", "plainsym"}   # REAL(sym) inside the generated pass-through wrappers


def own_calls() -> set[str]:
    struct = re.search(r"struct gpucr_driver \{(.*?)\n\};", (AGENT / "agent.h").read_text(), re.S)
    assert struct, "agent.h has no struct gpucr_driver"
    return set(re.findall(r"\(\*(\w+)\)\(", struct[1]))


def called_by_name() -> set[str]:
    return {n for c in AGENT.glob("*.c") for n in re.findall(r"\bREAL\((\w+)\)", c.read_text())} - MACRO_ARGS


def test_the_agents_own_driver_calls_are_the_allow_list():
    own, by_name = own_calls(), called_by_name()
    assert own == OWN, f"agent.h's struct gpucr_driver changed: {sorted(own ^ OWN)}; a copy or a pin may not be added"
    assert by_name <= BY_NAME, f"the agent calls {sorted(by_name - BY_NAME)} itself: add them here only if no copy or pin"
    assert not [n for n in OWN | BY_NAME if COPY_OR_PIN.search(n)]


def test_the_allow_list_finds_a_copy_if_one_is_added(tmp_path):
    """The check itself: a copy or a pin among the names is seen."""
    assert COPY_OR_PIN.search("cuMemcpyDtoHAsync_v2") and COPY_OR_PIN.search("cuMemHostRegister_v2")
    assert COPY_OR_PIN.search("cuMemsetD32Async") and not COPY_OR_PIN.search("cuMemsetD8_v2")


def gpucr_threads(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass   # a thread that ended while listed
    return sorted(n for n in names if n.startswith("gpucr-"))


def settled_threads(pid: int) -> list[str]:
    """gpucr's threads once those of a finished request are gone (a connection's thread ends with it)."""
    deadline = time.monotonic() + 10
    while (names := gpucr_threads(pid)) != ["gpucr-channel"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return names


def test_a_parked_app_runs_no_gpucr_thread_but_the_channels(plane, sim_app):
    """Through either plane: the application holds no copy thread, pin thread or staging preparer of gpucr's, parked
    or running; a checkpoint's own helpers (a deadline job, threads touching new staging) are gone once it is."""
    app = sim_app("--sizes", "32M,4M", "--vmm-mib", "8")
    before = app.ask("digest")
    assert settled_threads(app.pid) == ["gpucr-channel"]
    for _ in range(2):
        assert gpucr.checkpoint(app.pid).data_plane == plane
        assert settled_threads(app.pid) == ["gpucr-channel"], "parked: the channel's thread alone"
        assert gpucr.restore(app.pid).data_plane == plane
        assert app.ask("digest") == before
    assert settled_threads(app.pid) == ["gpucr-channel"]
