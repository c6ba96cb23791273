"""One table of wrapped entry points (native/agent/entrypoints.def): prove that the table, the symbols
the agent exports, what dlsym hands out and what cuGetProcAddress hands out all agree."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from gpucr import paths

ROOT = Path(__file__).resolve().parent.parent
DEF = ROOT / "native" / "agent" / "entrypoints.def"
RESOLVERS = {"dlsym", "cudaGetDriverEntryPoint", "cudaGetDriverEntryPoint_ptsz",
             "cudaGetDriverEntryPointByVersion", "cudaGetDriverEntryPointByVersion_ptsz", "gpucr_entry_table"}


def table() -> list[tuple[str, str, int, int, str]]:
    rows = []
    for line in DEF.read_text().splitlines():
        m = re.match(r"E\((GATED|WAITS|QUERY|CUSTOM), (\w+), (\w+), (\d+), ([01]),", line)
        if m:
            rows.append((m[2], m[3], int(m[4]), int(m[5]), m[1]))
    return rows


def test_table_is_well_formed():
    rows = table()
    assert len(rows) > 90
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)), "a symbol is listed twice"
    for sym, base, ver, pt, _ in rows:
        assert sym.startswith(base), sym
        assert pt == int(sym.endswith(("_ptsz", "_ptds"))), sym


def test_exports_match_the_table():
    out = subprocess.run(["nm", "-D", "--defined-only", str(paths.agent_lib())], capture_output=True, text=True, check=True).stdout
    exported = {l.split()[-1] for l in out.splitlines() if l.split()[1] in ("T", "W")}
    assert exported - RESOLVERS == {r[0] for r in table()}


def test_agent_has_no_cuda_dependency():
    out = subprocess.run(["readelf", "-d", str(paths.agent_lib())], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"NEEDED.*\[(.+)\]", out)
    assert not [n for n in needed if "cuda" in n], needed


PROBE = r"""
import ctypes, json, sys
agent = ctypes.CDLL(sys.argv[1])
agent.gpucr_entry_table.restype = ctypes.c_char_p
live = [l.split() for l in agent.gpucr_entry_table().decode().splitlines()]
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0)
libc = ctypes.CDLL(None)
libc.dlsym.restype = ctypes.c_void_p
libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
gpa = ctypes.cast(libc.dlsym(cu._handle, b"cuGetProcAddress_v2"), ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)))
out = {"live": live, "rows": []}
for sym, base, ver, pt, kind in live:
    wrapper = libc.dlsym(agent._handle, sym.encode())
    via_dlsym = libc.dlsym(cu._handle, sym.encode())
    p = ctypes.c_void_p(); status = ctypes.c_int()
    rc = gpa(base.encode(), ctypes.byref(p), int(ver), 2 if pt == "1" else 1, ctypes.byref(status))
    out["rows"].append([sym, wrapper, via_dlsym, rc, p.value])
print(json.dumps(out))
"""


def test_dlsym_and_cuGetProcAddress_hand_out_the_wrappers():
    env = paths.run_env(simulate=True)
    r = subprocess.run([sys.executable, "-c", PROBE, str(paths.agent_lib())], env=env, capture_output=True, text=True, check=True)
    out = json.loads(r.stdout)
    assert [(s, b, int(v), int(p), k) for s, b, v, p, k in out["live"]] == table()
    resolved = 0
    for sym, wrapper, via_dlsym, rc, via_gpa in out["rows"]:
        assert wrapper, f"{sym}: no wrapper exported"
        if via_dlsym is not None:      # the simulated driver implements it
            assert via_dlsym == wrapper, f"dlsym({sym}) did not return the wrapper"
        if rc == 0:
            assert via_gpa == wrapper, f"cuGetProcAddress({sym}) did not return the wrapper"
            resolved += 1
    assert resolved >= 40, "the simulated driver resolves too few of the table's entry points to prove anything"


OUTSIDE = r"""
import ctypes, json, sys
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0)
libc = ctypes.CDLL(None)
libc.dlsym.restype = ctypes.c_void_p
libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

class Info(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

def where(sym, how):
    if how == "dlsym":
        p = libc.dlsym(cu._handle, sym.encode())
    else:
        p = ctypes.c_void_p(); st = ctypes.c_int()
        gpa = ctypes.cast(libc.dlsym(cu._handle, b"cuGetProcAddress_v2"), ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)))
        assert gpa(sym.encode(), ctypes.byref(p), 12000, 1, ctypes.byref(st)) == 0, sym
        p = p.value
    info = Info()
    assert libc.dladdr(ctypes.c_void_p(p), ctypes.byref(info)), sym
    return info.fname.decode().rsplit("/", 1)[-1]

print(json.dumps({f"{s} {h}": where(s, h) for s in sys.argv[1:] for h in ("dlsym", "gpa")}))
"""


def test_a_driver_call_outside_the_table_is_handed_out_through_a_thunk_and_a_query_the_driver_answers_is_not():
    """thunk.c: what the driver holds while it holds the process (cuStreamIsCapturing, cuModuleGetFunction) comes
    from the agent, so it waits at the closed gate; a device query the driver answers then comes from the driver."""
    names = ["cuStreamIsCapturing", "cuModuleGetFunction", "cuDeviceGetAttribute", "cuDeviceGetCount"]
    r = subprocess.run([sys.executable, "-c", OUTSIDE, *names], env=paths.run_env(simulate=True),
                       capture_output=True, text=True, check=True)
    lib = json.loads(r.stdout)
    agent = paths.agent_lib().name
    for how in ("dlsym", "gpa"):
        assert lib[f"cuStreamIsCapturing {how}"] == lib[f"cuModuleGetFunction {how}"] == agent, lib
        assert lib[f"cuDeviceGetAttribute {how}"] != agent and lib[f"cuDeviceGetCount {how}"] != agent, lib
