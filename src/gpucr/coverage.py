"""Coverage: the bytes gpucr's data plane moves and those it leaves to the driver's own checkpoint
(correct, but ~2 GB/s), each kind with its reason. The agent reports it (`coverage` in its status,
native/agent/coverage.c); this module shapes it into the results schema and words it, for
`gpucr status`, `gpucr checkpoint`, `gpucr inspect` and the manifest."""
from __future__ import annotations

import dataclasses
from typing import Any

from .results import Coverage, LeftToDriver, StreamOrdered


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def from_agent(raw: dict[str, Any] | None) -> Coverage | None:
    """The agent's report as a Coverage; None from an agent that does not report it."""
    if not raw:
        return None
    so = raw.get("stream_ordered", {})
    return Coverage(bytes_moved_by_gpucr=int(raw["bytes_moved_by_gpucr"]), bytes_left_to_driver=int(raw["bytes_left_to_driver"]),
                    left_to_driver=[LeftToDriver(kind=e["kind"], bytes=int(e["bytes"]), count=e.get("count"),
                                                 reason=e["reason"]) for e in raw.get("left_to_driver", [])],
                    not_counted=raw.get("not_counted", ""),
                    stream_ordered=StreamOrdered(**{f.name: int(so.get(f.name, 0)) for f in dataclasses.fields(StreamOrdered)}))


def left_summary(left: list[LeftToDriver]) -> str:
    """One clause naming what was left to the driver, by kind: '' when nothing was."""
    parts = [f"{e.kind} {_mib(e.bytes)}" for e in left if e.bytes]
    return f" ({', '.join(parts)})" if parts else ""


def status_lines(cov: Coverage | None) -> list[str]:
    """The lines of `gpucr status` about coverage: what went which way and why."""
    if cov is None:
        return []
    moved, left = cov.bytes_moved_by_gpucr, cov.bytes_left_to_driver
    share = f"{100.0 * moved / (moved + left):.1f} % " if moved + left else ""
    lines = [f"  coverage     {share}of the bytes moved by gpucr ({_mib(moved)}), {_mib(left)} left to the driver"]
    lines += [f"    {e.kind}: {_mib(e.bytes)}" + (f" in {e.count}" if e.count is not None else "") + f": {e.reason}"
              for e in cov.left_to_driver]
    so = cov.stream_ordered
    if so.pools_served or so.pools_left_to_driver:
        lines.append(f"  pools        {so.pools_served} served by gpucr (used {_mib(so.used_bytes)}, reserved "
                     f"{_mib(so.reserved_bytes)}, {so.allocations} allocations, {so.cross_stream_waits} "
                     f"cross-stream waits), {so.pools_left_to_driver} left to the driver")
    lines.append(f"  not counted  {cov.not_counted}")
    return lines


def manifest_entry(raw: dict[str, Any] | None) -> dict[str, Any]:
    """What the certificate records: bytes each way and the kinds left to the driver, with reasons."""
    cov = from_agent(raw)
    if cov is None:
        return {"reported": False}
    return {"reported": True, "bytes_moved_by_gpucr": cov.bytes_moved_by_gpucr, "bytes_left_to_driver": cov.bytes_left_to_driver,
            "left_to_driver": [dataclasses.asdict(e) for e in cov.left_to_driver], "not_counted": cov.not_counted}


def manifest_left(entry: dict[str, Any] | None) -> list[LeftToDriver]:
    """The kinds left to the driver as a manifest recorded them."""
    return [LeftToDriver(**e) for e in (entry or {}).get("left_to_driver", [])]
