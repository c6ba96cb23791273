"""The bench's workloads and methods of issue 25 on simcuda (the simulated driver, a test double): a
group of independent processes and a pair sharing memory checkpointed as one, images set against the
disk's rate measured in the same run, a restore with --map, the CLI without a server timed step by
step, and the plane that moved each row's data."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from gpucr.bench import compare, report
from gpucr.bench import rows as R
from gpucr.bench import specs as S

from conftest import gpucr_cli

PAIRS = ("shared:0.03", "group2-raw:0.03")
GPU_ONLY = {"torch-expandable:1": "torch runs on a GPU only", "jax:1": "JAX runs on a GPU only",
            "group2-llama3-8b": "LLM workloads need a GPU"}
METHODS = ("gpucr-cli", "gpucr-server-image", "gpucr-server-map")


@pytest.fixture(scope="module")
def planes_run(tmp_path_factory):
    """One `gpucr bench --simulate` run of the new workloads and methods, on a simulated machine of two GPUs."""
    base = tmp_path_factory.mktemp("planes")
    for d in ("rt", "sim", "img"):
        (base / d).mkdir(mode=0o700)
    env = dict(os.environ, GPUCR_RUNTIME_DIR=str(base / "rt"), SIMCUDA_DIR=str(base / "sim"),
               SIMCUDA_TOTAL_MEM=str(4 << 30), SIMCUDA_DEVICES="2")
    out = base / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", ",".join(PAIRS + tuple(GPU_ONLY)), "--methods",
                  "ceiling," + ",".join(METHODS), "--repeat", "1", "--image-dir", str(base / "img"),
                  "--out", str(out), "--chart", str(base / "r.png"), env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text()), base / "img"


def test_workload_names():
    g = S.parse_workload("group2-llama3-8b", 0.25)
    assert (g.module, g.launch, g.world, g.gpus, g.llm) == ("llm_app", "copies", 2, 1, True)
    assert g.args == ("llama3-8b", "--gpu-util", "0.25") and g.group == "bench-group2-llama3-8b"
    r = S.parse_workload("group3-raw:8", 0.5)
    assert (r.module, r.launch, r.world, r.gib, r.needs_gpu) == ("raw_app", "copies", 3, 24.0, None)
    s = S.parse_workload("shared:4", 0.5)
    assert (s.module, s.launch, s.world, s.gpus, s.gib, s.group) == ("shared_app", "ranks", 2, 1, 4.0, "bench-shared:4")
    t = S.parse_workload("torch-expandable:30", 0.5)
    assert (t.module, t.args, dict(t.env)) == ("torch_app", ("--gib", "30.0"), {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert S.parse_workload("torch:30", 0.5).env == () and S.parse_workload("jax:21.5", 0.5).module == "jax_app"
    assert S.parse_workload("raw:8", 0.5).group is None, "one process: no group"
    for bad, said in (("group9-raw:1", "group2-W to group8-W"), ("groupx-raw:1", "group2-W"),
                      ("group2-tp2-llama3-8b", "single-process workload"), ("group2-shared:1", "single-process workload"),
                      ("shared:0", "unknown workload"), ("jax:many", "unknown workload")):
        with pytest.raises(S.GpucrError, match=said):
            S.parse_workload(bad, 0.5)


def test_gpu_only_workloads_are_skipped_on_simcuda_with_their_reason(planes_run):
    r, res, _ = planes_run
    assert res["settings"]["skipped_why"] == GPU_ONLY
    assert set(res["workloads"]) == set(PAIRS)
    for name, why in GPU_ONLY.items():
        assert any(name in line and why in line for line in r.stderr.splitlines()), (name, r.stderr)


def test_groups_and_pairs_are_checkpointed_as_one_and_come_back_the_same(planes_run):
    _, res, _ = planes_run
    for wname in PAIRS:
        for mname in METHODS:
            m = res["workloads"][wname]["methods"][mname]
            assert m["error"] is None and m["correct"] is True, (wname, mname, m.get("error"))
            assert len(m["process"]["pids"]) == 2, "both processes in every checkpoint"
            s = m["samples"][0]
            assert s["correct"] == {"digest": True, "ptrs": True}
            assert "data_plane" in m and set(s["data_plane"]) == {"checkpoint", "restore"}
    pair = res["workloads"]["shared:0.03"]["methods"]["gpucr-server-map"]
    assert [r["role"] for r in pair["process"]["info"]["ranks"]] == ["exporter", "importer"]
    shared = int(0.03 * (1 << 30)) // (2 << 20) * (2 << 20)
    assert pair["samples"][0]["bytes_out"] == shared, "the shared memory is moved once, from its exporter"
    group = res["workloads"]["group2-raw:0.03"]["methods"]["gpucr-server-map"]["samples"][0]
    assert group["bytes_out"] == 2 * -(-int(0.03 * (1 << 30)) // (2 << 20)) * (2 << 20), "both processes' data"


def test_cli_without_a_server_is_timed_step_by_step(planes_run):
    _, res, _ = planes_run
    for wname in PAIRS:
        s = res["workloads"][wname]["methods"]["gpucr-cli"]["samples"][0]
        assert s["data_out_s"] > 0 and s["control_out_s"] > 0 and s["data_in_s"] > 0 and s["control_in_s"] > 0
        assert {"vet", "data_out", "control_out"} <= set(s["steps_s"]["checkpoint"])
        assert s["checkpoint_s"] > s["data_out_s"], "the whole command, its interpreter and cuInit included"


def test_images_are_set_against_the_disk_measured_in_the_run(planes_run):
    _, res, img_dir = planes_run
    assert list(img_dir.iterdir()) == [], "every image and the disk's test file are removed"
    for wname in PAIRS:
        w = res["workloads"][wname]
        med, disk = w["methods"]["gpucr-server-image"]["median"], w["disk"]
        assert med["image_bytes"] == med["bytes_out"] and med["image_out_s"] > 0 and med["image_in_s"] > 0
        assert disk["dir"] == str(img_dir) and disk["bytes"] == -(-med["image_bytes"] // 4096) * 4096
        assert disk["write_gbps"] > 0 and disk["read_gbps"] > 0
        ob = w["over_bound"]["gpucr-server-image"]
        assert ob["disk_out_s"] == pytest.approx(med["image_bytes"] / (disk["write_gbps"] * 1e9))
        assert ob["disk_in_s"] == pytest.approx(med["image_bytes"] / (disk["read_gbps"] * 1e9))
        assert ob["bound_out_s"] >= ob["disk_out_s"] and ob["checkpoint"] == pytest.approx(med["checkpoint_s"] / ob["bound_out_s"])
        assert "disk_out_s" not in w["over_bound"]["gpucr-server-map"], "no image: the disk is no bound"


def test_map_restore_names_every_gpu_onto_itself(planes_run):
    _, res, _ = planes_run
    gmap = res["workloads"]["shared:0.03"]["methods"]["gpucr-server-map"]["samples"][0]["gpu_map"]
    assert len(gmap) == 2 and all(k == v and k.startswith("GPU-") for k, v in gmap.items())


def test_report_shows_the_disk_each_bound_and_the_plane(planes_run):
    _, res, _ = planes_run
    md = report.markdown(res).splitlines()
    head = next(line for line in md if line.startswith("| workload |"))
    assert head.endswith("| x bound (ckpt / restore) | data plane | correct |")
    row = next(line for line in md if line.startswith("| shared:0.03 | gpucr-server-image |"))
    ob = res["workloads"]["shared:0.03"]["over_bound"]["gpucr-server-image"]
    assert f"| {ob['checkpoint']:.2f}x / {ob['restore']:.2f}x |" in row and row.endswith("| yes |")
    disk = [line for line in md if "disk under" in line]
    assert len(disk) == 2 and all("write + fsync" in line and "gpucr-server-image's image written at" in line for line in disk)
    assert any("image bytes / disk" in line for line in md)


def test_the_plane_is_read_from_each_result():
    def said(*planes):
        return [SimpleNamespace(data_plane=p) for p in planes]
    assert R.data_plane(said("server", "server")) == "server"
    assert R.data_plane(said("server", "cli")) == "server+cli"
    assert R.data_plane([SimpleNamespace(), SimpleNamespace()]) is None, "results that do not say"
    assert report._plane({"checkpoint": "server", "restore": "server"}) == "server"
    assert report._plane({"checkpoint": "server", "restore": None}) == "server / –"
    assert report._plane(None) == "–"


def test_image_dir_that_is_not_a_directory_is_one_line(tmp_path):
    r = gpucr_cli("bench", "--simulate", "--workloads", "raw:0.01", "--methods", "gpucr-server-image",
                  "--image-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.json"))
    lines = [line for line in r.stderr.splitlines() if line.strip() and "SIMULATED" not in line]
    assert r.returncode != 0 and lines == [f"gpucr: error: --image-dir {tmp_path / 'nowhere'}: not a directory; "
                                           "give an existing one on the disk the images should go to"]


def test_disk_bound_in_over_bound():
    """27 GiB at 1.5 GB/s: the disk, not the link, bounds an image's checkpoint and restore."""
    med = {**dict.fromkeys(R.SUMMARY_KEYS), "checkpoint_s": 20.0, "restore_s": 19.0, "bytes_out": 29e9,
           "bytes_in": 29e9, "image_bytes": 29e9, "control_out_s": 0.3, "control_in_s": 0.3}
    ob = compare.over_bound({"gpucr-server-image": {"median": med}}, {"d2h_gbps": 55.0, "h2d_gbps": 53.0},
                        {"write_gbps": 1.5, "read_gbps": 1.6})["gpucr-server-image"]
    assert ob["bound_out_s"] == pytest.approx(29 / 1.5) and ob["bound_in_s"] == pytest.approx(29 / 1.6)
    assert ob["checkpoint"] == pytest.approx(20.0 / (29 / 1.5)) and ob["restore"] == pytest.approx(19.0 / (29 / 1.6))


def test_chart_draws_every_workload(planes_run):
    pytest.importorskip("matplotlib")
    _, _, img_dir = planes_run
    png = img_dir.parent / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
