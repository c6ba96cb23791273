"""scripts/first_park.py (scripts/gpu-check first-park, issue 28 item 2's H200 check) run on simcuda as the H200 runs
it: a real `gpucr serve --prepare-staging`, the app started right after, parked at once, then later. The times on
simcuda say nothing of the H200's; what is checked is what the run must show there: the first park lent all its
staging from the pool and pinned nothing, within 2 s of the app's last allocation, its data intact."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_the_first_park_check_runs_and_records_what_the_h200_must_show(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "first_park.py"), "--simulate", "--later", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert "first park within 1.5x of a later one, 1 cases" in r.stdout, r.stdout + r.stderr
    (row,) = json.loads((tmp_path / "first-park.json").read_text())["cases"]
    assert "error" not in row, row
    assert row["pool_at_first_park"]["free_bytes"] == 128 << 20, row["pool_at_first_park"]
    first = row["first"]
    assert first["data_plane"] == "server" and first["staging_made_bytes"] == 0, first
    assert first["staging_lent_bytes"] >= first["bytes_moved"] == 64 << 20, first
    assert "server_pin" not in first["phases_s"], first["phases_s"]
    assert all(later["staging_lent_bytes"] == later["staging_made_bytes"] == 0 for later in row["later"]), row["later"]
    assert len(row["later_parks_s"]) == 2 and row["ratio"] > 0
    holds = row["holds"]
    assert holds["server_to_app_within_10_s"] and holds["park_within_2_s_of_last_allocation"] and holds["data_intact"]
    assert "lent 96 MiB of staging made ahead" in (tmp_path / "first-park-server.log").read_text()
