"""The commands that start something or hand over to another part of gpucr: run (execs the application under the
agent), lib, serve (the gpucr server), demo, bench and doctor."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from .. import paths, server_view, service_http
from ..sizes import pool_target
from ..errors import GpucrError
from ..server import route
from .args import say_retired_env
from .text import print_json


def _check_driver_loads() -> None:
    """Before the application starts: without a loadable driver it would only crash on its own, later."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GpucrError(f"no CUDA driver can be loaded here ({exc}): install the NVIDIA driver, or add --simulate "
                         "to run on simcuda, the simulated driver (a test double)") from None


def cmd_run(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        raise GpucrError("nothing to run: give a command after '--', e.g. gpucr run -- python3 app.py")
    if not a.simulate:
        _check_driver_loads()
    env = paths.run_env(simulate=a.simulate)
    if a.staging:
        env["GPUCR_STAGING"] = a.staging
    if a.staging_policy:
        env["GPUCR_STAGING_POLICY"] = a.staging_policy
    if a.group:
        env["GPUCR_GROUP"] = a.group
    if a.host_budget:
        env["GPUCR_HOST_BUDGET"] = a.host_budget
    if a.swap and not route.server_wanted():
        raise GpucrError("--swap needs the gpucr server: drop --no-server (and GPUCR_NO_SERVER=1)")
    if route.server_wanted():
        from ..server import client
        problem = client.ensure_running(a.simulate)
        if problem and a.swap:
            raise GpucrError(f"--swap needs the gpucr server: {problem}")
        if problem:
            route.note(problem)
    if a.swap:
        server_view.register_swap(a, cmd, env)
    say_retired_env(env)
    if a.simulate:
        print("gpucr: running on simcuda, the simulated driver (a test double; no GPU is used)", file=sys.stderr)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        raise GpucrError(f"cannot run {cmd[0]}: {exc.strerror}") from exc


def cmd_lib(a: argparse.Namespace) -> int:
    print(paths.simcuda_dir() / "libcuda.so.1" if a.simulate else paths.agent_lib())
    return 0


def _not_running(simulated: bool) -> str:
    """`gpucr serve --status` with no server of this driver kind: said, with the other kind's where one runs."""
    from ..server import client
    if client.info(not simulated) is None:
        return "server: not running"
    return ("server: not running (a server on the system's driver runs: leave out --simulate)" if simulated else
            "server: not running (a server on simcuda runs: add --simulate)")


def cmd_serve(a: argparse.Namespace) -> int:
    from ..driver import controller_simulated
    from ..server import client, foreground
    simulated = controller_simulated()   # --simulate, or GPUCR_SIMULATE=1 (gpucr.cli sets it for --simulate)
    if a.stop:
        pid = client.stop(simulated)
        print("no gpucr server runs" if pid is None else f"gpucr server (pid {pid}) stopped")
        return 0
    if a.status:
        info = client.info(simulated)
        if a.json:
            print_json({"running": True, **info} if info else {"running": False, "simulated": simulated})
        else:
            print("\n".join(server_view.service_lines(info)) if info else _not_running(simulated))
        return 0 if info else 3
    if a.show_http:
        return _show_http(client.info(simulated))
    if pool_target(a.prepare_staging or "")[0] and a.give_back_context:
        raise GpucrError("--prepare-staging pins staging in the server's context, which --give-back-context gives "
                         "back after each request: use one of them", code=2)
    if a.reserve_hugepages and not _prepares_a_size(a.prepare_staging or ""):
        raise GpucrError("--reserve-hugepages reserves --prepare-staging's size: give one, e.g. --prepare-staging 48G",
                         code=2)
    if a.reserve_hugepages and os.geteuid() != 0:
        raise GpucrError("--reserve-hugepages writes /proc/sys/vm/nr_hugepages, which needs root: run gpucr serve as "
                         "root, or reserve them yourself (docs/server.md)", code=2)
    missing = service_http.missing()
    if missing and a.http:
        raise GpucrError(f"--http: {missing}")
    if missing:
        route.note(f"{missing}; serving without it")
    return foreground.main(a.idle_exit, keep_context=not a.give_back_context, host_budget=a.host_budget,
                           park_dir=a.park_dir, routes=not a.no_routes, face=None if missing else service_http.face(a.http),
                           prepare_staging=a.prepare_staging or "", reserve_hugepages=a.reserve_hugepages,
                           skip_unchanged=a.skip_unchanged)


def _prepares_a_size(setting: str) -> bool:
    prepare, target = pool_target(setting)
    return prepare and target is not None


def _show_http(info: dict | None) -> int:
    """Where the server's HTTP API listens, as shell assignments (docs/api.md's curl examples use them)."""
    if info is None:
        raise GpucrError("no gpucr server runs: start one with 'gpucr serve'", code=3)
    http = info.get("http") or {}
    if not http:
        raise GpucrError(f"the gpucr server (pid {info['pid']}) serves no HTTP API (its log says why); install "
                         f"gpucr's service extra ({service_http.EXTRA_HINT}) and restart it")
    lines = {"GPUCR_SOCK": http["socket"]}
    if http.get("url"):
        token = Path(http["token_file"]).read_text().strip()
        lines.update({"GPUCR_URL": http["url"], "GPUCR_TOKEN_FILE": http["token_file"],
                      "GPUCR_PAGE": f"{http['url']}/#token={token}"})
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in lines.items()))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .. import demo
    return demo.main(simulate=a.simulate, as_json=a.json)


def cmd_bench(a: argparse.Namespace) -> int:
    if getattr(a, "scenario", None) == "swap":
        from ..bench import swap_scenario
        return swap_scenario.main(a)
    from ..bench import run
    return run.main(a)


def cmd_doctor(a: argparse.Namespace) -> int:
    from .. import doctor
    return doctor.main(as_json=a.json)
