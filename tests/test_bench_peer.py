"""The bench's peer, torch_memory_saver (`--methods torch-memory-saver`), as far as a host without a
GPU can check it: listed, skipped with one reason (on simcuda, or where the package cannot be
imported), its workload importable without torch and failing only at use, and its cycles turned
into the same rows, comparisons and table as gpucr's. The run itself is a GPU test
(`scripts/gpu-check bench`, its header says how)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from gpucr.bench import methods as M
from gpucr.bench import rows as R
from gpucr.bench import specs as S
from gpucr.bench import compare, report, run

from conftest import gpucr_cli, sim_driver

GiB = 1 << 30
PEER = "torch-memory-saver"
HAVE_TMS = importlib.util.find_spec("torch_memory_saver") is not None


def test_peer_is_a_method_of_its_own_process():
    assert PEER in M.METHODS and PEER not in M.DEFAULT_METHODS
    m = M.make(PEER, sim_driver(), simulate=True)
    assert isinstance(m, M.TmsMethod) and m.in_app and not m.under_agent and m.own_job
    assert isinstance(m.warmup(), M.TmsMethod), "its first pause pins the CPU backup: a warm-up of its own"
    # never shares a process with the driver's methods, which also run without the agent
    ms = [M.make(n, sim_driver(), True) for n in ("driver", PEER, "gpucr-full", "driver-fresh")]
    assert [[x.name for x in g] for g in run._groups(ms)] == [["driver", "driver-fresh"], [PEER], ["gpucr-full"]]
    r = gpucr_cli("bench", "--help")
    assert PEER in r.stdout


def test_bad_method_name_is_still_one_line_naming_the_peer():
    r = gpucr_cli("bench", "--simulate", "--methods", "gpucr-full,torch_memory_saver")
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("gpucr: error: unknown method 'torch_memory_saver'") and PEER in lines[0]


def test_simulated_run_records_the_skip_and_its_reason(tmp_path):
    out = tmp_path / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.05", "--repeat", "1",
                  "--methods", f"gpucr-data,{PEER}", "--out", str(out), "--chart", str(tmp_path / "r.png"), timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    ms = res["workloads"]["raw:0.05"]["methods"]
    assert ms[PEER] == {"skipped": "needs torch and torch_memory_saver on a real GPU", "correct": True, "error": None}
    assert ms["gpucr-data"]["correct"] is True, "the rest of the run goes on"
    said = [l for l in r.stderr.splitlines() if PEER in l]
    assert said == [f"gpucr bench: raw:0.05: {PEER} skipped: needs torch and torch_memory_saver on a real GPU"]
    assert f"- raw:0.05: {PEER} skipped: needs torch and torch_memory_saver on a real GPU" in r.stdout
    assert res["workloads"]["raw:0.05"]["versus_peer"] == {}


@pytest.mark.skipif(HAVE_TMS, reason="needs a host where torch_memory_saver cannot be imported")
def test_without_the_package_the_reason_is_the_import_error():
    m = M.TmsMethod(simulate=False)
    reason = m.unavailable(S.parse_workload("raw:30", 0.5))
    assert reason.startswith("torch_memory_saver cannot be used here (ModuleNotFoundError: No module named ")
    assert m.unavailable(S.parse_workload("llama3-8b", 0.5)) == reason, "probed once a run"
    with pytest.raises(M.GpucrError, match="cannot be used here"):
        m.workload(S.parse_workload("raw:30", 0.5))


def test_only_single_gpu_workloads():
    m = M.TmsMethod(simulate=False)
    assert m.unavailable(S.parse_workload("tp2-llama3-8b", 0.5)) == \
        "runs on the single-GPU workloads only (raw:GIB and the LLM servers)"
    assert m.probed is None, "a job is turned down before anything is probed"


def test_workload_imports_without_torch_and_fails_only_at_use():
    from gpucr.workloads import tms_app
    assert tms_app.APPS == ("raw_app", "llm_app")
    usage = subprocess.run([sys.executable, "-m", "gpucr.workloads.tms_app"], capture_output=True, text=True)
    assert usage.returncode == 1 and "usage:" in usage.stderr
    if importlib.util.find_spec("torch") is None:
        with pytest.raises(ImportError, match="torch"):
            tms_app.Saver()
        r = subprocess.run([sys.executable, "-m", "gpucr.workloads.tms_app", "raw_app", "--gib", "0.01"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "No module named" in r.stderr and r.stdout == ""


def test_the_peer_workload_is_the_benchs_own_app_in_a_region():
    m = M.TmsMethod(simulate=False)
    m.probed = {"preload": "/opt/tms/torch_memory_saver_hook_mode_preload_cu12.abi3.so", "version": "0.0.10"}
    module, args, env = m.workload(S.parse_workload("llama3-8b", 0.3))
    assert (module, args) == ("tms_app", ["llm_app", "llama3-8b", "--gpu-util", "0.3"])
    assert env["LD_PRELOAD"].split(":")[0] == m.probed["preload"]
    from gpucr.workloads import llm_app, raw_app
    assert llm_app.parser().parse_args(args[1:]).gpu_util == 0.3
    assert raw_app.parser().parse_args(m.workload(S.parse_workload("raw:30", 0.5))[1][1:]).gib == 30.0


def _cycle(pause_s: float, resume_s: float, wall: float, nbytes: int) -> tuple[dict, dict]:
    return ({"steps_s": {"pause": pause_s}, "bytes_moved": nbytes, "wall_s": wall},
            {"steps_s": {"resume": resume_s}, "bytes_moved": nbytes, "wall_s": wall})


def test_peer_rows_rate_the_region_on_the_in_app_times():
    m = M.TmsMethod(simulate=False)
    ck, rs = _cycle(0.6, 0.5, 0.7, 30 * GiB)
    row = R.metrics(m, ck, rs, footprint=31 * GiB, ceiling={"d2h_gbps": 55.0, "h2d_gbps": 55.0})
    assert row["app_out_s"] == 0.6 and row["app_in_s"] == 0.5 and row["checkpoint_s"] == 0.7
    assert row["bytes_out"] == row["bytes_in"] == 30 * GiB, "the region's bytes, not the footprint"
    assert row["gbps_out"] == pytest.approx(30 * GiB / 0.6 / 1e9) and row["gbps_in"] == pytest.approx(30 * GiB / 0.5 / 1e9)
    assert row["ceiling_share_out"] == pytest.approx(row["gbps_out"] / 55.0)
    assert row["data_out_s"] is None and row["driver_out_s"] is None and row["control_out_s"] is None
    g = R.per_gpu(row, m, {"GPU-a": 30 * GiB})
    assert g["gbps_out_per_gpu"]["GPU-a"] == pytest.approx(row["gbps_out"])
    assert R.medians([row])["app_in_s"] == 0.5


def test_gpucr_against_the_peer_and_the_table():
    peer = {"checkpoint_s": 0.8, "restore_s": 0.7, "gbps_out": 50.0, "gbps_in": 52.0, "app_out_s": 0.6, "app_in_s": 0.5}
    data = {"checkpoint_s": 0.7, "restore_s": 0.75, "gbps_out": 55.0, "gbps_in": 39.0}
    full = {"checkpoint_s": 0.88, "restore_s": 1.4}
    by = {PEER: {"median": peer}, "gpucr-data": {"median": data}, "gpucr-full": {"median": full}}
    v = compare.versus_peer(by)
    assert v["gpucr-data_gbps_over_peer"] == pytest.approx({"out": 1.1, "in": 0.75})
    assert v["gpucr-full_time_over_peer"] == pytest.approx({"checkpoint": 1.1, "restore": 2.0})
    assert compare.versus_peer({PEER: {"skipped": "why"}, "gpucr-data": {"median": data}}) == {}
    keys = ("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s", "driver_out_s", "driver_in_s",
            "bytes_out", "bytes_in", "ceiling_share_out", "ceiling_share_in", "gpu_held_checkpointed_bytes")
    med = {**dict.fromkeys(keys), **peer, "bytes_out": 30 * GiB, "gpu_held_checkpointed_bytes": GiB // 2}
    res = {"workloads": {"raw:30": {"methods": {PEER: {"median": med, "correct": True, "error": None}},
                                    "versus_peer": v}}}
    md = report.markdown(res)
    row = next(l for l in md.splitlines() if l.startswith(f"| raw:30 | {PEER} |"))
    # the in-app pause and resume stand in the data columns
    assert row.split(" | ")[5] == "0.600" and row.split(" | ")[8] == "0.500" and "| 30.00 |" in row and "| 0.50 |" in row
    assert "raw:30: gpucr-data GB/s 1.10x (out) / 0.75x (in) torch-memory-saver's" in md
    assert "raw:30: gpucr-full checkpoint / restore time 1.10x / 2.00x torch-memory-saver's pause / resume" in md


def test_server_methods_against_the_peer():
    """Runs with only server methods (say the park run) compare with the peer too, each under its own name."""
    peer = {"checkpoint_s": 1.4592, "restore_s": 1.4445, "gbps_out": 50.96, "gbps_in": 51.50}
    by = {PEER: {"median": peer},
          "gpucr-server-full": {"median": {"checkpoint_s": 1.4921, "restore_s": 1.4607}},
          "gpucr-server-full-ahead": {"median": {"checkpoint_s": 2.9184, "restore_s": 1.4445}},
          "gpucr-server-full-one-link": {"error": "failed", "correct": False},
          "gpucr-server-data": {"median": {"checkpoint_s": 1.0, "restore_s": 1.0, "gbps_out": 56.056, "gbps_in": 25.75}},
          "driver": {"median": {"checkpoint_s": 9.0, "restore_s": 9.0, "gbps_out": 10.0, "gbps_in": 10.0}}}
    v = compare.versus_peer(by)
    assert set(v) == {"gpucr-server-full_time_over_peer", "gpucr-server-full-ahead_time_over_peer",
                      "gpucr-server-data_gbps_over_peer"}, "the driver is no gpucr method; a failed one has no median"
    assert v["gpucr-server-full_time_over_peer"] == pytest.approx({"checkpoint": 1.4921 / 1.4592, "restore": 1.4607 / 1.4445})
    assert v["gpucr-server-full-ahead_time_over_peer"] == pytest.approx({"checkpoint": 2.0, "restore": 1.0})
    assert v["gpucr-server-data_gbps_over_peer"] == pytest.approx({"out": 1.1, "in": 0.5})
    md = report.markdown({"workloads": {"llama3-8b": {"methods": {}, "versus_peer": v}}})
    assert "llama3-8b: gpucr-server-full-ahead checkpoint / restore time 2.00x / 1.00x torch-memory-saver's pause / resume" in md
    assert "llama3-8b: gpucr-server-data GB/s 1.10x (out) / 0.50x (in) torch-memory-saver's" in md
    assert compare.versus_peer({k: m for k, m in by.items() if k != PEER}) == {}, "no peer, nothing to compare"
