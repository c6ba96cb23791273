"""The alloc/free microbenchmark beside `gpucr bench`, on simcuda: both methods run the same C worker, the
driver's pools without the agent and gpucr's under it, and the results file is ready for bench/results/."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_alloc_rate_compares_the_drivers_pools_with_gpucrs(tmp_path):
    out = tmp_path / "alloc.json"
    r = subprocess.run([sys.executable, "-m", "gpucr.bench.alloc_rate", "--simulate", "--pairs", "4000", "--repeat", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "NOT GPU results" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "gpucr-alloc-bench/1" and doc["simulated"] and "NOT GPU results" in doc["warning"]
    assert [(row["threads"], row["streams"]) for row in doc["results"]] == [(1, 4), (4, 8)]
    for row in doc["results"]:
        d, g = row["methods"]["driver"], row["methods"]["gpucr"]
        assert not d["agent"] and g["agent"], "the driver's pools ran bare, gpucr's under the agent"
        assert d["pairs"] == g["pairs"] >= 4000 - row["threads"] and d["pairs_per_s"] > 0 and g["pairs_per_s"] > 0
        assert row["gpucr_vs_driver"] == pytest.approx(g["pairs_per_s"] / d["pairs_per_s"])


def test_bad_arguments_are_one_line():
    r = subprocess.run([sys.executable, "-m", "gpucr.bench.alloc_rate", "--simulate", "--pairs", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "gpucr: error: --pairs, --window and --repeat must be at least 1"
