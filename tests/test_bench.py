"""`gpucr bench` on simcuda (the simulated driver, a test double): a real run end to end, its JSON,
its chart and its Markdown table; and the LLM workloads' hand-written configs where transformers is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from gpucr import paths
from gpucr.bench import bounds as B
from gpucr.bench import methods as M
from gpucr.bench import rows as R
from gpucr.bench import specs as S
from gpucr.bench import report
from gpucr.driver import DriverError
from gpucr.results import ProcessCheckpoint
from gpucr.workloads import llm_app

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20
GIB_005 = int(0.05 * (1 << 30)) // 4 * 4       # what raw_app --gib 0.05 allocates
METHODS = tuple(m for m in M.DEFAULT_METHODS if m != "ceiling")   # a default run's rows: the ceiling is no row of its own
GPUCR = ("gpucr-full", "gpucr-data", "gpucr-server-full", "gpucr-server-data")   # those of them with a bound


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
        # the host memory its staging holds after the cycle: at least what it moved (the budget used)
        assert s["staging_bytes"] >= moved and ms[name]["median"]["staging_bytes"] == s["staging_bytes"], name
        assert ms[name]["warmup"]["staging_bytes"] >= moved, name
    for name, plane in (("gpucr-full", "cli"), ("gpucr-server-full", "server"), ("gpucr-server-data", "server")):
        assert ms[name]["samples"][0]["data_plane"] == {"checkpoint": plane, "restore": plane}, name
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
        assert s["staging_bytes"] is None, "no agent: no staging"
    sp = res["workloads"]["raw:0.05"]["speedups"]
    assert set(sp) == {f"{g}_vs_{d}" for g in ("gpucr-full", "gpucr-server-full") for d in ("driver", "driver-fresh")}
    assert all(v > 0 for d in sp.values() for v in d.values())


def test_each_gpucr_method_is_set_against_its_bound(bench_run):
    """Saved with the run: checkpoint and restore over max(bytes / the run's ceiling, control s)."""
    _, res, _, _ = bench_run
    w, c = res["workloads"]["raw:0.05"], res["ceiling"]
    ob = w["over_bound"]
    assert set(ob) == set(GPUCR), "the driver's methods have no bound of this kind"
    for name, r in ob.items():
        med = w["methods"][name]["median"]
        assert r["bound_out_s"] == pytest.approx(max(med["bytes_out"] / (c["d2h_gbps"] * 1e9), med["control_out_s"] or 0))
        assert r["bound_in_s"] == pytest.approx(max(med["bytes_in"] / (c["h2d_gbps"] * 1e9), med["control_in_s"] or 0))
        assert r["checkpoint"] == pytest.approx(med["checkpoint_s"] / r["bound_out_s"])
        assert r["restore"] == pytest.approx(med["restore_s"] / r["bound_in_s"])
    assert w["versus_peer"] == {}, "no peer in the run"


def test_chart_and_table(bench_run, tmp_path):
    pytest.importorskip("matplotlib")
    r, res, out, png = bench_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = subprocess.run([sys.executable, "-m", "gpucr.bench.report", str(out), "--chart", str(tmp_path / "c.png")],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout == report.markdown(res) + "\n"
    lines = table.stdout.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("| workload | method | checkpoint s |"))
    main_table = lines[head + 2:lines.index("", head)]   # issue 26's table of the gpucr rows follows it
    rows = [l for l in main_table if l.startswith("| raw:0.05 |")]
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
                       (["--repeat", "0"], "--repeat"), (["--gpu-util", "1.5"], "--gpu-util"),
                       (["--park", "nan"], "--park"), (["--park", "-1"], "--park")):
        r = gpucr_cli("bench", "--simulate", *args)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("gpucr: error: ") and what in lines[0], r.stderr


def test_a_parked_cycle_waits_between_its_checkpoint_and_its_restore():
    """--park S: the restore is asked S seconds after the checkpoint answered, and the GPU is read in between."""
    seen: list[tuple[str, float]] = []

    class Clocked(M.Method):
        name = "clocked"

        def checkpoint(self, pids):
            seen.append(("checkpoint", time.monotonic()))
            return {}

        def restore(self, pids):
            seen.append(("restore", time.monotonic()))
            return {}

    def read_used():
        seen.append(("read", time.monotonic()))
        return 7

    ck, rs, used = M.timed_cycle(Clocked(), [1], read_used, 0.3)
    assert used == 7 and [w for w, _ in seen] == ["checkpoint", "read", "restore"]
    assert seen[2][1] - seen[1][1] >= 0.3 and rs["wall_s"] < 0.3
    seen.clear()
    M.timed_cycle(Clocked(), [1], read_used)
    assert seen[2][1] - seen[1][1] < 0.1   # restored at once by default


def test_plain_env_has_no_agent_but_the_same_driver(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/other.so")
    env = S.plain_env(simulate=True)
    assert env["LD_PRELOAD"] == "/usr/lib/other.so"
    assert str(paths.simcuda_dir()) in env["LD_LIBRARY_PATH"]
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in S.plain_env(simulate=True)


def test_workload_names():
    assert S.parse_workload("raw:8", 0.5) == S.Spec("raw:8", "raw_app", ("--gib", "8.0"), False)
    s = S.parse_workload("qwen3-1.7b", 0.3)
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


class _Sysctl:
    """vm.nr_hugepages as the kernel keeps it: a write asks, and reads back what it could grant (here at most `cap`)."""

    def __init__(self, value: int, cap: int) -> None:
        self.value, self.cap, self.writable = value, cap, True

    def read_text(self) -> str:
        return f"{self.value}\n"

    def write_text(self, text: str) -> None:
        if not self.writable:
            raise PermissionError(13, "Permission denied")
        self.value = min(int(text), self.cap)


def test_hugepages_reserved_for_gpucrs_methods_and_given_back(monkeypatch):
    from gpucr.bench import run
    from gpucr.dataplane import hostmem
    sysctl = _Sysctl(100, cap=100 + 5120 + 1024 - 7)   # the kernel may grant fewer than asked
    monkeypatch.setattr(hostmem, "NR_HUGEPAGES", sysctl)
    with run.Hugepages(10 << 30) as h:
        assert sysctl.value == 100 + 5120 + 1024 - 7
        assert h.got == 5120 + 1024 - 7
    assert sysctl.value == 100, "the previous reservation is put back"
    sysctl.writable = False
    with pytest.raises(run.GpucrError, match="run the bench as root"):
        run.Hugepages(1 << 30).__enter__()


def test_results_are_saved_after_every_method():
    """A run cut short (the device tool's time limit did so once) keeps every method it finished."""
    from gpucr.bench import run
    from gpucr.driver import driver_for
    drv = driver_for(str(paths.simcuda_dir() / "libcuda.so.1"))
    spec = S.parse_workload("raw:0.05", 0.5)
    group = [M.make("driver", drv, True), M.make("driver-fresh", drv, True)]
    out: dict = {}
    seen: list[list[str]] = []
    run.run_group(spec, group, True, drv, None, 1, out, saved=lambda: seen.append(sorted(out)))
    assert seen == [["driver"], ["driver", "driver-fresh"]]


# ---- multi-GPU jobs: what can be checked without a GPU ----

def test_job_workload_names():
    s = S.parse_workload("tp2-llama3-8b", 0.3)
    assert (s.module, s.launch, s.world, s.gpus, s.nccl) == ("tp_app", "torchrun", 2, 2, True)
    assert s.args == ("--model", "llama3-8b", "--gpu-util", "0.3") and s.llm
    s = S.parse_workload("pp2-llama3-8b", 0.5)
    assert (s.module, s.launch, s.nccl) == ("pp_app", "torchrun", True)
    s = S.parse_workload("2gpu-llama3-8b", 0.5)
    assert (s.module, s.launch, s.world, s.gpus, s.nccl) == ("two_gpu_app", "single", 1, 2, False)
    with pytest.raises(M.GpucrError, match="Llama-architecture"):
        S.parse_workload("tp2-qwen3-1.7b", 0.5)
    with pytest.raises(M.GpucrError, match="unknown workload"):
        S.parse_workload("tp2-gpt5", 0.5)


def test_default_methods_for_jobs_and_their_own_processes():
    from gpucr.bench import run
    jobs = [S.parse_workload("tp2-llama3-8b", 0.5)]
    assert run.method_names(None, jobs) == list(M.JOB_METHODS)
    assert run.method_names(None, [S.parse_workload("raw:1", 0.5)]) == list(M.DEFAULT_METHODS)
    with pytest.raises(M.GpucrError, match="unknown method 'cuda-checkpoint'"):
        run.method_names("driver,cuda-checkpoint", jobs)
    drv = sim_driver()
    ms = [M.make(n, drv, True) for n in ("driver", "driver-nop2p", "gpucr-full", "gpucr-data")]
    assert [[m.name for m in g] for g in run._groups(ms)] == [["driver"], ["driver-nop2p"], ["gpucr-full", "gpucr-data"]]
    assert ms[1].job_env == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"} and not ms[1].under_agent


class FakeDriver:
    """The driver's checkpoint API as the two-GPU host answered for a NCCL job with P2P on:
    lock and checkpoint pass, restore fails with 801 (or never returns, when told to hang)."""
    path = "fake"

    def __init__(self, hang: threading.Event | None = None) -> None:
        self.hang, self.calls = hang, []

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.calls.append(("lock", pid))

    def checkpoint(self, pid: int) -> None:
        self.calls.append(("checkpoint", pid))

    def restore(self, pid: int) -> None:
        self.calls.append(("restore", pid))
        if self.hang is not None:
            self.hang.wait()
            return
        raise DriverError(f"driver restore of process {pid}", 801, "operation not supported")

    def unlock(self, pid: int) -> None:
        self.calls.append(("unlock", pid))


def test_driver_path_on_a_job_reports_failed_with_the_cuda_error():
    drv = FakeDriver()
    m = M.DriverMethod(drv, deadline=10)
    ck = m.checkpoint([11, 12])
    assert set(ck["steps_s"]) == {"lock", "checkpoint"}
    assert sorted(drv.calls) == [("checkpoint", 11), ("checkpoint", 12), ("lock", 11), ("lock", 12)]
    with pytest.raises(M.JobFailed) as e:
        m.restore([11, 12])
    assert e.value.outcome == "failed" and e.value.step == "restore"
    assert set(e.value.errors) == {11, 12} and all("CUDA error 801" in v for v in e.value.errors.values())
    assert "restore" in e.value.steps_s and ("unlock", 11) not in drv.calls, "no unlock after a failed restore"


def test_driver_path_on_a_job_reports_hung_at_the_deadline():
    release = threading.Event()
    m = M.DriverMethod(FakeDriver(hang=release), deadline=0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(M.JobFailed) as e:
            m.restore([21, 22])
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    assert e.value.outcome == "hung" and "process 21: no return within 0.3 s" in str(e.value)
    assert set(e.value.errors) == {21, 22} and "hung" in str(e.value)


def test_a_job_left_dead_by_the_driver_is_killed_and_started_again():
    """On simcuda: a method whose restore fails leaves its process checkpointed; the bench records
    'failed', kills that process and starts a new one for the next method, which then measures."""
    from gpucr.bench import run
    drv = sim_driver()

    class BrokenRestore(M.DriverMethod):
        name = "driver-broken"

        def act(self, action: str, pid: int) -> None:
            if action == "Restore":
                raise DriverError(f"driver restore of process {pid}", 801, "operation not supported")
            super().act(action, pid)
    out: dict = {}
    run.run_group(S.parse_workload("raw:0.05", 0.5), [BrokenRestore(drv, deadline=30), M.make("driver", drv, True)],
                  True, drv, None, 1, out)
    broken, ok = out["driver-broken"], out["driver"]
    assert broken["outcome"] == "failed" and broken["failed_step"] == "restore" and not broken["correct"]
    assert "801" in broken["error"] and broken["median"] is None
    assert ok["outcome"] == "ok" and ok["correct"] and ok["samples"][0]["correct"] == {"digest": True, "ptrs": True}
    first, second = broken["process"]["pid"], ok["process"]["pid"]
    assert first != second
    assert not os.path.exists(f"/proc/{first}") or "Z" in open(f"/proc/{first}/stat").read().rsplit(")", 1)[1][:3]


def test_job_results_are_shaped_per_job_and_per_gpu():
    def ck(pid: int, phases: dict, agent: dict, moved: int, left: int, warnings: list) -> ProcessCheckpoint:
        return ProcessCheckpoint(pid=pid, state="checkpointed", level="full", generation=1, bytes_moved=moved,
                                 bytes_left_to_driver=left, phases_s=phases, agent_phases_s=agent, gpus=[], image=None,
                                 warnings=warnings, data_plane="cli")
    rs = [ck(1, {"data_out": 1.0, "control_out": 0.5}, {"gate": 0.002, "staging": 0.0}, 10, 1, ["w1"]),
          ck(2, {"data_out": 1.5, "control_out": 0.25}, {"gate": 0.001, "staging": 0.003}, 20, 2, [])]
    c = R.combine(rs)
    assert c["steps_s"] == {"data_out": 1.5, "control_out": 0.5}         # ranks go through a phase together
    assert c["agent_ms"] == {"gate": 2.0, "staging": 3.0}
    assert (c["bytes_moved"], c["bytes_left_to_driver"], c["warnings"]) == (30, 3, ["w1"])
    assert c["data_plane"] == "cli"
    rs[1].data_plane = "server"
    assert M.combine(rs)["data_plane"] == "cli+server"
    gpucr_full = M.make("gpucr-full", sim_driver(), True)
    row = {"data_out_s": 2.0, "data_in_s": 4.0, "driver_out_s": None, "driver_in_s": None}
    g = R.per_gpu(row, gpucr_full, {"GPU-a": 8_000_000_000, "GPU-b": 4_000_000_000})
    assert g["gbps_out_per_gpu"] == {"GPU-a": 4.0, "GPU-b": 2.0} and g["gbps_in_per_gpu"] == {"GPU-a": 2.0, "GPU-b": 1.0}
    assert g["gbps_out_slowest_gpu"] == 2.0 and g["gbps_in_slowest_gpu"] == 1.0
    driver = M.make("driver", sim_driver(), True)
    g = R.per_gpu({"data_out_s": None, "data_in_s": None, "driver_out_s": 8.0, "driver_in_s": 2.0}, driver, {"GPU-a": 8e9})
    assert g["gbps_out_per_gpu"] == {"GPU-a": 1.0} and g["gbps_in_slowest_gpu"] == 4.0


def test_jobs_table_shows_outcomes_transports_and_speed():
    proc = {"bytes_per_gpu": {"GPU-a": 2 << 30, "GPU-b": 2 << 30}, "tokens_per_s": 41.5, "job_env": {}}
    res = {"ceiling_all_gpus": {"gpus": 2, "bytes_per_gpu": 8 << 30, "aggregate_d2h_gbps": 98.0, "aggregate_h2d_gbps": 108.0,
                                "per_gpu": [{"d2h_gbps": 49.0, "h2d_gbps": 54.0}] * 2},
           "workloads": {"tp2-llama3-8b": {"methods": {
               "driver": {"process": proc, "outcome": "failed", "failed_step": "restore", "error": "CUDA error 801",
                          "samples": [], "correct": False},
               "driver-nop2p": {"process": {**proc, "tokens_per_s": 20.0, "job_env": dict(S.NO_FAST_TRANSPORTS)},
                                "outcome": "hung", "failed_step": "restore", "error": "no return", "correct": False},
               "gpucr-full": {"process": proc, "outcome": "ok", "error": None, "correct": True,
                              "samples": [{"gbps_out_per_gpu": {"GPU-a": 47.0, "GPU-b": 46.0},
                                           "gbps_in_per_gpu": {"GPU-a": 50.0, "GPU-b": 51.0}}]}}}}}
    lines = report.jobs_table(res)
    text = "\n".join(lines)
    assert "98.0 GB/s, H2D 108.0 GB/s in all" in text
    rows = {l.split(" | ")[1]: l for l in lines if l.startswith("| tp2-llama3-8b |")}
    assert "failed at restore: CUDA error 801" in rows["driver"] and "default (P2P, SHM on)" in rows["driver"]
    assert "hung at restore" in rows["driver-nop2p"] and "P2P and SHM off" in rows["driver-nop2p"] and "| 20.0 |" in rows["driver-nop2p"]
    assert "| 47.0 / 46.0 | 50.0 / 51.0 |" in rows["gpucr-full"] and "| 41.5 | 2.00 / 2.00 |" in rows["gpucr-full"]


def test_ceiling_of_two_links_at_once_on_simcuda(monkeypatch):
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")
    c = B.ceiling_all(True, 0.02, 2)
    assert c["simulated"] and c["gpus"] == 2 and len(c["per_gpu"]) == 2
    assert all(g["d2h_gbps"] > 0 and g["h2d_gbps"] > 0 for g in c["per_gpu"])
    assert c["aggregate_d2h_gbps"] > 0 and c["aggregate_h2d_gbps"] > 0


def test_rank_answers_merge_with_every_error_named():
    from gpucr.workloads.ranks import merge
    m = merge([{"tokens": [1], "rank": 0}, {"error": "RuntimeError: boom", "rank": 1}])
    assert m["tokens"] == [1] and len(m["ranks"]) == 2 and m["error"] == "rank 1: RuntimeError: boom"
    assert "error" not in merge([{"a": 1}, {"a": 1, "error": None}])


def test_server_methods_report_their_first_cycle_and_log_apart(tmp_path):
    """gpucr-server-data's own first cycle (the server pinning) is reported apart from its samples, and the
    server's log is kept with each server method's results; the server-less gpucr-full has none."""
    (tmp_path / "rt").mkdir(mode=0o700)
    (tmp_path / "sim").mkdir(mode=0o700)
    env = dict(os.environ, GPUCR_RUNTIME_DIR=str(tmp_path / "rt"), SIMCUDA_DIR=str(tmp_path / "sim"),
               SIMCUDA_TOTAL_MEM=str(4 << 30))
    out = tmp_path / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.05", "--repeat", "1", "--methods",
                  "gpucr-server-full,gpucr-full,gpucr-server-data", "--out", str(out),
                  "--chart", str(tmp_path / "r.png"), env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    ms = next(iter(json.loads(out.read_text())["workloads"].values()))["methods"]
    full = ms["gpucr-server-full"]
    assert full["correct"] and "server_pin" in full["warmup"]["checkpoint"]["steps_s"], full["warmup"]
    assert "server_pin" not in full["samples"][0]["steps_s"]["checkpoint"], full["samples"][0]["steps_s"]
    # the server's own log is kept with the method's results, to read a slow cycle beside
    assert any("gpucr serve" in line and "serving uid" in line for line in full["server_log"]), full["server_log"]
    assert ms["gpucr-full"]["server_log"] is None, "no server, no log"
    assert any("serving uid" in line for line in ms["gpucr-server-data"]["server_log"]), "its own server, its own log"
    data = ms["gpucr-server-data"]
    assert data["correct"] and data["first_cycle"]["checkpoint_s"] > 0, data
    assert "handover" in data["samples"][0]["steps_s"]["checkpoint"], data["samples"][0]["steps_s"]


def test_server_methods_show_the_route_through_an_idle_neighbour(tmp_path):
    """On two GPUs joined by NVLink, gpucr-server-full also moves data through the idle one (routes_bytes in
    each sample, both ways) and gpucr-server-full-one-link (`gpucr serve --no-routes`) does not, in one run."""
    (tmp_path / "rt").mkdir(mode=0o700)
    (tmp_path / "sim").mkdir(mode=0o700)
    env = dict(os.environ, GPUCR_RUNTIME_DIR=str(tmp_path / "rt"), SIMCUDA_DIR=str(tmp_path / "sim"),
               SIMCUDA_TOTAL_MEM=str(4 << 30), SIMCUDA_DEVICES="2")
    out = tmp_path / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.2", "--repeat", "1", "--methods",
                  "gpucr-server-full,gpucr-server-full-one-link", "--out", str(out), "--chart", str(tmp_path / "r.png"),
                  env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    ms = next(iter(json.loads(out.read_text())["workloads"].values()))["methods"]
    routed, straight = ms["gpucr-server-full"], ms["gpucr-server-full-one-link"]
    assert routed["correct"] and straight["correct"], (routed, straight)
    rb = routed["samples"][0]["routes_bytes"]
    assert len(rb["checkpoint"]) == 1 and len(rb["restore"]) == 1, rb
    assert 0 < next(iter(rb["checkpoint"].values())) < routed["samples"][0]["bytes_out"], rb
    assert "routes_bytes" not in straight["samples"][0], straight["samples"][0]
    assert "one-link" in r.stdout


def test_a_bench_servers_log_never_blocks_it_and_is_read_once():
    """The bench's server logs to a file, not to a pipe nobody reads: 200 KiB (a 64 KiB pipe would block its
    writer) go through, and each read returns only what came since the last one."""
    import fcntl
    import stat
    from gpucr.bench.methods import _BenchServer
    srv = _BenchServer(True)
    st = os.fstat(srv._log_w.fileno())
    assert st.st_nlink == 0 and stat.S_IMODE(st.st_mode) == 0o600, "unlinked at once, private: no name to swap"
    assert fcntl.fcntl(srv._log_w.fileno(), fcntl.F_GETFL) & os.O_APPEND
    def child(code: str) -> None:
        subprocess.run([sys.executable, "-c", code], stderr=srv._log_w, timeout=30, check=True)
    child("import sys\nfor i in range(2000): print(f'line {i} ' + 'x' * 100, file=sys.stderr)")
    first = srv.log_since()
    assert len(first) == _BenchServer.LOG_LINES and first[-1].startswith("line 1999 "), first[-1][:20]
    child("import sys; print('after', file=sys.stderr)")
    assert srv.log_since() == ["after"] and srv.log_since() == []
