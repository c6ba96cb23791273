"""A plain C program linked against libcuda (no Python, no runtime): both ways it reaches the driver
(the exported symbol and cuGetProcAddress) are caught, and its memory is checkpointed and restored; the
same beside another tool preloaded into it (compute-sanitizer's injection, a profiler, a tracer), whose
hooks find the real functions through dlsym(RTLD_NEXT), which the agent answers."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import gpucr
from gpucr import paths

APPS = Path(__file__).parent / "apps"
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def plain_app(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("plain") / "plain_app"
    sim = paths.simcuda_dir()
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(APPS / "plain_app.c"), f"-L{sim}", "-l:libcuda.so.1",
                    f"-Wl,-rpath,{sim}"], check=True)
    return exe


def run_and_cycle(exe: Path, preload: str | None = None) -> None:
    """Start the program under the agent (LD_PRELOAD `preload` instead when given), check the agent caught
    both allocations, checkpoint and restore it, and check its buffers."""
    env = paths.run_env(simulate=True)
    if preload is not None:
        env["LD_PRELOAD"] = preload
    p = subprocess.Popen([str(exe)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        ready = p.stdout.readline().split()
        if not ready:   # its stdout closed: it ended
            pytest.fail(f"the program ended (exit {p.wait(10)}) before it was ready: {p.stderr.read()[-600:]}")
        assert ready[0] == "READY", ready
        st = gpucr.status(p.pid)
        assert st.allocations.converted == 2, "both allocations, symbol and cuGetProcAddress, were caught"
        ck = gpucr.checkpoint(p.pid)
        assert ck.bytes_moved == 16 << 20
        gpucr.restore(p.pid)
        p.stdin.write("check\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "OK"
    finally:
        p.kill()
        p.wait()


def test_plain_c_program(plain_app):
    run_and_cycle(plain_app)


@pytest.mark.parametrize("order", ["agent-first", "tool-first"])
def test_a_tool_that_wraps_dlopen_runs_beside_the_agent(plain_app, tmp_path, order):
    """Without the fix the program recursed through the tool's dlopen and our dlsym until it crashed."""
    tool = tmp_path / "libtool_hooks.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(tool), str(APPS / "tool_hooks.c"), "-ldl"], check=True)
    agent = str(paths.agent_lib())
    run_and_cycle(plain_app, f"{agent}:{tool}" if order == "agent-first" else f"{tool}:{agent}")
