"""Test helper: a controller that asks a process's agent for its GPU memory (gpucr.memory.gather),
imports every fd through simcuda in its own process, maps it, and prints one JSON line: for each mapping
of the process, its address -> the sha256 of its first BYTES bytes (BYTES from argv: {"va": bytes}),
read here through the import; plus what the agent said of each allocation.

    python import_memory.py PID '{"<va>": <bytes>, ...}' [LIBCUDA]

LIBCUDA defaults to simcuda's; GPU tests pass the real driver's (libcuda.so.1).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys

from gpucr import paths
from gpucr import target as targets
from gpucr import memory

u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what}: CUDA error {rc}")


def main() -> None:
    pid, want = int(sys.argv[1]), {int(k): v for k, v in json.loads(sys.argv[2]).items()}
    with targets.resolve(pid).connect() as agent:
        got = memory.gather(agent, 30.0)
    cu = ctypes.CDLL(sys.argv[3] if len(sys.argv) > 3 else str(paths.simcuda_dir() / "libcuda.so.1"))
    check(cu.cuInit(0), "cuInit")
    ctx = vp()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "ctx")
    check(cu.cuCtxSetCurrent(ctx), "set ctx")
    seen: dict[int, bytes] = {}   # each mapping of the process: its address -> its bytes, read here
    had_fd = [m.fd is not None for m in got]
    for m in got:
        if m.fd is None:
            continue
        h = u64()
        check(cu.cuMemImportFromShareableHandle(ctypes.byref(h), vp(m.fd), 1), "import")
        os.close(m.fd)   # the handle holds the memory now
        m.fd = None
        va = u64()
        check(cu.cuMemAddressReserve(ctypes.byref(va), sz(m.bytes), sz(0), u64(0), u64(0)), "reserve")
        check(cu.cuMemMap(u64(va.value), sz(m.bytes), sz(0), u64(h.value), u64(0)), "map")
        acc = Access(Loc(1, 0), 1)   # read only
        check(cu.cuMemSetAccess(u64(va.value), sz(m.bytes), ctypes.byref(acc), sz(1)), "access")
        for mp in m.maps:
            buf = ctypes.create_string_buffer(mp.bytes)
            check(cu.cuMemcpyDtoH_v2(buf, u64(va.value + mp.offset), sz(mp.bytes)), "read")
            seen[mp.va] = buf.raw
        check(cu.cuMemUnmap(u64(va.value), sz(m.bytes)), "unmap")
        check(cu.cuMemRelease(u64(h.value)), "release")
        check(cu.cuMemAddressFree(u64(va.value), sz(m.bytes)), "free")
    digests: dict[str, str] = {}
    for start, n in want.items():   # a buffer may span several allocations mapped end to end
        data, at = b"", start
        while len(data) < n and at in seen:
            data += seen[at]
            at += len(seen[at])
        if len(data) >= n:
            digests[str(start)] = hashlib.sha256(data[:n]).hexdigest()
    print(json.dumps({"digests": digests,
                      "memory": [{"kind": m.kind, "bytes": m.bytes, "device": m.device, "released": m.released,
                                  "not_exportable": m.not_exportable, "maps": [mp.va for mp in m.maps], "fd": fd}
                                 for m, fd in zip(got, had_fd)]}))


if __name__ == "__main__":
    main()
