"""The bench's derived comparisons: each method's times over its bound, max(bytes / ceiling, the
driver's control time), of the same run (issue 13: within 1.15x), how the report says them, and
`python3 -m gpucr.bench.report FILE --recompute` adding them to files written before they existed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpucr.bench import rows as R
from gpucr.bench import compare, report

PEER = "torch-memory-saver"
CEILING = {"d2h_gbps": 55.0, "h2d_gbps": 50.0}


def _med(ck: float, rs: float, nbytes: float | None, control_out: float | None = None,
         control_in: float | None = None) -> dict:
    """A median as the bench writes it (every key the table reads), with the ones a bound needs."""
    return {**dict.fromkeys(R.SUMMARY_KEYS), "checkpoint_s": ck, "restore_s": rs, "bytes_out": nbytes,
            "bytes_in": nbytes, "control_out_s": control_out, "control_in_s": control_in}


def test_the_bound_is_bytes_over_the_ceiling():
    ob = compare.over_bound({"gpucr-server-full": {"median": _med(2.236, 2.46, 111.9e9, 0.6, 0.65)}}, CEILING)
    r = ob["gpucr-server-full"]
    assert r["bound_out_s"] == pytest.approx(2.0345, abs=1e-4)   # 111.9e9 B at 55 GB/s
    assert r["bound_in_s"] == pytest.approx(2.238)                # at 50 GB/s
    assert r["checkpoint"] == pytest.approx(1.099, abs=1e-3) and r["restore"] == pytest.approx(2.46 / 2.238)


def test_a_longer_control_time_is_the_bound():
    # 5.5e9 B take 0.1 s at 55 GB/s, but the driver's control state takes 0.4 s: the data cannot help it
    r = compare.over_bound({"gpucr-full": {"median": _med(0.5, 0.3, 5.5e9, 0.4, 0.05)}}, CEILING)["gpucr-full"]
    assert r["bound_out_s"] == pytest.approx(0.4) and r["checkpoint"] == pytest.approx(1.25)
    assert r["bound_in_s"] == pytest.approx(0.11) and r["restore"] == pytest.approx(0.3 / 0.11)


def test_which_methods_get_a_bound():
    by = {"gpucr-data": {"median": _med(1.1, 1.0, 55e9)},              # control None: bytes alone
          PEER: {"median": _med(1.05, 1.2, 55e9)},
          "driver": {"median": _med(3.0, 3.0, 60e9)},                  # not gpucr's: no bound
          "gpucr-server-full": {"median": _med(1.0, 1.0, None, 0.5, 0.5)},   # no bytes: left out
          "gpucr-full": {"skipped": "why", "correct": True, "error": None}}
    ob = compare.over_bound(by, CEILING)
    assert list(ob) == ["gpucr-data", PEER]
    assert ob["gpucr-data"] == pytest.approx({"checkpoint": 1.1, "restore": 1.0 / 1.1, "bound_out_s": 1.0, "bound_in_s": 1.1})
    assert ob[PEER] == pytest.approx({"checkpoint": 1.05, "restore": 1.2 / 1.1, "bound_out_s": 1.0, "bound_in_s": 1.1})
    assert compare.over_bound(by, None) == {}, "no ceiling measured: no bound"


def test_every_full_level_gpucr_method_is_set_against_the_driver():
    """The speed-up over the driver's own path (issue 13: at least 20x / 8x), for each gpucr method that moves
    the whole process (in process or through the server), none for the data level, which leaves the
    context on the GPU, and none where a side failed."""
    by = {"driver": {"median": _med(35.5, 14.1, 70e9)}, "driver-fresh": {"median": _med(34.0, 13.0, 70e9)},
          "gpucr-server-full": {"median": _med(1.42, 1.41, 69e9)}, "gpucr-full": {"median": _med(2.0, 2.2, 69e9)},
          "gpucr-server-data": {"median": _med(1.4, 1.4, 69e9)},
          "gpucr-server-full-ahead": {"median": _med(1.45, None, 69e9)}}
    sp = compare.speedups(by)
    assert set(sp) == {f"{g}_vs_{d}" for g in ("gpucr-server-full", "gpucr-full") for d in ("driver", "driver-fresh")}
    assert sp["gpucr-server-full_vs_driver"] == pytest.approx({"checkpoint": 35.5 / 1.42, "restore": 14.1 / 1.41})
    assert compare.speedups({k: v for k, v in by.items() if not k.startswith("driver")}) == {}


def test_a_job_is_bound_by_every_link_at_once():
    res = {"ceiling": CEILING, "ceiling_all_gpus": {"aggregate_d2h_gbps": 110.0, "aggregate_h2d_gbps": 100.0},
           "workloads": {"tp2-llama3-8b": {"methods": {"gpucr-full": {"median": _med(1.1, 1.2, 110e9)}}},
                         "llama3-8b": {"methods": {"gpucr-full": {"median": _med(1.1, 1.2, 55e9)}}}}}
    compare.derive_all(res)
    job, one = res["workloads"]["tp2-llama3-8b"]["over_bound"]["gpucr-full"], res["workloads"]["llama3-8b"]["over_bound"]["gpucr-full"]
    assert job["bound_out_s"] == pytest.approx(1.0) and job["bound_in_s"] == pytest.approx(1.1)
    assert one["bound_out_s"] == pytest.approx(1.0) and one["bound_in_s"] == pytest.approx(1.1)


def test_report_says_each_bound():
    ob = {"gpucr-server-full": {"checkpoint": 1.0991, "restore": 1.0812, "bound_out_s": 111.9 / 55, "bound_in_s": 2.0348},
          PEER: {"checkpoint": 1.077, "restore": 1.063, "bound_out_s": 1.3549, "bound_in_s": 1.3591}}
    md = report.markdown({"workloads": {"llama3-8b": {"methods": {}, "over_bound": ob}}})
    assert ("- llama3-8b: gpucr-server-full checkpoint / restore 1.10x / 1.08x its bound "
            "(max(bytes / ceiling, control) = 2.035 / 2.035 s)") in md.splitlines()
    assert ("- llama3-8b: torch-memory-saver checkpoint / restore 1.08x / 1.06x its bound "
            "(bytes / ceiling = 1.355 / 1.359 s)") in md.splitlines()
    assert "its bound" not in report.markdown({"workloads": {"llama3-8b": {"methods": {}}}}), "older files lack it"


def _old_results() -> dict:
    """A results file as runs before over_bound wrote it: versus_peer left empty for a server method."""
    return {"schema": "gpucr-bench/1", "simulated": False, "date": "2026-12-01T22:25:07+00:00",
            "settings": {"repeat": 3}, "ceiling": {"bytes": 8 << 30, "d2h_gbps": 55.0, "h2d_gbps": 50.0},
            "workloads": {"llama3-8b": {
                "module": "llm_app", "args": ["llama3-8b", "--gpu-util", "0.5"],
                "methods": {"gpucr-server-full": {"median": _med(2.236, 2.46, 111.9e9, 0.6, 0.65), "correct": True,
                                                  "error": None, "samples": [{"checkpoint_s": 2.236}]},
                            PEER: {"median": _med(2.2, 2.4, 111.9e9), "correct": True, "error": None}},
                "speedups": {}, "versus_peer": {}}}}


def test_recompute_rewrites_the_file_with_the_new_keys_only(tmp_path):
    f = tmp_path / "old.json"
    old = _old_results()
    f.write_text(json.dumps(old, indent=1))   # as committed: indent 1, no final newline
    r = subprocess.run([sys.executable, "-m", "gpucr.bench.report", str(f), "--recompute"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    new = json.loads(f.read_text())
    w = new["workloads"]["llama3-8b"]
    assert list(w["versus_peer"]) == ["gpucr-server-full_time_over_peer"]
    assert w["versus_peer"]["gpucr-server-full_time_over_peer"] == pytest.approx({"checkpoint": 2.236 / 2.2,
                                                                                  "restore": 2.46 / 2.4})
    assert w["over_bound"]["gpucr-server-full"]["bound_out_s"] == pytest.approx(2.0345, abs=1e-4)
    assert w["over_bound"]["gpucr-server-full"]["checkpoint"] == pytest.approx(1.099, abs=1e-3)
    assert w["over_bound"][PEER]["restore"] == pytest.approx(2.4 / 2.238)
    # everything else as it was, the file's layout included
    for k in ("versus_peer", "over_bound"):
        del w[k]
    del old["workloads"]["llama3-8b"]["versus_peer"]
    assert new == old
    assert not f.read_text().endswith("\n") and f.read_text().splitlines()[1] == ' "schema": "gpucr-bench/1",'
    assert "- llama3-8b: gpucr-server-full checkpoint / restore 1.10x / 1.10x its bound " \
           "(max(bytes / ceiling, control) = 2.035 / 2.238 s)" in r.stdout.splitlines()
    assert not (tmp_path / "old.json.tmp").exists()


def test_without_recompute_the_file_is_only_read(tmp_path):
    f = tmp_path / "old.json"
    f.write_text(json.dumps(_old_results(), indent=2) + "\n")
    before = f.read_text()
    assert report.main([str(f)]) == 0
    assert f.read_text() == before


@pytest.mark.parametrize("text, said", [
    ("[1, 2]", "not a gpucr bench results file (no 'workloads' object)"),
    ("nope", "not JSON"),
    ('{"workloads": {"x": {"methods": {"gpucr-full": {"median": "fast"}}}}}', "a method of workload 'x' is not an object"),
    ('{"workloads": {"x": []}}', "workload 'x' has no 'methods' object"),
])
def test_a_file_that_is_not_bench_results_is_refused_in_one_line_and_left_alone(tmp_path, text, said):
    f = tmp_path / "r.json"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "gpucr.bench.report", str(f), "--recompute"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and said in r.stderr and str(f) in r.stderr, r.stderr
    assert f.read_text() == text, "nothing rewritten"


def test_no_bar_of_the_chart_is_taller_than_its_time():
    """Parts one after the other are stacked (the in-process agent: data, then the driver's control);
    parts side by side (the server copies while the driver works) are drawn beside each other, not
    stacked to data + control; what is left of the time is 'other'."""
    after = report.bar_parts({"checkpoint_s": 1.3, "data_out_s": 0.8, "control_out_s": 0.45}, report.OUT_PARTS,
                             "checkpoint_s")
    flat = lambda parts, *keys: [getattr(p, k) for p in parts for k in keys]
    assert flat(after, "bottom", "height", "width") == pytest.approx([0, 0.8, 0.8, 0.8, 0.45, 0.8, 1.25, 0.05, 0.8])
    beside = report.bar_parts({"checkpoint_s": 0.624, "data_out_s": 0.579, "control_out_s": 0.401}, report.OUT_PARTS,
                              "checkpoint_s")
    assert flat(beside, "dx", "bottom", "height", "width") == pytest.approx(
        [0, 0, 0.579, 0.8, 0.25, 0, 0.401, 0.3, 0, 0.579, 0.045, 0.8])
    for parts, time in ((after, 1.3), (beside, 0.624)):
        assert max(p.bottom + p.height for p in parts) == pytest.approx(time)
    peer = report.bar_parts({"restore_s": 0.553, "app_in_s": 0.552}, report.IN_PARTS, "restore_s")
    assert [p.colour for p in peer] == [report.PEER_COLOUR, report.REST[1]]
