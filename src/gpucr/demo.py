"""`gpucr demo`: run a workload, checkpoint it, show the GPU memory given back, restore it, and
check that every byte, every address and the next computation are what they were; then the same
through `gpucr serve`, whose data plane copies the data while the driver checkpoints."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from . import coordinator
from .driver import Driver, driver_for, gpu_memory
from .errors import GpucrError
from .paths import simcuda_dir
from .results import SCHEMA_VERSION, to_json
from .dataplane.cli_plane import cli_plane
from .workloads.runner import Workload


def gpu_present() -> bool:
    """An NVIDIA GPU answers through NVML and PyTorch is importable (no CUDA context is created)."""
    from .driver import _nvml_memory
    return _nvml_memory(0) is not None and importlib.util.find_spec("torch") is not None


def _used(drv: Driver) -> int | None:
    m = gpu_memory(drv)
    return m.used if m else None


def _through_the_server(app: Workload, simulated: bool, say) -> dict[str, Any] | None:
    """The same cycle through `gpucr serve`, whose data plane copies the data while the driver checkpoints
    (docs/server.md): started for the demo when none runs, and stopped after. None when it cannot start."""
    from .server import client, route
    if not route.server_wanted():
        return None
    ours = client.info(simulated) is None
    problem = client.ensure_running(simulated)
    if problem:
        say(f"  (not through the server: {problem})")
        return None
    try:
        before = app.ask("digest")
        out: dict[str, Any] = {}
        for name in ("first", "second"):   # the first pins the staging in the server
            ck = route.checkpoint(app.pid, level="full")
            rs = route.restore(app.pid)
            out[name] = {"checkpoint": to_json(ck), "restore": to_json(rs)}
        say("  through gpucr serve (it copies the data while the driver checkpoints): second cycle "
            + ", ".join(f"{k} {v:.3f} s" for k, v in ck.phases_s.items()) + "; "
            + ", ".join(f"{k} {v:.3f} s" for k, v in rs.phases_s.items()))
        out["identical"] = app.ask("digest") == before
        return out
    finally:
        if ours:
            client.stop(simulated)


def main(simulate: bool = False, as_json: bool = False) -> int:
    real = not simulate and gpu_present()
    say = (lambda *a: None) if as_json else (lambda *a: print(*a, flush=True))
    if real:
        drv = driver_for("libcuda.so.1")
        say("gpucr demo on the GPU: a PyTorch process with 2 GiB of tensors (its caching allocator keeps more "
            "reserved once it has computed their digests)")
        module, args = "torch_app", ["--gib", "2"]
    else:
        os.environ["GPUCR_SIMULATE"] = "1"   # the controller acts through simcuda only when told so
        drv = driver_for(str(simcuda_dir() / "libcuda.so.1"))
        say("gpucr demo on simcuda, the SIMULATED driver (a test double over host memory): no GPU was found "
            "or --simulate was given, so no GPU result is shown here")
        module, args = "driver_app", ["--sizes", "64M,16M,3M,100K", "--pitch", "--vmm-mib", "32"]
    fig: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "command": "demo", "simulated": not real, "workload": module}
    fig["gpu_used_before_start_bytes"] = _used(drv)
    with Workload(module, *args, simulate=not real) as app:
        before = app.ask("digest")
        result_before = app.ask("compute") if real else None
        fig["gpu_used_running_bytes"] = _used(drv)
        say(f"  started pid {app.pid}; GPU memory used: {fig['gpu_used_before_start_bytes'] / 2**20:,.0f} MiB before it, "
            f"{fig['gpu_used_running_bytes'] / 2**20:,.0f} MiB with it")
        with cli_plane() as mover:   # in this process, with the same data plane as the server's
            ck = coordinator.checkpoint_many([app.pid], level="full", mover=mover).processes[0]
        fig["gpu_used_checkpointed_bytes"] = _used(drv)
        fig["checkpoint"] = to_json(ck)
        say(f"  checkpointed: {ck.bytes_moved / 2**20:,.0f} MiB moved by gpucr; GPU memory used now "
            f"{fig['gpu_used_checkpointed_bytes'] / 2**20:,.0f} MiB; "
            + ", ".join(f"{k} {v:.3f} s" for k, v in ck.phases_s.items()))
        with cli_plane() as mover:
            rs = coordinator.restore_many([app.pid], mover=mover).processes[0]
        fig["restore"] = to_json(rs)
        fig["gpu_used_restored_bytes"] = _used(drv)
        after = app.ask("digest")
        result_after = app.ask("compute") if real else None
        if not real:
            app.ask("work 7")   # the application carries on: its next kernels run on the restored memory
            app.ask("work -7")
            result_after = result_before = {"digest_after_work": app.ask("digest")["digest"] == before["digest"]}
        say(f"  restored: GPU memory used {fig['gpu_used_restored_bytes'] / 2**20:,.0f} MiB; "
            + ", ".join(f"{k} {v:.3f} s" for k, v in rs.phases_s.items()))
        served = _through_the_server(app, not real, say)
        if served is not None:
            fig["through_server"] = served
    checks = {"bytes_identical": before["digest"] == after["digest"],
              "addresses_identical": before["ptrs"] == after["ptrs"],
              "next_computation_identical": result_before == result_after}
    if served is not None:
        checks["through_server_identical"] = served.pop("identical")
    fig["checks"] = checks
    ok = all(checks.values())
    for k, v in checks.items():
        say(f"  {k.replace('_', ' ')}: {'yes' if v else 'NO'}")
    say("demo passed" if ok else "demo FAILED")
    if as_json:
        print(json.dumps(fig, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GpucrError as exc:
        print(f"gpucr: error: {exc}", file=sys.stderr)
        sys.exit(1)
