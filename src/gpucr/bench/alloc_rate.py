"""Stream-ordered alloc/free pairs per second, gpucr against the driver's own pools, beside `gpucr bench`:

    python -m gpucr.bench.alloc_rate [--simulate] [--out FILE.json]

The worker (alloc_rate.c, built here with the C compiler) runs the same loop twice per configuration:
without gpucr's agent (`driver`: the driver's pools) and under it (`gpucr`: the agent's pools, whose
memory its data plane moves). Several streams, one thread or several, a window of live allocations per
stream, sizes 512 B to 4 MiB. The JSON (schema gpucr-alloc-bench/1) is ready for bench/results/; on
simcuda it says in every place that these are not GPU numbers.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..driver import driver_for
from ..errors import GpucrError
from ..paths import run_env, simcuda_dir
from ..workloads.runner import plain_env
from .run import SIMULATED_BANNER, environment

SCHEMA = "gpucr-alloc-bench/1"
SOURCE = Path(__file__).with_name("alloc_rate.c")
SIZES = "512,4096,65536,1048576,4194304"
CONFIGS = [(1, 4), (4, 2)]           # (threads, streams per thread)
METHODS = ("driver", "gpucr")


def build(out_dir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise GpucrError("the alloc/free benchmark builds a small C worker: install a C compiler (cc or gcc)")
    exe = out_dir / "alloc_rate"
    r = subprocess.run([cc, "-O2", "-o", str(exe), str(SOURCE), "-ldl", "-lpthread"], capture_output=True, text=True)
    if r.returncode:
        raise GpucrError(f"building the benchmark worker failed: {r.stderr.strip()[:500]}")
    return exe


def run_once(exe: Path, method: str, threads: int, streams: int, pairs: int, window: int, sizes: str,
             simulate: bool) -> dict[str, Any]:
    env = run_env(simulate=simulate) if method == "gpucr" else plain_env(simulate)
    r = subprocess.run([str(exe), str(threads), str(streams), str(pairs), str(window), sizes], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise GpucrError(f"the {method} run failed: {(r.stderr or r.stdout).strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(exe: Path, simulate: bool, pairs: int, window: int, repeat: int, sizes: str = SIZES) -> list[dict[str, Any]]:
    """Per configuration, each method's best of `repeat` runs (interleaved, so drift hits both alike)."""
    rows = []
    for threads, streams in CONFIGS:
        best: dict[str, dict[str, Any]] = {}
        for _ in range(repeat):
            for m in METHODS:
                one = run_once(exe, m, threads, streams, max(1, pairs // threads), window, sizes, simulate)
                if m not in best or one["pairs_per_s"] > best[m]["pairs_per_s"]:
                    best[m] = one
        rows.append({"threads": threads, "streams": threads * streams, "window": window, "sizes": sizes,
                     "methods": best,
                     "gpucr_vs_driver": best["gpucr"]["pairs_per_s"] / best["driver"]["pairs_per_s"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpucr.bench.alloc_rate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true", help="on simcuda, the simulated driver (a test double)")
    ap.add_argument("--pairs", type=int, default=400000, help="alloc/free pairs per configuration (default 400000)")
    ap.add_argument("--window", type=int, default=8, help="live allocations kept per stream (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method, the best kept (default 3)")
    ap.add_argument("--out", default=None, metavar="JSON", help="results file (default gpucr-alloc-bench-DATE.json here)")
    a = ap.parse_args(argv)
    try:
        if a.pairs < 1 or a.window < 1 or a.repeat < 1:
            raise GpucrError("--pairs, --window and --repeat must be at least 1")
        drv = driver_for(str(simcuda_dir() / "libcuda.so.1") if a.simulate else "libcuda.so.1")
        with tempfile.TemporaryDirectory() as tmp:
            rows = measure(build(Path(tmp)), a.simulate, a.pairs, a.window, a.repeat)
    except (GpucrError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpucr: error: {exc}", file=sys.stderr)
        return 1
    now = dt.datetime.now(dt.timezone.utc)
    doc = {"schema": SCHEMA, "simulated": a.simulate, "warning": SIMULATED_BANNER if a.simulate else None,
           "date": now.isoformat(timespec="seconds"), **environment(drv, a.simulate),
           "settings": {"pairs": a.pairs, "window": a.window, "repeat": a.repeat, "release_threshold": "UINT64_MAX"},
           "results": rows}
    out = Path(a.out or f"gpucr-alloc-bench-{now:%Y-%m-%d}.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if a.simulate:
        print(SIMULATED_BANNER)
    for r in rows:
        d, g = r["methods"]["driver"], r["methods"]["gpucr"]
        print(f"{r['threads']} thread(s), {r['streams']} streams: driver {d['pairs_per_s']:,.0f} pairs/s, "
              f"gpucr {g['pairs_per_s']:,.0f} pairs/s ({r['gpucr_vs_driver']:.2f}x)")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
