"""A plain C program linked against libcuda (no Python, no runtime): both ways it reaches the driver
(the exported symbol and cuGetProcAddress) are caught, and its memory is checkpointed and restored."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import gpucr
from gpucr import paths

SRC = Path(__file__).parent / "apps" / "plain_app.c"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_plain_c_program(tmp_path):
    exe = tmp_path / "plain_app"
    sim = paths.simcuda_dir()
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(SRC), f"-L{sim}", "-l:libcuda.so.1", f"-Wl,-rpath,{sim}"],
                   check=True)
    p = subprocess.Popen([str(exe)], env=paths.run_env(simulate=True), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        ready = p.stdout.readline().split()
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
