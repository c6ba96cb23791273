"""Issue 26's bench on simcuda (the simulated driver, a test double): one `gpucr bench` run sets the server's full path
(zero chunks skipped, the restore checked) beside the same with both parts off (gpucr-server-plain, checkpoint
--no-scan), on raw buffers whose first share is all zero: zero bytes are skipped only by the default method, the
bytes over the link follow the non-zero bytes, the plain method moves all, and every restore is byte-exact."""
from __future__ import annotations

import json
import os

import pytest

from gpucr.bench import compare, report
from gpucr.bench import rows as R
from gpucr.bench import specs as S
from gpucr.workloads.raw_app import zero_head

from conftest import gpucr_cli

GIB = 0.0625   # 64 MiB: 32 chunks of 2 MiB
SHARES = (0.25, 0.75)
WORKLOADS = tuple(f"raw:{GIB}@zero={f}" for f in SHARES)
FULL, PLAIN = "gpucr-server-full", "gpucr-server-plain"


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("zero")
    for d in ("rt", "sim"):
        (base / d).mkdir(mode=0o700)
    env = dict(os.environ, GPUCR_RUNTIME_DIR=str(base / "rt"), SIMCUDA_DIR=str(base / "sim"), SIMCUDA_TOTAL_MEM=str(2 << 30))
    out = base / "r.json"
    r = gpucr_cli("bench", "--simulate", "--workloads", ",".join(WORKLOADS), "--methods", f"ceiling,{FULL},{PLAIN}",
                  "--repeat", "2", "--out", str(out), "--chart", str(base / "r.png"), env=env, timeout=400)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def _zero_bytes(share: float) -> int:
    return zero_head(int(GIB * (1 << 30)) // 4 * 4, share)


def test_contents_in_the_workload_name():
    s = S.parse_workload("llama3-8b@served", 0.5)
    assert (s.name, s.module, s.args, s.needs_gpu) == ("llama3-8b@served", "llm_app",
                                                        ("llama3-8b", "--gpu-util", "0.5", "--kv", "served"), S.LLM_NEEDS)
    assert S.parse_workload("llama3-8b@zeros", 0.5).args[-2:] == ("--kv", "zeros")
    r = S.parse_workload("raw:8@zero=0.75", 0.5)
    assert (r.module, r.args, r.gib) == ("raw_app", ("--gib", "8.0", "--zero-fraction", "0.75"), 8.0)
    g = S.parse_workload("group2-llama3-8b@zeros", 0.25)
    assert (g.launch, g.world, g.args[-1]) == ("copies", 2, "zeros")
    for bad in ("tp2-llama3-8b@zeros", "raw:1@zero=1.5", "raw:1@zeros", "llama3-8b@zero=0.5", "llama3-8b@half"):
        with pytest.raises(S.GpucrError, match="contents are given as"):
            S.parse_workload(bad, 0.5)


def test_zero_head_is_whole_chunks():
    assert zero_head(64 << 20, 0.25) == 16 << 20
    assert zero_head(64 << 20, 0.2) == 12 << 20, "12.8 MiB rounded down to whole 2 MiB chunks"
    assert zero_head(64 << 20, 0) == 0 and zero_head(64 << 20, 1) == 64 << 20


def test_only_the_default_method_skips_zero_chunks(zero_run):
    for wname, share in zip(WORKLOADS, SHARES):
        zero = _zero_bytes(share)
        for mname in (FULL, PLAIN):
            m = zero_run["workloads"][wname]["methods"][mname]
            assert m["error"] is None and m["correct"] is True, (wname, mname, m.get("error"))
            assert all(all(s["correct"].values()) for s in m["samples"]), "digests equal after every restore"
            for s in m["samples"]:
                full = mname == FULL
                assert s["scanned"] is full and s["checked"] is full, (mname, s)
                assert s["bytes_scanned"] == (s["bytes_out"] if full else 0)
                # the timed cycles come after the method's first: the server knows the staging holds those zeros
                assert s["bytes_zero_skipped"] == (zero if full else 0), (wname, mname)
                assert s["bytes_zeroed"] == (zero if full else 0), (wname, mname)
                assert s["bytes_over_link_out"] == s["bytes_out"] - (zero if full else 0)
                assert s["bytes_over_link_in"] == s["bytes_in"] - (zero if full else 0)
                if full:
                    assert s["check_s"] > 0 and 0 < s["check_share"] < 1 and s["scan_s"] > 0
                else:
                    assert s["check_s"] is None and s["check_share"] is None and s["scan_s"] is None
            assert m["median"]["scanned"] is (mname == FULL) and m["median"]["checked"] is (mname == FULL)


def test_bytes_over_the_link_follow_the_non_zero_bytes(zero_run):
    over = {}
    for wname, share in zip(WORKLOADS, SHARES):
        w = zero_run["workloads"][wname]
        full, plain = (w["methods"][n]["median"] for n in (FULL, PLAIN))
        nonzero = full["bytes_out"] - _zero_bytes(share)
        over[share] = full["bytes_over_link_out"]
        assert full["bytes_over_link_out"] == full["bytes_over_link_in"] == nonzero
        assert plain["bytes_over_link_out"] == plain["bytes_out"] == full["bytes_out"], "the plain method moves all"
        ob = w["over_bound"]
        ceiling = zero_run["ceiling"]
        for name, med in ((FULL, full), (PLAIN, plain)):
            b = ob[name]
            assert b["nonzero_bytes"] == nonzero, "one bound for both: the workload's non-zero bytes"
            assert b["nonzero_bound_out_s"] == pytest.approx(max(nonzero / (ceiling["d2h_gbps"] * 1e9), med["control_out_s"]))
            assert b["nonzero_bound_in_s"] == pytest.approx(max(nonzero / (ceiling["h2d_gbps"] * 1e9), med["control_in_s"]))
            assert b["checkpoint_nonzero"] == pytest.approx(med["checkpoint_s"] / b["nonzero_bound_out_s"])
            assert b["restore_nonzero"] == pytest.approx(med["restore_s"] / b["nonzero_bound_in_s"])
    assert over[0.25] - over[0.75] == _zero_bytes(0.75) - _zero_bytes(0.25), "half the buffer more zero: that much less"


def test_report_shows_issue_26s_table(zero_run):
    md = report.markdown(zero_run).splitlines()
    head = next(i for i, line in enumerate(md) if line.startswith("| workload | method | zero scan | check |"))
    rows = [line for line in md[head + 2:] if line.startswith("| raw:")]
    assert len(rows) == 4
    full = next(r for r in rows if r.startswith(f"| {WORKLOADS[1]} | {FULL} |"))
    plain = next(r for r in rows if r.startswith(f"| {WORKLOADS[1]} | {PLAIN} |"))
    med = zero_run["workloads"][WORKLOADS[1]]["methods"][FULL]["median"]
    assert full.startswith(f"| {WORKLOADS[1]} | {FULL} | on | on | 0.06 | 0.05 | 0.02 | 0.05 | 0.02 |"), full
    assert f"| {med['check_share']:.1%} |" in full
    ob = zero_run["workloads"][WORKLOADS[1]]["over_bound"][FULL]
    said = next(line for line in md if line.startswith(f"- {WORKLOADS[1]}: {FULL} checkpoint / restore"))
    assert said.endswith(f"; {ob['checkpoint_nonzero']:.2f}x / {ob['restore_nonzero']:.2f}x max(non-zero bytes / "
                         f"ceiling, control) = {ob['nonzero_bound_out_s']:.3f} / {ob['nonzero_bound_in_s']:.3f} s "
                         "(0.02 GiB non-zero)"), said
    assert plain.startswith(f"| {WORKLOADS[1]} | {PLAIN} | off | off | 0.00 | 0.00 | 0.06 | 0.00 | 0.06 | – | – | – |"), plain


def test_medians_keep_a_part_on_only_where_every_cycle_had_it():
    assert R.medians([{"scanned": True}, {"scanned": True}])["scanned"] is True
    assert R.medians([{"scanned": True}, {"scanned": False}])["scanned"] is False
    assert R.medians([{}])["checked"] is None, "older results do not say"


def test_no_scanning_method_no_non_zero_bound():
    med = {"checkpoint_s": 1.0, "restore_s": 1.0, "bytes_out": 8e9, "bytes_in": 8e9, "control_out_s": 0.3,
           "control_in_s": 0.3, "scanned": False, "bytes_over_link_in": 8e9}
    ob = compare.over_bound({PLAIN: {"median": med}}, {"d2h_gbps": 50.0, "h2d_gbps": 50.0})
    assert "nonzero_bytes" not in ob[PLAIN] and ob[PLAIN]["bound_out_s"] == pytest.approx(0.3)
    all_zero = {**med, "scanned": True, "bytes_over_link_in": 0}
    ob = compare.over_bound({FULL: {"median": all_zero}}, {"d2h_gbps": 50.0, "h2d_gbps": 50.0})
    assert ob[FULL]["nonzero_bound_out_s"] == pytest.approx(0.3), "nothing to copy: the control state bounds it"
