"""`gpucr doctor`: what on this host decides how fast and how safely gpucr can work."""
from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

from . import paths
from .driver import Driver, _nvml_memory, controller_simulated, gpu_memory
from .errors import GpucrError
from .manifest import cuda_version

HUGE = 2 << 20


def meminfo() -> dict[str, int]:
    """/proc/meminfo as numbers (kB, or pages for the HugePages_ counts)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0])
    return out


def report() -> dict[str, Any]:
    """The host as gpucr sees it. With --simulate (GPUCR_SIMULATE=1) the driver and GPU checked are simcuda's,
    from this installation, as a simulated controller takes them."""
    mi = meminfo()
    simulated = controller_simulated()
    r: dict[str, Any] = {
        "simulated": simulated,
        "host_memory_available_bytes": mi.get("MemAvailable", 0) * 1024,
        "hugepages_total": mi.get("HugePages_Total", 0),
        "hugepages_free": mi.get("HugePages_Free", 0),
        "hugepage_bytes": mi.get("Hugepagesize", 0) * 1024,
        "memlock_limit_bytes": None if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY
        else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
        "runtime_dir": str(paths.runtime_dir()),
    }
    try:
        r["transparent_hugepages"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        r["transparent_hugepages"] = None
    try:
        r["agent"] = str(paths.agent_lib())
    except GpucrError as exc:
        r["agent"] = None
        r["agent_problem"] = str(exc)
    try:
        r["simcuda"] = str(paths.simcuda_dir() / "libcuda.so.1")
    except GpucrError as exc:
        r["simcuda"] = None
        r["simcuda_problem"] = str(exc)
    drv = _driver(r, r["simcuda"] if simulated else "libcuda.so.1")
    gpu = _nvml_memory(0) if not simulated else gpu_memory(drv) if drv is not None else None
    r["gpu"] = None if gpu is None else {"total_bytes": gpu.total, "used_bytes": gpu.used}
    return r


def _driver(r: dict[str, Any], library: str | None) -> Driver | None:
    """Load the driver into r["driver"]: what it is, or what went wrong."""
    if library is None:   # simcuda asked for, and missing: r["simcuda_problem"] says why
        r["driver"] = {"problem": "simcuda is missing", "loaded": False, "checkpoint_api": None}
        return None
    try:
        drv = Driver(library)
    except GpucrError as exc:
        loaded = "cannot load" not in str(exc)
        r["driver"] = {"problem": str(exc), "loaded": loaded, "checkpoint_api": False if loaded else None}
        return None
    r["driver"] = {"library": drv.path, "cuda_version": drv.version(), "checkpoint_api": True, "simulated": drv.simulated}
    return drv


def problems(r: dict[str, Any]) -> list[str]:
    """What stops gpucr from checkpointing a GPU process here: each makes `gpucr doctor` fail."""
    found = []
    if r["agent"] is None:
        found.append(r["agent_problem"])
    if r["simcuda"] is None:
        found.append(r["simcuda_problem"])
    if r["driver"].get("loaded") is False and not r["simulated"]:   # simcuda's absence is said above
        found.append("no CUDA driver (libcuda.so.1) could be loaded: install the NVIDIA driver, or use simcuda "
                     "with 'gpucr run --simulate' ('gpucr doctor --simulate' checks it)")
    elif not r["driver"].get("checkpoint_api"):
        found.append("the CUDA driver's checkpoint API is missing (driver 555 or newer has it): only --level data can work")
    return found


def advice(r: dict[str, Any]) -> list[str]:
    """What would make gpucr faster or safer here; none of it stops it."""
    tips = []
    if r["hugepages_free"] == 0:
        tips.append("no hugepages are reserved: staging falls back to 4 KiB shared memory, which takes ~2-4x longer "
                    "to prepare; as root, reserve N GiB with: echo $((N*512)) > /proc/sys/vm/nr_hugepages")
    if r["memlock_limit_bytes"] is not None and os.geteuid() != 0:   # root may pin past the limit
        tips.append(f"the locked-memory limit is {r['memlock_limit_bytes'] >> 20} MiB; pinning staging may fail: raise it "
                    "with 'ulimit -l unlimited' (or in /etc/security/limits.conf)")
    if r["gpu"] is None and not r["simulated"]:
        tips.append("no NVIDIA GPU answered through NVML: only 'gpucr run --simulate' (simcuda, a test double) works here")
    return tips


def main(as_json: bool = False) -> int:
    """Print the report; 1 when something gpucr needs is missing (see problems), else 0."""
    import json
    r = report()
    r["problems"] = problems(r)
    r["advice"] = advice(r)
    code = 1 if r["problems"] else 0
    if as_json:
        from .results import SCHEMA_VERSION
        print(json.dumps({"schema_version": SCHEMA_VERSION, "command": "doctor", **r}, indent=2))
        return code
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    drv = r["driver"]
    if r["simulated"]:
        print("checking simcuda, the simulated driver (a test double: no GPU is used, and nothing here says how a "
              "GPU would do)")
    print(f"driver        {drv.get('library', 'libcuda.so.1')}: " + (f"CUDA {cuda_version(drv['cuda_version'])}, "
          f"checkpoint API present" if "cuda_version" in drv else drv.get("problem", "")))
    print("gpu           " + (f"none found ({'simcuda' if r['simulated'] else 'NVML'})" if r["gpu"] is None else
                               f"{gib(r['gpu']['total_bytes'])}, {gib(r['gpu']['used_bytes'])} in use"))
    print(f"host memory   {gib(r['host_memory_available_bytes'])} available")
    print(f"hugepages     {r['hugepages_free']} free of {r['hugepages_total']} ({gib(r['hugepages_free'] * r['hugepage_bytes'])})"
          f"; transparent hugepages: {r['transparent_hugepages']}")
    limit = "unlimited" if r["memlock_limit_bytes"] is None else f"{r['memlock_limit_bytes'] >> 20} MiB"
    print(f"pinned memory limit (ulimit -l): {limit}"
          + (" (root may exceed it)" if os.geteuid() == 0 else ""))
    print(f"agent         {r['agent'] or 'missing'}")
    print(f"simcuda       {r['simcuda'] or 'missing'}")
    print(f"runtime dir   {r['runtime_dir']}")
    for t in r["problems"]:
        print(f"problem: {t}")
    for t in r["advice"]:
        print(f"advice: {t}")
    if code:
        print(f"{len(r['problems'])} problem(s): gpucr cannot checkpoint a GPU process here")
    else:
        print("nothing missing on simcuda (a test double)" if r["simulated"] else
              "nothing missing" + (" (the driver found is simcuda, a test double)" if drv.get("simulated") else ""))
    return code
