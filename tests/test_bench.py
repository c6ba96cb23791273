"""`gpucr bench` on simcuda (the simulated driver, a test double): a real run end to end, its JSON,
its chart and its Markdown table; and the LLM workloads' hand-written configs where transformers is."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpucr import paths
from gpucr.bench import methods as M
from gpucr.bench import report
from gpucr.workloads import llm_app

from conftest import gpucr_cli

MiB = 1 << 20
GIB_005 = int(0.05 * (1 << 30)) // 4 * 4       # what raw_app --gib 0.05 allocates
METHODS = ("driver", "driver-fresh", "gpucr-full", "gpucr-data")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One `gpucr bench --simulate` run, shared by the tests that read its output."""
    base = tmp_path_factory.mktemp("bench")
    (base / "rt").mkdir(mode=0o700)
    (base / "sim").mkdir(mode=0o700)
    env = dict(os.environ, GPUCR_RUNTIME_DIR=str(base / "rt"), SIMCUDA_DIR=str(base / "sim"),
               SIMCUDA_TOTAL_MEM=str(4 << 30))
    out, png = base / "r.json", base / "r.png"
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.05", "--repeat", "1", "--out", str(out),
                  "--chart", str(png), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text()), out, png


def test_simulated_run_says_so_everywhere(bench_run):
    r, res, _, _ = bench_run
    assert res["simulated"] is True and "NOT GPU results" in res["warning"]
    assert "SIMULATED" in r.stdout.splitlines()[0] and "SIMULATED" in r.stderr
    assert res["device"]["name"].startswith("simcuda")
    assert res["schema"] == "gpucr-bench/1"
    for k in ("date", "host", "device", "software", "settings"):
        assert res[k], k
    assert res["software"]["gpucr"]


def test_every_method_measured_and_correct(bench_run):
    _, res, _, _ = bench_run
    assert res["ceiling"]["d2h_gbps"] > 0 and res["ceiling"]["h2d_gbps"] > 0
    w = res["workloads"]["raw:0.05"]
    assert set(w["methods"]) == set(METHODS)
    for name, m in w["methods"].items():
        assert m["error"] is None and m["correct"] is True, name
        assert len(m["samples"]) == 1
        s, med = m["samples"][0], m["median"]
        assert s["correct"] == {"digest": True, "ptrs": True}
        assert s["checkpoint_s"] > 0 and s["restore_s"] > 0 and s["gbps_out"] > 0 and s["gbps_in"] > 0
        assert 0 < s["ceiling_share_out"] and 0 < s["ceiling_share_in"]
        assert med["checkpoint_s"] == s["checkpoint_s"]
        assert m["process"]["info"]["data_bytes"] == GIB_005


def test_bytes_and_memory_are_what_the_workload_holds(bench_run):
    _, res, _, _ = bench_run
    ms = res["workloads"]["raw:0.05"]["methods"]
    granule = 2 * MiB
    moved = -(-GIB_005 // granule) * granule          # the agent maps whole 2 MiB granules
    for name in ("gpucr-full", "gpucr-data"):
        s = ms[name]["samples"][0]
        assert s["bytes_out"] == s["bytes_in"] == moved, name
        assert s["bytes_left_to_driver"] == 0
        assert s["data_out_s"] > 0 and s["data_in_s"] > 0 and s["gate_sync_s"] >= 0
        assert ms[name]["warmup"]["correct"] == {"digest": True, "ptrs": True}
    full, data = ms["gpucr-full"]["samples"][0], ms["gpucr-data"]["samples"][0]
    assert full["control_out_s"] > 0 and full["control_in_s"] > 0
    assert data["control_out_s"] is None and data["control_in_s"] is None
    assert full["gpu_held_checkpointed_bytes"] == 0                 # simcuda's floor is zero
    assert data["gpu_held_checkpointed_bytes"] == 64 * MiB          # the context stays (SIMCUDA_CTX_BYTES)
    for name in ("driver", "driver-fresh"):
        s, proc = ms[name]["samples"][0], ms[name]["process"]
        # the driver moves the whole footprint: the buffer and the context
        assert s["bytes_out"] == proc["footprint_bytes"] == moved + 64 * MiB
        assert s["driver_out_s"] > 0 and s["data_out_s"] is None
        assert s["gpu_held_checkpointed_bytes"] == 0
        assert set(s["steps_s"]["checkpoint"]) == {"lock", "checkpoint"}
    sp = res["workloads"]["raw:0.05"]["speedups"]
    assert set(sp) == {"gpucr-full_vs_driver", "gpucr-full_vs_driver-fresh"}
    assert all(v > 0 for d in sp.values() for v in d.values())


def test_chart_and_table(bench_run, tmp_path):
    pytest.importorskip("matplotlib")
    r, res, out, png = bench_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = subprocess.run([sys.executable, "-m", "gpucr.bench.report", str(out), "--chart", str(tmp_path / "c.png")],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout == report.markdown(res) + "\n"
    rows = [l for l in table.stdout.splitlines() if l.startswith("| raw:0.05 |")]
    assert [l.split(" | ")[1] for l in rows] == list(METHODS)
    assert all(l.rstrip(" |").endswith("yes") for l in rows)
    assert table.stdout.startswith("**SIMULATED")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_report_merges_files_and_never_mixes_sim_with_gpu(bench_run, tmp_path):
    _, res, out, _ = bench_run
    other = json.loads(json.dumps(res))
    other["workloads"] = {"raw:9": other["workloads"]["raw:0.05"]}
    other["workloads"]["raw:9"]["methods"]["driver"] = {"error": "driver checkpoint failed", "correct": False}
    (tmp_path / "b.json").write_text(json.dumps(other))
    merged = report.load([out, tmp_path / "b.json"])
    assert set(merged["workloads"]) == {"raw:0.05", "raw:9"}
    md = report.markdown(merged)
    assert "| raw:9 | driver | failed: driver checkpoint failed |" in md
    other["simulated"] = False
    (tmp_path / "g.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="cannot be shown together"):
        report.load([out, tmp_path / "g.json"])


def test_bad_arguments_are_one_line_errors():
    for args, what in ((["--workloads", "raw:zero"], "unknown workload"), (["--methods", "criu"], "unknown method"),
                       (["--repeat", "0"], "--repeat"), (["--gpu-util", "1.5"], "--gpu-util")):
        r = gpucr_cli("bench", "--simulate", *args)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("gpucr: error: ") and what in lines[0], r.stderr


def test_plain_env_has_no_agent_but_the_same_driver(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/other.so")
    env = M.plain_env(simulate=True)
    assert env["LD_PRELOAD"] == "/usr/lib/other.so"
    assert str(paths.simcuda_dir()) in env["LD_LIBRARY_PATH"]
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in M.plain_env(simulate=True)


def test_workload_names():
    assert M.parse_workload("raw:8", 0.5) == M.Spec("raw:8", "raw_app", ("--gib", "8.0"), False)
    s = M.parse_workload("qwen3-1.7b", 0.3)
    assert s.llm and s.args == ("qwen3-1.7b", "--gpu-util", "0.3")


# parameters of the real models (their model cards / safetensors): the hand-written configs must match
PARAMS = {"llama3-8b": 8_030_261_248, "phi4-mini": 3_836_021_760, "pythia-1b": 1_011_781_632,
          "qwen3-1.7b": 1_720_574_976}


@pytest.mark.parametrize("name", sorted(llm_app.MODELS))
def test_llm_configs_are_the_real_architectures(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model = llm_app.build_model(llm_app.build_config(name), torch.device("meta"))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == PARAMS[name]
    assert all(p.dtype == torch.bfloat16 for p in params)


def test_hugepages_reserved_for_gpucrs_methods_and_given_back(tmp_path, monkeypatch):
    from gpucr.bench import run
    sysctl = tmp_path / "nr_hugepages"
    sysctl.write_text("100\n")
    monkeypatch.setattr(run, "HUGEPAGES_SYSCTL", sysctl)
    # the kernel may grant fewer than asked: what it granted is read back from /proc/meminfo's total
    monkeypatch.setattr(run, "meminfo", lambda: {"HugePages_Total": int(sysctl.read_text()) - 7})
    with run.Hugepages(10 << 30) as h:
        assert int(sysctl.read_text()) == 100 + 5120 + 1024
        assert h.got == 5120 + 1024 - 7
    assert sysctl.read_text() == "100", "the previous reservation is put back"
    sysctl.chmod(0o400)
    if os.geteuid() != 0:   # root writes through the mode bits
        with pytest.raises(run.GpucrError, match="run the bench as root"):
            run.Hugepages(1 << 30).__enter__()


def test_results_are_saved_after_every_method():
    """A run cut short (the device tool's time limit did so once) keeps every method it finished."""
    from gpucr.bench import run
    from gpucr.driver import driver_for
    drv = driver_for(str(paths.simcuda_dir() / "libcuda.so.1"))
    spec = M.parse_workload("raw:0.05", 0.5)
    group = [M.make("driver", drv, True), M.make("driver-fresh", drv, True)]
    out: dict = {}
    seen: list[list[str]] = []
    run.run_group(spec, group, True, drv, None, 1, out, saved=lambda: seen.append(sorted(out)))
    assert seen == [["driver"], ["driver", "driver-fresh"]]


def test_methods_with_other_agent_settings_get_a_process_of_their_own():
    from gpucr.bench import run
    from gpucr.driver import driver_for
    drv = driver_for(str(paths.simcuda_dir() / "libcuda.so.1"))
    ms = [M.make(n, drv, True) for n in ("driver", "gpucr-full", "gpucr-full-pinned", "gpucr-data", "driver-fresh",
                                         "gpucr-full-unpinned")]
    assert [[m.name for m in g] for g in run._groups(ms)] == [
        ["driver", "driver-fresh"], ["gpucr-full", "gpucr-data"], ["gpucr-full-pinned", "gpucr-full-unpinned"]]
    assert ms[2].agent_env == ms[5].agent_env == {"GPUCR_BOUNCE_MIB": "0"} and ms[1].agent_env == {}
