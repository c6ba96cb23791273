"""On a real driver: does cuGetProcAddress return the same pointers as dlsym, and does the agent
substitute its wrappers under both? (Informs the 'resolve first, then substitute' design.)"""
import json
import subprocess
import sys

from gpucr import paths

PROBE = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None); libc.dlsym.restype = ctypes.c_void_p; libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
gpa = ctypes.cast(libc.dlsym(cu._handle, b"cuGetProcAddress_v2"), ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)))
rows = {}
for sym, base, ver, pt in [("cuMemAlloc_v2", "cuMemAlloc", 12000, 1), ("cuLaunchKernel", "cuLaunchKernel", 12000, 1), ("cuLaunchKernel_ptsz", "cuLaunchKernel", 12000, 2), ("cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyHtoDAsync", 12000, 2), ("cuMemCreate", "cuMemCreate", 12000, 1)]:
    p = ctypes.c_void_p(); st = ctypes.c_int()
    rc = gpa(base.encode(), ctypes.byref(p), ver, pt, ctypes.byref(st))
    rows[sym] = {"dlsym": libc.dlsym(cu._handle, sym.encode()), "gpa_rc": rc, "gpa": p.value}
print(json.dumps(rows))
"""
plain = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout)
under = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=paths.run_env()).stdout)
for sym in plain:
    print(f"{sym:28s} plain: dlsym==gpa {plain[sym]['dlsym'] == plain[sym]['gpa']}; under agent: dlsym==gpa "
          f"{under[sym]['dlsym'] == under[sym]['gpa']}, wrapped {under[sym]['gpa'] != plain[sym]['gpa']}")
