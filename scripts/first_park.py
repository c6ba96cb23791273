"""Issue 28 item 2's check (scripts/gpu-check first-park): for the first app after a server start, a park within 2 s
of the app's last allocation runs within 1.5x of a later park.

For each case, one after the other: `gpucr serve --prepare-staging POOL` is started, and the app right after its
first answer (at most 10 s after the start); once the app has made its memory and computed its digest (the digest's
temporaries are its last allocations), it is parked at once (a checkpoint through the server), restored and its
digest checked; then, once the pool has refilled, parked and restored LATER more times. Each park is timed from
outside, as a user's `gpucr checkpoint` would see it (the client warmed up first). Written to OUT/first-park.json:
each case's times, the first park's result (staging lent by the pool and made, its phases: no server_pin when all was
lent), the pool's state before it, and whether the three conditions hold. The server's log lines go to
OUT/first-park-server.log.

Cases: torch (default allocator), torch with expandable segments, CuPy, JAX (XLA_PYTHON_CLIENT_PREALLOCATE=false; its
pool grows by doubling regions, the largest 8 GiB for 12 GiB of arrays, and an allocation is placed whole in one
segment: its run sets the pool's and the app's segment to 8 GiB). --simulate: driver_app on simcuda (the CPU suite
runs it so, tests/test_first_park_check.py).

    python3 scripts/first_park.py [--simulate] [--cases torch,cupy] [--later 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import gpucr
from gpucr.server import client
from gpucr.workloads.runner import Workload

GiB = 1 << 30
# name: (workload module, its args, its environment, --prepare-staging, GPUCR_STAGING_SEGMENT_MIB or "")
CASES: dict[str, tuple[str, list[str], dict[str, str], str, str]] = {
    "torch": ("torch_app", ["--gib", "30"], {}, "48G", ""),
    "torch-expandable": ("torch_app", ["--gib", "30"], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "48G", ""),
    "cupy": ("cupy_app", ["--gib", "24"], {}, "40G", ""),
    "jax": ("jax_app", ["--gib", "6"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "40G", "8192"),
}
SIM_CASES: dict[str, tuple[str, list[str], dict[str, str], str, str]] = {
    "sim": ("driver_app", ["--sizes", "24M,24M,16M"], {}, "128M", "32"),
}
SERVER_TO_APP_S, LAST_ALLOC_TO_PARK_S, RATIO = 10.0, 2.0, 1.5


def wait_for(cond, timeout: float, what: str) -> float:
    """Seconds it took; RuntimeError past `timeout`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def pool_of(simulate: bool) -> dict:
    info = client.info(simulate) or {}
    return info.get("staging_pool") or {}


def settled(simulate: bool, quiet_s: float = 2.0, timeout: float = 120.0) -> float:
    """Seconds until the pool has refilled: full, or making nothing for quiet_s (the memory available bounds it)."""
    t0 = last_busy = time.monotonic()
    while True:
        p, now = pool_of(simulate), time.monotonic()
        if p.get("making_bytes", 1):
            last_busy = now
        if (p.get("free_bytes") == p.get("target_bytes") and not p.get("making_bytes")) or now - last_busy >= quiet_s:
            return now - t0
        if now - t0 > timeout:
            raise RuntimeError(f"the pool did not settle within {timeout:.0f} s: {p}")
        time.sleep(0.05)


def watch_pool(simulate: bool, t0: float, ready_at: list[float], stop: threading.Event) -> None:
    """Until `stop`: when the pool is first full (seconds after t0), into ready_at."""
    while not stop.wait(0.1) and not ready_at:
        p = pool_of(simulate)
        if p and p.get("free_bytes") == p.get("target_bytes") and not p.get("making_bytes"):
            ready_at.append(time.monotonic() - t0)


def timed_park(pid: int) -> tuple[float, gpucr.ProcessCheckpoint]:
    t0 = time.monotonic()
    ck = gpucr.checkpoint(pid)
    return time.monotonic() - t0, ck


def checkpoint_row(ck: gpucr.ProcessCheckpoint) -> dict:
    return {"data_plane": ck.data_plane, "bytes_moved": ck.bytes_moved, "staging_lent_bytes": ck.staging_lent_bytes,
            "staging_made_bytes": ck.staging_made_bytes, "phases_s": ck.phases_s}


def run_case(name: str, spec: tuple[str, list[str], dict[str, str], str, str], simulate: bool, later: int,
             log, hugepages: bool = False) -> dict:
    module, args, app_env, pool, segment = spec
    env = {**os.environ, **app_env, **({"GPUCR_STAGING_SEGMENT_MIB": segment} if segment else {})}
    row: dict = {"case": name, "module": module, "args": args, "env": app_env, "prepare_staging": pool,
                 "segment_mib": int(segment or 2048), "reserve_hugepages": hugepages}
    t_server = time.monotonic()
    srv = subprocess.Popen([sys.executable, "-m", "gpucr.cli", "serve", "--prepare-staging", pool]
                           + (["--simulate"] if simulate else []) + (["--reserve-hugepages"] if hugepages else []), env=env, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT)
    app = None
    try:
        row["server_answers_s"] = wait_for(lambda: client.info(simulate) is not None, 60, "the server to answer")
        ready_at: list[float] = []   # when the pool was first full, from the server's start
        parked = threading.Event()
        watcher = threading.Thread(target=watch_pool, args=(simulate, t_server, ready_at, parked), daemon=True)
        watcher.start()
        t_app = time.monotonic()
        row["server_to_app_s"] = t_app - t_server
        app = Workload(module, *args, simulate=simulate, env=env)
        row["app_ready_s"] = time.monotonic() - t_app
        before = app.ask("digest", timeout=300)
        t_last = time.monotonic()   # the digest's temporaries are the app's last allocations
        gpucr.status(app.pid)       # the client warmed up (its imports, the server's socket), as a later park finds it
        parked.set()
        watcher.join()
        row["pool_at_first_park"] = pool_of(simulate)
        row["pool_full_after_server_start_s"] = ready_at[0] if ready_at else None
        row["last_alloc_to_park_s"] = time.monotonic() - t_last
        first_s, ck = timed_park(app.pid)
        row["first_park_s"], row["first"] = first_s, checkpoint_row(ck)
        gpucr.restore(app.pid)
        digests = [app.ask("digest", timeout=300) == before]
        row["pool_refill_s"] = settled(simulate)   # later parks measured with no refill beside them
        row["later_parks_s"], row["later"] = [], []
        for _ in range(later):
            s, ck = timed_park(app.pid)
            row["later_parks_s"].append(s)
            row["later"].append(checkpoint_row(ck))
            gpucr.restore(app.pid)
        digests.append(app.ask("digest", timeout=300) == before)
        row["digests_equal"] = all(digests)
        row["pool_at_end"] = pool_of(simulate)
    except Exception as exc:   # noqa: BLE001 - one case failing is said in its row; the next case still runs
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if app is not None:
            app.close()
        srv.terminate()
        srv.wait(timeout=60)
    later_s = row.get("later_parks_s") or []
    if "first_park_s" in row and later_s:
        median = statistics.median(later_s)
        row["later_median_s"], row["ratio"] = median, row["first_park_s"] / median
        row["holds"] = {"server_to_app_within_10_s": row["server_to_app_s"] <= SERVER_TO_APP_S,
                        "park_within_2_s_of_last_allocation": row["last_alloc_to_park_s"] <= LAST_ALLOC_TO_PARK_S,
                        "first_within_1.5x_later": row["ratio"] <= RATIO, "data_intact": row["digests_equal"]}
        row["ok"] = all(row["holds"].values())
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true", help="on simcuda, with driver_app")
    ap.add_argument("--cases", help="a comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--later", type=int, default=3, help="parks after the first (default 3)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--reserve-hugepages", action="store_true", help="each server reserves its pool in hugepages "
                    "(gpucr serve --reserve-hugepages; root)")
    a = ap.parse_args()
    cases = SIM_CASES if a.simulate else CASES
    names = a.cases.split(",") if a.cases else list(cases)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "first-park-server.log", "ab") as log:
        for name in names:
            row = run_case(name, cases[name], a.simulate, a.later, log, a.reserve_hugepages)
            print(json.dumps({k: v for k, v in row.items() if k not in ("first", "later", "pool_at_end")}), flush=True)
            rows.append(row)
            (out / "first-park.json").write_text(json.dumps({"simulated": a.simulate, "cases": rows}, indent=1))
    ok = all(r.get("ok") for r in rows)
    print(f"first park within {RATIO}x of a later one, {len(rows)} cases: {'all hold' if ok else 'NOT all hold'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
