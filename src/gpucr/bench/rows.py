"""One cycle of a method as the report's row: gpucr's per-process results combined into the job's
(`combine`), each step's seconds, bytes and rates and their share of the ceiling (`metrics`), per GPU
(`per_gpu`), and the medians of a method's cycles (`medians`)."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ..results import ProcessCheckpoint, ProcessRestore

if TYPE_CHECKING:
    from .methods import Method


def combine(results: list[ProcessCheckpoint] | list[ProcessRestore]) -> dict[str, Any]:
    """The job's view of gpucr's per-process results: the processes go through each phase together,
    so a phase takes as long as its slowest process; bytes add up. (The bench file's schema,
    gpucr-bench/1, keeps the agent's times in milliseconds.)"""
    steps: dict[str, float] = {}
    agent_ms: dict[str, float] = {}
    routes: dict[str, int] = {}
    for r in results:
        for k, v in r.phases_s.items():
            steps[k] = max(steps.get(k, 0.0), v)
        for k, v in r.agent_phases_s.items():
            agent_ms[k] = max(agent_ms.get(k, 0.0), v * 1000)
        for k, v in r.routes.items():
            routes[k] = routes.get(k, 0) + v
    return {"steps_s": steps, "agent_ms": agent_ms, "bytes_moved": sum(r.bytes_moved for r in results),
            "bytes_left_to_driver": sum(getattr(r, "bytes_left_to_driver", 0) for r in results),
            "warnings": [w for r in results for w in r.warnings], "routes": routes,
            "data_plane": data_plane(results), "image": _images(results), **_zero_and_check(results)}


def _zero_and_check(results: list[ProcessCheckpoint] | list[ProcessRestore]) -> dict[str, Any]:
    """Issue 26's parts as the job's results say them: a checkpoint's scan (bytes it read, and of bytes_moved those in
    zero chunks not copied out), a restore's memsets (zero chunks set on the GPU, not copied) and check. Bytes add up;
    scanned / checked hold only where every process's did. Only the keys that kind of result has."""
    out: dict[str, Any] = {}
    for flag, counts in (("scanned", ("bytes_scanned", "bytes_zero_skipped", "bytes_unchanged_skipped")),
                         ("checked", ("bytes_zeroed",))):
        if results and all(hasattr(r, flag) for r in results):
            out[flag] = all(getattr(r, flag) for r in results)
            out.update({k: sum(getattr(r, k) for r in results) for k in counts})
    return out


def data_plane(results: list[ProcessCheckpoint] | list[ProcessRestore]) -> str | None:
    """Which plane moved the job's data, as its results say (`data_plane`; None where a result does not
    say): one name, or each process's joined by '+' where they differ."""
    said = list(dict.fromkeys(getattr(r, "data_plane", None) for r in results))
    if said == [None]:
        return None
    return "+".join(str(p) for p in said)


def _images(results: list[ProcessCheckpoint] | list[ProcessRestore]) -> dict[str, Any] | None:
    """The job's image transfer: its processes' images are written (or read) at once, so it takes as long
    as the slowest; bytes add up. None without an image."""
    imgs = [r.image for r in results if r.image is not None]
    if not imgs:
        return None
    # on the disk: what was written (read), zero chunks left out; a process that imports shared memory
    # names it in its image, but its exporter's image holds the bytes
    moved = sum(i.bytes_written if i.bytes_written is not None else (i.bytes_read or 0) for i in imgs)
    return {"bytes": sum(i.bytes for i in imgs), "disk_bytes": moved, "transfer_s": max(i.transfer_s for i in imgs),
            "direct_io": all(i.direct_io for i in imgs), "dirs": [i.dir for i in imgs]}


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds else None


def _ratio(x: float | None, ceiling: float | None) -> float | None:
    return x / ceiling if x and ceiling else None


def metrics(method: Method, ck: dict, rs: dict, footprint: int | None, ceiling: dict | None) -> dict[str, Any]:
    """One cycle as the report's row: seconds per part, bytes, rates and their share of the ceiling.

    gpucr splits data (agent) from control (driver); the driver's own checkpoint does both in one
    step, so its time is driver_out_s / driver_in_s and the bytes it moved are the process's whole
    GPU footprint (as nvidia-smi counts it); the peer pauses its region inside the application, so
    its time is app_out_s / app_in_s and its bytes the region's."""
    cs, rsteps = ck["steps_s"], rs["steps_s"]
    row: dict[str, Any] = {"checkpoint_s": ck["wall_s"], "restore_s": rs["wall_s"],
                           **dict.fromkeys(("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s",
                                            "driver_out_s", "driver_in_s", "app_out_s", "app_in_s"))}
    if method.in_app:
        row.update(app_out_s=cs["pause"], app_in_s=rsteps["resume"], bytes_out=ck["bytes_moved"],
                   bytes_in=rs["bytes_moved"], bytes_left_to_driver=None)
        out_s, in_s = row["app_out_s"], row["app_in_s"]
    elif method.splits:
        am = ck["agent_ms"]
        row.update(gate_sync_s=(am["gate"] + am["sync"]) / 1000, data_out_s=cs["data_out"],
                   control_out_s=(cs["driver_lock"] + cs["control_out"]) if "control_out" in cs else None,
                   control_in_s=(rsteps["control_in"] + rsteps.get("driver_unlock", 0.0)) if "control_in" in rsteps else None,
                   data_in_s=rsteps.get("data_in"),
                   bytes_out=ck["bytes_moved"], bytes_in=rs["bytes_moved"],
                   bytes_left_to_driver=ck["bytes_left_to_driver"], agent_ms=am)
        out_s, in_s = row["data_out_s"], row["data_in_s"]
    else:
        row.update(driver_out_s=cs["lock"] + cs["checkpoint"], driver_in_s=rsteps["restore"] + rsteps["unlock"],
                   bytes_out=footprint, bytes_in=footprint, bytes_left_to_driver=footprint)
        out_s, in_s = row["driver_out_s"], row["driver_in_s"]
    row["steps_s"] = {"checkpoint": cs, "restore": rsteps}
    row["data_plane"] = {"checkpoint": ck.get("data_plane"), "restore": rs.get("data_plane")}
    row.update(_image_parts(ck.get("image"), rs.get("image")))
    if rs.get("gpu_map"):   # the restore's --map, {old UUID: new UUID}
        row["gpu_map"] = rs["gpu_map"]
    if ck.get("routes") or rs.get("routes"):   # bytes through each NVLink neighbour's link (the server's routes)
        row["routes_bytes"] = {"checkpoint": ck.get("routes", {}), "restore": rs.get("routes", {})}
    if method.splits:
        row.update(zero_parts(ck, rs))
    row["gbps_out"], row["gbps_in"] = _gbps(row["bytes_out"], out_s), _gbps(row["bytes_in"], in_s)
    c = ceiling or {}
    row["ceiling_share_out"] = _ratio(row["gbps_out"], c.get("d2h_gbps"))
    row["ceiling_share_in"] = _ratio(row["gbps_in"], c.get("h2d_gbps"))
    return row


def zero_parts(ck: dict[str, Any], rs: dict[str, Any]) -> dict[str, Any]:
    """Issue 26 in one cycle: what the checkpoint's scan read, what of its bytes crossed the link (zero chunks skipped
    are not), what of the restore's did (zero chunks set by a memset are not), the scan's and the check's seconds and
    the check's share of the restore (the issue asks at most 3 %). None where the results do not say (older gpucr)."""
    scanned, checked = ck.get("scanned"), rs.get("checked")
    check_s = rs["steps_s"].get("server_check") if checked else None
    skipped, zeroed = ck.get("bytes_zero_skipped"), rs.get("bytes_zeroed")
    unchanged = ck.get("bytes_unchanged_skipped", 0)
    return {"scanned": scanned, "checked": checked, "bytes_scanned": ck.get("bytes_scanned"),
            "bytes_zero_skipped": skipped, "bytes_zeroed": zeroed, "bytes_unchanged_skipped": unchanged,
            "bytes_over_link_out": None if skipped is None else ck["bytes_moved"] - skipped - unchanged,
            "bytes_over_link_in": None if zeroed is None else rs["bytes_moved"] - zeroed,
            "scan_s": ck["steps_s"].get("server_scan") if scanned else None, "check_s": check_s,
            "check_share": check_s / rs["wall_s"] if check_s is not None and rs.get("wall_s") else None}


def _image_parts(written: dict[str, Any] | None, read: dict[str, Any] | None) -> dict[str, Any]:
    """An image cycle's disk parts (checkpoint --image writes it within its commit, restore --image reads
    it within its data step): their seconds and the bytes written to the disk; nothing for a cycle without one."""
    if not written and not read:
        return {}
    return {"image_bytes": (written or read or {}).get("disk_bytes"), "image_out_s": (written or {}).get("transfer_s"),
            "image_in_s": (read or {}).get("transfer_s"), "image_direct_io": all(i["direct_io"] for i in (written, read) if i)}


def per_gpu(row: dict[str, Any], method: Method, bytes_per_gpu: dict[str, int]) -> dict[str, Any]:
    """Each GPU's bytes over the job's data time (its ranks move their data at once), and the
    slowest GPU's rate, which bounds the job."""
    kind = "app" if method.in_app else "data" if method.splits else "driver"
    out_s, in_s = row[f"{kind}_out_s"], row[f"{kind}_in_s"]
    out = {"bytes_per_gpu": bytes_per_gpu,
           "gbps_out_per_gpu": {u: _gbps(b, out_s) for u, b in bytes_per_gpu.items()},
           "gbps_in_per_gpu": {u: _gbps(b, in_s) for u, b in bytes_per_gpu.items()}}
    for k in ("out", "in"):
        rates = [r for r in out[f"gbps_{k}_per_gpu"].values() if r]
        out[f"gbps_{k}_slowest_gpu"] = min(rates) if rates else None
    return out


SUMMARY_KEYS = ("gate_sync_s", "data_out_s", "control_out_s", "control_in_s", "data_in_s", "driver_out_s",
                "driver_in_s", "app_out_s", "app_in_s", "checkpoint_s", "restore_s", "bytes_out", "bytes_in", "gbps_out", "gbps_in",
                "ceiling_share_out", "ceiling_share_in", "gpu_held_checkpointed_bytes", "gbps_out_slowest_gpu",
                "gbps_in_slowest_gpu", "staging_bytes", "image_bytes", "image_out_s", "image_in_s",
                "bytes_scanned", "bytes_zero_skipped", "bytes_over_link_out", "bytes_zeroed", "bytes_over_link_in",
                "scan_s", "check_s", "check_share")
FLAGS = ("scanned", "checked")   # issue 26's parts, on or off: held in the median where every cycle's was


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in SUMMARY_KEYS:
        vals = [s[k] for s in samples if s.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    for k in FLAGS:
        said = [s[k] for s in samples if s.get(k) is not None]
        out[k] = all(said) if said else None
    return out
