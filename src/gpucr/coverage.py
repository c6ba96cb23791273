"""Coverage: the bytes gpucr's data plane moves and those it leaves to the driver's own checkpoint
(correct, but ~2 GB/s), each kind with its reason. The agent reports it (`coverage` in its status);
this module only words it, for `gpucr status`, `gpucr checkpoint` and the manifest."""
from __future__ import annotations

from typing import Any


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def left_summary(cov: dict[str, Any] | None) -> str:
    """One clause naming what was left to the driver, by kind: '' when nothing was."""
    parts = [f"{e['kind']} {_mib(e['bytes'])}" for e in (cov or {}).get("left_to_driver", []) if e.get("bytes")]
    return f" ({', '.join(parts)})" if parts else ""


def status_lines(cov: dict[str, Any] | None) -> list[str]:
    """The lines of `gpucr status` about coverage: what went which way and why."""
    if not cov:
        return []
    moved, left = cov["bytes_moved_by_gpucr"], cov["bytes_left_to_driver"]
    share = f"{100.0 * moved / (moved + left):.1f} % " if moved + left else ""
    lines = [f"  coverage     {share}of the bytes moved by gpucr ({_mib(moved)}), {_mib(left)} left to the driver"]
    lines += [f"    {e['kind']}: {_mib(e['bytes'])}" + (f" in {e['count']}" if "count" in e else "") + f": {e['reason']}"
              for e in cov.get("left_to_driver", [])]
    so = cov.get("stream_ordered") or {}
    if so.get("pools_served") or so.get("pools_left_to_driver"):
        lines.append(f"  pools        {so['pools_served']} served by gpucr (used {_mib(so['used_bytes'])}, reserved "
                     f"{_mib(so['reserved_bytes'])}, {so['allocations']} allocations, {so['cross_stream_waits']} "
                     f"cross-stream waits), {so['pools_left_to_driver']} left to the driver")
    lines.append(f"  not counted  {cov['not_counted']}")
    return lines


def manifest_entry(cov: dict[str, Any] | None) -> dict[str, Any]:
    """What the certificate records: bytes each way and the kinds left to the driver, with reasons."""
    if not cov:
        return {"reported": False}
    return {"reported": True, "bytes_moved_by_gpucr": cov["bytes_moved_by_gpucr"],
            "bytes_left_to_driver": cov["bytes_left_to_driver"], "left_to_driver": cov.get("left_to_driver", []),
            "not_counted": cov.get("not_counted", "")}
