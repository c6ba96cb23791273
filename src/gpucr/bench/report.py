"""Render `gpucr bench` results: a Markdown table for the README and a PNG chart.

    python3 -m gpucr.bench.report RESULTS.json [MORE.json ...] [--chart PNG] [--recompute]

Several files (say one per workload, from separate runs) are merged into one table; files
measured on simcuda and on a GPU are never mixed. --recompute first rewrites each file in place
with its comparisons (speedups, versus_peer, over_bound) derived again from its medians and its
ceiling: files written before a comparison existed get it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

GiB = 1 << 30

# chart segments: (median key, label, colour); a checkpoint bar stacks the *_out keys, a restore bar the *_in keys
PEER_LABEL, PEER_COLOUR = "pause / resume in the app (torch_memory_saver)", "#2ca02c"
IMAGE_LABEL, IMAGE_COLOUR = "image on disk (write / read)", "#9467bd"
OUT_PARTS = (("data_out_s", "data (gpucr)", "#1f77b4"), ("control_out_s", "control (driver)", "#ff7f0e"),
             ("driver_out_s", "driver: data + control", "#7f7f7f"), ("app_out_s", PEER_LABEL, PEER_COLOUR),
             ("image_out_s", IMAGE_LABEL, IMAGE_COLOUR))
# no image part in a restore's bar: its image read (the image_read step) is not drawn, its fill is the data part;
# a checkpoint writes its image after its data step, within the commit
IN_PARTS = (("data_in_s", "data (gpucr)", "#1f77b4"), ("control_in_s", "control (driver)", "#ff7f0e"),
            ("driver_in_s", "driver: data + control", "#7f7f7f"), ("app_in_s", PEER_LABEL, PEER_COLOUR))
REST = ("other (coordinator's own time)", "#d9d9d9")
WIDE, NARROW = 0.8, 0.3   # a bar's width, and a part's drawn beside the first where they ran at the same time


def read(path: str | Path, text: str | None = None) -> dict[str, Any]:
    """One results file (its `text`, when the caller has read it already), refused in one line unless it
    has the shape `gpucr bench` writes (workloads of methods, each an object, medians objects): what
    renders or recomputes it reads no further."""
    try:
        r = json.loads(Path(path).read_text() if text is None else text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    why = None
    if not isinstance(r, dict) or not isinstance(r.get("workloads"), dict):
        why = "no 'workloads' object"
    else:
        for wname, w in r["workloads"].items():
            if not isinstance(w, dict) or not isinstance(w.get("methods"), dict):
                why = f"workload {wname!r} has no 'methods' object"
            elif any(not isinstance(m, dict) or not isinstance(m.get("median") or {}, dict) for m in w["methods"].values()):
                why = f"a method of workload {wname!r} is not an object with an object median"
            if why:
                break
    if why:
        raise ValueError(f"{path}: not a gpucr bench results file ({why})")
    return r


def load(paths: list[str | Path]) -> dict[str, Any]:
    """One results dict from one or several files; workloads of later files are added."""
    merged: dict[str, Any] | None = None
    for p in paths:
        r = read(p)
        if merged is None:
            merged = r
            continue
        if bool(r.get("simulated")) != bool(merged.get("simulated")):
            raise ValueError(f"{p}: simulated (simcuda) and GPU results cannot be shown together")
        merged["workloads"].update(r["workloads"])
        merged["ceiling"] = merged.get("ceiling") or r.get("ceiling")
    if merged is None:
        raise ValueError("no results file given")
    return merged


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _rate(gbps: float | None, share: float | None) -> str:
    if gbps is None:
        return "–"
    return f"{gbps:.1f}" + (f" ({share:.0%})" if share is not None else "")


def _gib(n: int | None) -> str:
    return "–" if n is None else f"{n / GiB:.2f}"


def markdown(res: dict[str, Any]) -> str:
    dev, sw = res.get("device", {}), res.get("software", {})
    lines = []
    if res.get("simulated"):
        lines += [f"**{res.get('warning') or 'SIMULATED: NOT GPU RESULTS'}**", ""]
    lines.append(f"{dev.get('name')}, driver {dev.get('driver_version')}, CUDA {dev.get('cuda_version')}; "
                 f"gpucr {sw.get('gpucr')}, torch {sw.get('torch')}, transformers {sw.get('transformers')}; "
                 f"{res.get('date')}; median of {res.get('settings', {}).get('repeat')} cycles.")
    c = res.get("ceiling")
    if c:
        lines.append(f"Pinned-copy ceiling ({_gib(c['bytes'])} GiB): D2H {c['d2h_gbps']:.1f} GB/s, "
                     f"H2D {c['h2d_gbps']:.1f} GB/s; rates below show their share of it.")
    lines += ["", "| workload | method | checkpoint s | restore s | gate+sync s | data out s | control out s | "
              "control in s | data in s | moved GiB | GB/s out | GB/s in | GiB held while checkpointed | "
              "x bound (ckpt / restore) | data plane | correct |",
              "|" + " --- |" * 16]
    for wname, w in res.get("workloads", {}).items():
        for mname, m in w.get("methods", {}).items():
            if m.get("skipped"):
                continue
            if m.get("error"):
                said = m.get("outcome") if m.get("outcome") in ("failed", "hung") else "failed"
                lines.append(f"| {wname} | {mname} | {said}: {m['error'][:80]} |" + " |" * 13)
                continue
            d = m["median"]
            data_out, data_in = _either(d, "data_out_s", "app_out_s"), _either(d, "data_in_s", "app_in_s")
            lines.append(" | ".join([
                f"| {wname}", mname, _s(d["checkpoint_s"]), _s(d["restore_s"]), _s(d["gate_sync_s"]),
                _s(data_out), _s(d["control_out_s"]), _s(d["control_in_s"]), _s(data_in),
                _gib(d["bytes_out"]), _rate(d["gbps_out"], d["ceiling_share_out"]),
                _rate(d["gbps_in"], d["ceiling_share_in"]), _gib(d["gpu_held_checkpointed_bytes"]),
                _times_bound((w.get("over_bound") or {}).get(mname)), _plane(m.get("data_plane")),
                "yes" if m.get("correct") else "**NO**"]) + " |")
    lines += jobs_table(res)
    lines += zero_table(res)
    lines += disk_lines(res)
    sp = [f"{w}: {k.replace('_vs_', ' vs ')} checkpoint {faster(v['checkpoint'])}, restore {faster(v['restore'])}"
          for w, wr in res.get("workloads", {}).items() for k, v in (wr.get("speedups") or {}).items()]
    sp += [line for w, wr in res.get("workloads", {}).items() for line in peer_lines(w, wr.get("versus_peer") or {})]
    sp += [line for w, wr in res.get("workloads", {}).items() for line in bound_lines(w, wr.get("over_bound") or {})]
    sp += [f"{w}: {mn} skipped: {m['skipped']}" for w, wr in res.get("workloads", {}).items()
           for mn, m in wr.get("methods", {}).items() if m.get("skipped") and m["skipped"] != "not an NCCL job"]
    if sp:
        lines += [""] + [f"- {s}" for s in sp]
    lines += ["", "driver / driver-fresh: the driver's own checkpoint (data and control in one step; its bytes are "
              "the process's whole GPU footprint); gpucr-full: the bench's own mover (no server) copies the data through a "
              "small pinned ring, beside the driver's checkpoint of the control state; gpucr-data: data only, the CUDA "
              "context stays; gpucr-cli / gpucr-cli-server: a fresh `gpucr checkpoint|restore` per step, in-process "
              "(--no-server: an interpreter and cuInit each time) or through `gpucr serve`; gpucr-server-full / "
              "gpucr-server-data: through `gpucr serve`, whose data plane copies the data (straight into the pinned "
              "staging) while the driver takes the control state, side by side (control s overlap data s); "
              "gpucr-server-full-one-link: the same with `gpucr serve --no-routes`, over the process's own GPU's host "
              "link only (gpucr-server-full also goes through idle GPUs joined to it by NVLink: routes_bytes); "
              "gpucr-server-image: `checkpoint --image` then `restore --image` through the server, set against the "
              "disk's rate measured in the same run for as many bytes; gpucr-server-map: the restore with `--map` "
              "naming every GPU onto itself; gpucr-server-plain: gpucr-server-full with its zero scan and checked resume "
              "off (`checkpoint --no-scan`): zero chunks cross the link and nothing is checked; data plane: which "
              "plane moved the data, as gpucr's results say; "
              "torch-memory-saver, the "
              "peer: its own process, whose data (raw buffer, or weights and KV cache) is in a torch_memory_saver "
              "region with CPU backup kept, paused and resumed by the app when asked: its data out / in s are the "
              "pause / resume timed inside the app (its GB/s are on them and the region's bytes), its checkpoint / "
              "restore s the same asked from the bench, round trip included."]
    return "\n".join(lines)


def zero_table(res: dict[str, Any]) -> list[str]:
    """Issue 26's parts of each gpucr row that says them: zero chunks (the checkpoint's scan, the bytes it skipped, the
    restore's memsets), the bytes that crossed the link each way, the checked resume's seconds and share of the restore,
    and the times over max(non-zero bytes / link, control). Nothing for a run whose rows do not say (older gpucr)."""
    rows = []
    for wname, w in res.get("workloads", {}).items():
        for mname, m in w.get("methods", {}).items():
            d = m.get("median") or {}
            if d.get("scanned") is None:
                continue
            ob = (w.get("over_bound") or {}).get(mname) or {}
            share = d.get("check_share")
            rows.append(" | ".join([
                f"| {wname}", mname, "on" if d["scanned"] else "off", "on" if d.get("checked") else "off",
                _gib(d.get("bytes_scanned")), _gib(d.get("bytes_zero_skipped")), _gib(d.get("bytes_over_link_out")),
                _gib(d.get("bytes_zeroed")), _gib(d.get("bytes_over_link_in")), _s(d.get("scan_s")), _s(d.get("check_s")),
                "–" if share is None else f"{share:.1%}", _gib(ob.get("nonzero_bytes")),
                f"{ob['checkpoint_nonzero']:.2f}x / {ob['restore_nonzero']:.2f}x" if "checkpoint_nonzero" in ob else "–"]) + " |")
    if not rows:
        return []
    return ["", "Zero chunks and the checked resume (issue 26): GiB each way, what crossed the link, and the times over "
            "max(non-zero bytes / ceiling, control); scan s: what the copies out waited for the scan, check s: the check "
            "after the last copy in (the rest of both runs beside the copies):", "",
            "| workload | method | zero scan | check | scanned GiB | skipped as zero GiB | over link out GiB | "
            "zeroed at restore GiB | over link in GiB | scan s | check s | check / restore | non-zero GiB | "
            "x non-zero bound (ckpt / restore) |", "|" + " --- |" * 14, *rows]


GBPS_KEY, TIME_KEY = "_gbps_over_peer", "_time_over_peer"
PEER = "torch-memory-saver"   # methods.TmsMethod.name, spelt out: rendering a file needs none of the bench's imports


def faster(ratio: float) -> str:
    """A speed-up as people say it: 2.0 is "2.0x faster", 0.5 is "2.0x slower" (not "0.5x faster")."""
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower" if ratio > 0 else "n/a"


def peer_lines(w: str, vp: dict[str, dict[str, float]]) -> list[str]:
    """versus_peer's ratios, one sentence each, the gpucr method named from its key."""
    out = []
    for k, v in vp.items():
        if k.endswith(GBPS_KEY):
            out.append(f"{w}: {k[:-len(GBPS_KEY)]} GB/s {v['out']:.2f}x (out) / {v['in']:.2f}x (in) {PEER}'s")
        elif k.endswith(TIME_KEY):
            out.append(f"{w}: {k[:-len(TIME_KEY)]} checkpoint / restore time {v['checkpoint']:.2f}x / "
                       f"{v['restore']:.2f}x {PEER}'s pause / resume")
    return out


def bound_lines(w: str, ob: dict[str, dict[str, float]]) -> list[str]:
    """over_bound: each method's times over what its bytes and control state allow (older files lack it)."""
    return [f"{w}: {m} checkpoint / restore {v['checkpoint']:.2f}x / {v['restore']:.2f}x its bound "
            f"({_bound_said(m, v)} = {v['bound_out_s']:.3f} / {v['bound_in_s']:.3f} s)" + _nonzero_said(v) for m, v in ob.items()]


def _nonzero_said(v: dict[str, float]) -> str:
    """The same against the non-zero bytes (issue 26), where the run found them."""
    if "checkpoint_nonzero" not in v:
        return ""
    return (f"; {v['checkpoint_nonzero']:.2f}x / {v['restore_nonzero']:.2f}x max(non-zero bytes / ceiling, control) = "
            f"{v['nonzero_bound_out_s']:.3f} / {v['nonzero_bound_in_s']:.3f} s ({_gib(v['nonzero_bytes'])} GiB non-zero)")


def _bound_said(method: str, v: dict[str, float]) -> str:
    if method == PEER:
        return "bytes / ceiling"
    if "disk_out_s" in v:
        return "max(bytes / ceiling, image bytes / disk, control)"
    return "max(bytes / ceiling, control)"


def _times_bound(v: dict[str, float] | None) -> str:
    return "–" if not v else f"{v['checkpoint']:.2f}x / {v['restore']:.2f}x"


def _plane(said: dict[str, str | None] | None) -> str:
    """The plane that moved a row's data (`data_plane` of its results): one name, or the checkpoint's and
    the restore's where they differ; – where the results do not say (older gpucr, the driver's own path)."""
    ck, rs = (said or {}).get("checkpoint"), (said or {}).get("restore")
    if ck is None and rs is None:
        return "–"
    return str(ck) if ck == rs else f"{ck or '–'} / {rs or '–'}"


def disk_lines(res: dict[str, Any]) -> list[str]:
    """Each workload's disk, measured in the run under the images' directory, and each image method's
    write and read rate as a share of it (the image's bytes over its transfer time)."""
    out = []
    for wname, w in res.get("workloads", {}).items():
        d = w.get("disk")
        if not d:
            continue
        if d.get("error"):
            out.append(f"{wname}: the disk under {d.get('dir')} could not be measured: {d['error']}")
            continue
        line = (f"{wname}: disk under {d['dir']} ({'O_DIRECT' if d['direct_io'] else 'buffered'}, {_gib(d['bytes'])} GiB): "
                f"write + fsync {d['write_gbps']:.2f} GB/s, read {d['read_gbps']:.2f} GB/s")
        for mname, m in w.get("methods", {}).items():
            med = m.get("median") or {}
            if med.get("image_bytes") and med.get("image_out_s") and med.get("image_in_s"):
                wr, rd = med["image_bytes"] / med["image_out_s"] / 1e9, med["image_bytes"] / med["image_in_s"] / 1e9
                line += (f"; {mname}'s image written at {wr:.2f} GB/s ({wr / d['write_gbps']:.2f} of the disk's), "
                         f"read at {rd:.2f} GB/s ({rd / d['read_gbps']:.2f})")
        out.append(line)
    return [""] + [f"- {line}" for line in out] if out else []


def _either(d: dict[str, Any], key: str, other: str) -> float | None:
    """d[key], else d[other] (the peer's in-app times stand in the data columns); older files lack other."""
    return d[key] if d.get(key) is not None else d.get(other)


def _per_gpu(rates: dict[str, float | None] | None) -> str:
    return " / ".join("–" if r is None else f"{r:.1f}" for r in (rates or {}).values()) or "–"


def jobs_table(res: dict[str, Any]) -> list[str]:
    """Multi-GPU jobs: each method's outcome, the job's serving speed under the NCCL settings its
    process ran with, and bytes and rates per GPU (the GPUs in the order of the first line)."""
    rows = [(wn, mn, m) for wn, w in res.get("workloads", {}).items() for mn, m in w.get("methods", {}).items()
            if not m.get("skipped") and len(((m.get("process") or {}).get("bytes_per_gpu")) or {}) > 1]
    if not rows:
        return []
    out = [""]
    c = res.get("ceiling_all_gpus")
    if c:
        out.append(f"Pinned-copy ceiling, {c['gpus']} GPUs' links at once ({_gib(c['bytes_per_gpu'])} GiB each): "
                   f"D2H {c['aggregate_d2h_gbps']:.1f} GB/s, H2D {c['aggregate_h2d_gbps']:.1f} GB/s in all; per GPU "
                   + ", ".join(f"{g['d2h_gbps']:.1f} / {g['h2d_gbps']:.1f}" for g in c["per_gpu"]) + " (D2H / H2D).")
    out += ["", "| job | method | outcome | NCCL transports | tokens/s | GiB per GPU | GB/s per GPU out (last cycle) | GB/s per GPU in (last cycle) |",
            "|" + " --- |" * 8]
    for wname, mname, m in rows:
        p = m["process"]
        env = p.get("job_env") or {}
        transports = "P2P and SHM off" if env.get("NCCL_P2P_DISABLE") == "1" else "default (P2P, SHM on)"
        speed = f"{p['tokens_per_s']:.1f}" if p.get("tokens_per_s") else "–"
        gib = " / ".join(_gib(b) for b in p["bytes_per_gpu"].values())
        outcome = m.get("outcome") or ("ok" if not m.get("error") else "failed")
        if outcome != "ok":
            outcome += f" at {m.get('failed_step')}: {(m.get('error') or '')[:100]}"
        last = (m.get("samples") or [{}])[-1]
        out.append(" | ".join([f"| {wname}", mname, outcome, transports, speed, gib,
                               _per_gpu(last.get("gbps_out_per_gpu")), _per_gpu(last.get("gbps_in_per_gpu"))]) + " |")
    return out


class Part(NamedTuple):
    dx: float        # from the bar's centre
    bottom: float
    height: float
    width: float
    colour: str


def bar_parts(d: dict[str, Any], parts: tuple[tuple[str, str, str], ...], total_key: str) -> list[Part]:
    """One bar of the chart: the median's parts stacked one after the other, and the rest of its time as
    "other"; parts that ran side by side (their sum above the time: the server copies while the driver
    works) are not stacked but the first drawn full width and the others narrow beside it, so that no bar
    is taller than its time."""
    present = [(key, colour) for key, _, colour in parts if d.get(key)]
    total = d.get(total_key) or 0.0
    out: list[Part] = []
    if len(present) > 1 and sum(d[k] for k, _ in present) > total + 0.001:
        (key, colour), beside = present[0], present[1:]
        out.append(Part(0.0, 0.0, d[key], WIDE, colour))
        out += [Part(0.25, 0.0, d[k], NARROW, c) for k, c in beside]
        top = max(d[k] for k, _ in present)
    else:
        top = 0.0
        for key, colour in present:
            out.append(Part(0.0, top, d[key], WIDE, colour))
            top += d[key]
    if total - top > 0:
        out.append(Part(0.0, top, total - top, WIDE, REST[1]))
    return out


def chart(res: dict[str, Any], path: str | Path) -> None:
    """Per workload, for each method a checkpoint and a restore bar, stacked by where the time went."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workloads = [(n, w) for n, w in res.get("workloads", {}).items()
                 if any(not m.get("error") and m.get("median") for m in w.get("methods", {}).values())]
    n = max(1, len(workloads))
    fig, axes = plt.subplots(1, n, figsize=(max(9.0, 4.5 * n), 5.6), squeeze=False)
    for ax, (wname, w) in zip(axes[0], workloads):
        ms = [(n, m["median"]) for n, m in w["methods"].items() if not m.get("error") and m.get("median")]
        ticks, labels = [], []
        for i, (mname, d) in enumerate(ms):
            for j, (parts, total_key, hatch) in enumerate(((OUT_PARTS, "checkpoint_s", ""), (IN_PARTS, "restore_s", "//"))):
                x = i * 3 + j
                for b in bar_parts(d, parts, total_key):
                    ax.bar(x + b.dx, b.height, bottom=b.bottom, width=b.width, color=b.colour, hatch=hatch,
                           edgecolor="black", linewidth=0.4)
                ax.text(x, d.get(total_key) or 0.0, _s(d.get(total_key)), ha="center", va="bottom", fontsize=7)
            ticks.append(i * 3 + 0.5)
            labels.append(mname)
        ax.set_xticks(ticks, labels, rotation=20, fontsize=8)
        ax.set_title(wname)
        ax.set_ylabel("seconds (median)")
        ax.grid(axis="y", alpha=0.3)
    seen = {label: colour for parts in (OUT_PARTS, IN_PARTS) for _, label, colour in parts}
    handles = [Patch(facecolor=c, edgecolor="black", label=lbl) for lbl, c in seen.items()]
    handles += [Patch(facecolor=REST[1], edgecolor="black", label=REST[0]),
                Patch(facecolor="white", edgecolor="black", label="narrow: at the same time as the wide part"),
                Patch(facecolor="white", edgecolor="black", label="left: checkpoint"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="right: restore")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8)
    dev = res.get("device", {})
    title = f"gpucr bench: {dev.get('name')}\ndriver {dev.get('driver_version')}, CUDA {dev.get('cuda_version')}, {res.get('date')}"
    if res.get("simulated"):
        fig.suptitle("SIMULATED (simcuda test double): NOT GPU RESULTS\n" + title, color="red", fontsize=12,
                     fontweight="bold")
    else:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 0.86))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recompute(path: str | Path) -> None:
    """Rewrite one results file with its comparisons derived again (gpucr.bench.compare.derive_all, their one
    home); everything else, the file's indent and its final newline included, stays as it was."""
    from . import compare   # here, not at the top: rendering needs none of it
    p = Path(path)
    text = p.read_text()   # once: its layout is kept too
    res = read(p, text)
    compare.derive_all(res)
    tmp = p.with_suffix(p.suffix + ".tmp")   # replaced whole: a failed write leaves the file as it was
    tmp.write_text(json.dumps(res, indent=_indent(text)) + ("\n" if text.endswith("\n") else ""))
    os.replace(tmp, p)


def _indent(text: str) -> int | None:
    """The indent a JSON file was written with (None: all on one line)."""
    lines = text.splitlines()
    return len(lines[1]) - len(lines[1].lstrip(" ")) if len(lines) > 1 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m gpucr.bench.report", description="Markdown table (and chart) of gpucr bench results")
    ap.add_argument("results", nargs="+", metavar="RESULTS.json")
    ap.add_argument("--chart", metavar="PNG", help="also draw the chart of the merged results")
    ap.add_argument("--recompute", action="store_true",
                    help="first rewrite each file in place with speedups, versus_peer and over_bound derived again")
    a = ap.parse_args(argv)
    try:
        for p in a.results if a.recompute else []:
            recompute(p)
        res = load(a.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpucr: error: cannot read the results: {exc}", file=sys.stderr)
        return 1
    print(markdown(res))
    if a.chart:
        chart(res, a.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
