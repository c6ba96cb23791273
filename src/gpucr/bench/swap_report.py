"""The swap scenario's results read: each request's switch time and bound, each way's medians and ratios, a short
text table and a chart (matplotlib, when asked). Pure over the results dict, so a results file can be read again
(python3 -m gpucr.bench.swap_report FILE)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .swap_ways import DRIVER, GPUCR, ONE_WAY, RESTART

WAYS = (GPUCR, ONE_WAY, RESTART, DRIVER)
FLEET = "fleet"   # gpucr's two ways share the servers under the service, and so their resident times


def _pool(method: str) -> str:
    return FLEET if method in (GPUCR, ONE_WAY) else method


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def resident_ttft(requests: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Each server's resident time to first token: the median of its requests answered while it was resident."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in requests:
        if r["answered"] and r["resident"]:
            by.setdefault((_pool(r["method"]), r["server"]), []).append(r["ttft_s"])
    return {k: statistics.median(v) for k, v in by.items()}


def annotate(results: dict[str, Any]) -> None:
    """Each request that met its server not resident: its switch time (arrival to first token, less its server's
    resident time to first token) and, where the bytes it moved are known, its bound: max(bytes out, bytes in) over
    the two-way rate of the same run, plus max(control out, control in) where the service's timeline says them
    (control_s: None where it does not)."""
    rate = (results.get("two_way") or {}).get("each_way_gbps")
    base = resident_ttft(results["requests"])
    for r in results["requests"]:
        if not r["answered"] or r["resident"]:
            continue
        res = base.get((_pool(r["method"]), r["server"]))
        r["switch_s"] = r["ttft_s"] - res if res is not None else None
        nbytes = max(r.get("bytes_out") or 0, r.get("bytes_in") or 0)
        known = [c for c in (r.get("control_out_s"), r.get("control_in_s")) if c is not None]
        r["control_s"] = max(known) if known else None
        r["bound_s"] = nbytes / (rate * 1e9) + (r["control_s"] or 0.0) if nbytes and rate else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per way: requests, switches, answered and correct counts, median switch, median bound (gpucr's ways: their
    own; the restart and the driver: gpucr's, as they switch servers of the same shape), and the median switch
    over the bound and over (a)'s median."""
    annotate(results)
    reqs = results["requests"]
    out: dict[str, Any] = {}
    for way in WAYS:
        mine = [r for r in reqs if r["method"] == way]
        if not mine:
            continue
        sw = [r for r in mine if r["answered"] and not r["resident"] and r.get("switch_s") is not None]
        out[way] = {"requests": len(mine), "answered": sum(r["answered"] for r in mine),
                    "correct": sum(bool(r["correct"]) for r in mine), "switches": len(sw),
                    "median_switch_s": _median([r["switch_s"] for r in sw]),
                    "median_ttft_s": _median([r["ttft_s"] for r in sw]),
                    "median_bound_s": _median([r["bound_s"] for r in sw if r.get("bound_s")]),
                    "median_resident_ttft_s": _median([r["ttft_s"] for r in reqs if _pool(r["method"]) == _pool(way)
                                                       and r["answered"] and r["resident"]])}
    gb = (out.get(GPUCR) or {}).get("median_bound_s")
    a = (out.get(ONE_WAY) or {}).get("median_switch_s")
    for way, s in out.items():
        if s["median_bound_s"] is None and gb is not None and way in (RESTART, DRIVER):
            s["median_bound_s"], s["bound_from"] = gb, f"{GPUCR}'s switches (servers of the same shape)"
        m = s["median_switch_s"]
        s["over_bound"] = m / s["median_bound_s"] if m is not None and s["median_bound_s"] else None
        s["over_one_way"] = m / a if m is not None and a else None
    for way, s in out.items():
        switched = [r for r in reqs if r["method"] == way and r["answered"] and not r["resident"]]
        s["two_way_switches"] = sum(bool(r.get("two_way")) for r in switched)
        s["median_phases_s"] = median_phases(switched)
    results["summary"] = out
    results["switch_mode"] = switch_mode(out)
    results["all_answered_correct"] = all(r["answered"] and r["correct"] for r in reqs)
    results["issue_28_checks"] = checks(results)
    return out


def median_phases(requests: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Where the switches of these requests went, per direction: each phase's median over the parks (or resumes)
    that name it (the coordinator's phases_s, as the service's timeline carries them); {} where none says."""
    out: dict[str, dict[str, float]] = {}
    for direction in ("park", "resume"):
        seen: dict[str, list[float]] = {}
        for r in requests:
            for phases in (r.get("phases_s") or {}).get(direction, []):
                for name, v in phases.items():
                    seen.setdefault(name, []).append(v)
        if seen:
            out[direction] = {name: round(statistics.median(v), 4) for name, v in sorted(seen.items())}
    return out


def switch_mode(summary: dict[str, Any]) -> str:
    """How gpucr's ways switched in this run, as the service's timeline says (each request's `two_way`): the
    service's switches on demand (two-way where it could), and (a)'s (one-way by hand: parked, then resumed)."""
    said = [f"{way}: {s['two_way_switches']} of {s['switches']} switches two-way (the rest one-way: park, then resume)"
            for way, s in summary.items() if way in (GPUCR, ONE_WAY)]
    return "; ".join(said) or "no gpucr switch measured"


def checks(results: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 28's done-when for this scenario, as this run measured it (None: not measured here); on simcuda they say
    nothing of a GPU."""
    s = results["summary"]
    g = s.get(GPUCR) or {}
    return {"every_request_answered_right": results["all_answered_correct"],
            "gpucr_switches_at_least_40": g.get("switches", 0) >= 40,
            "median_switch_within_1.3x_bound": None if g.get("over_bound") is None else g["over_bound"] <= 1.3,
            "median_switch_at_most_0.65x_one_way": None if g.get("over_one_way") is None else g["over_one_way"] <= 0.65,
            "restart_and_driver_same_run": all((s.get(w) or {}).get("switches", 0) > 0 for w in (RESTART, DRIVER))}


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def table(results: dict[str, Any]) -> str:
    rows = [("way", "switches", "median switch s", "bound s", "x bound", "x (a)", "resident TTFT s", "correct")]
    for way, s in results["summary"].items():
        rows.append((way, str(s["switches"]), _f(s["median_switch_s"]), _f(s["median_bound_s"]), _f(s["over_bound"], ".2f"),
                     _f(s["over_one_way"], ".2f"), _f(s["median_resident_ttft_s"]), f"{s['correct']}/{s['requests']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    for way, s in results["summary"].items():
        for direction, phases in (s.get("median_phases_s") or {}).items():
            big = ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 0.01)
            lines.append(f"{way} {direction}s, median s per phase (0.01 s and more): {big or '-'}")
    lines.append("issue 28: " + ", ".join(f"{k} {'-' if v is None else 'yes' if v else 'NO'}"
                                           for k, v in results["issue_28_checks"].items()))
    head = [f"swap scenario: {results['settings']['servers']} servers of {results['settings']['shape']}, "
            f"switch mode {results['switch_mode']}"]
    if results.get("simulated"):
        head.insert(0, results["warning"])
    return "\n".join(head + lines)


def chart(results: dict[str, Any], path: Path) -> None:
    """Left: gpucr's requests over the run, time to first token, resident or not; right: each way's median switch
    beside its bound. ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for resident, colour, label in ((True, "tab:green", "resident"), (False, "tab:red", "parked at arrival")):
        pts = [(r["arrival_s"], r["ttft_s"]) for r in results["requests"]
               if r["method"] == GPUCR and r["answered"] and r["resident"] == resident]
        if pts:
            left.scatter(*zip(*pts), s=12, c=colour, label=label)
    left.set_xlabel("arrival, s into the run")
    left.set_ylabel("time to first token, s")
    left.set_yscale("log")
    left.legend()
    left.set_title("gpucr swap service: every request")
    s = results["summary"]
    ways = [w for w in s if s[w]["median_switch_s"] is not None]
    right.bar(ways, [s[w]["median_switch_s"] for w in ways], color="tab:blue", label="median switch")
    right.scatter(ways, [s[w]["median_bound_s"] or 0 for w in ways], c="black", marker="_", s=400, label="bound")
    right.set_ylabel("seconds")
    right.set_yscale("log")
    right.legend()
    right.set_title("one switch, each way")
    right.tick_params(axis="x", labelrotation=15)
    title = f"{results['device']['name']}, {results['settings']['shape']}"
    fig.suptitle(("SIMULATED (simcuda, not a GPU): " if results.get("simulated") else "") + title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m gpucr.bench.swap_report RESULTS.json")
    res = json.loads(Path(sys.argv[1]).read_text())
    summarize(res)
    print(table(res))
