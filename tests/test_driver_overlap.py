"""scripts/driver_overlap.py (scripts/gpu-check driver-overlap, issue 28's question: does the driver checkpoint one
process while it restores another?) run on simcuda as the GPU runs it. Its times say nothing of a GPU's; what is
checked is that each round leaves both processes as it found them and that its spans add up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_the_driver_overlap_probe_times_both_steps_alone_and_together_and_puts_both_back(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "driver_overlap.py"), "--simulate", "--workload",
                        "driver_app", "--rounds", "2"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "A out beside B in:" in r.stdout, r.stdout
    got = json.loads((tmp_path / "driver-overlap.json").read_text())
    assert got["simulated"] and len(got["rounds"]) == 2
    for rnd in got["rounds"]:
        (o0, o1), (i0, i1) = rnd["out_span"], rnd["in_span"]
        assert 0 <= o0 < o1 and 0 <= i0 < i1
        assert rnd["together_s"] >= max(o1 - o0, i1 - i0) - 1e-9
        assert rnd["overlap_s"] <= min(o1 - o0, i1 - i0) + 1e-9
    assert isinstance(got["medians"]["serialised"], bool)
    for rnd in got["rounds"]:   # what a switch runs beside A's checkpoint, each timed and each under way
        for what in ("copies", "makes"):
            assert rnd[f"out_beside_{what}_s"] > 0 and rnd[f"{what}_done"] >= 1, rnd
    assert "A out beside copies:" in r.stdout and "A out beside makes:" in r.stdout, r.stdout
