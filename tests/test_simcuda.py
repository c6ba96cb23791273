"""simcuda, the simulated driver (a test double), has its own C test suite: run it here so CI keeps it honest."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_simcuda_native_suite():
    r = subprocess.run(["sh", str(ROOT / "native/simcuda/tests/run.sh")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all simcuda tests passed" in r.stdout
