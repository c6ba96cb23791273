"""A process's staging layout as the mover reads it: the process is not trusted, so every allocation must lie
inside a segment it declares."""
from __future__ import annotations

from typing import Any

from ..errors import GpucrError


def checked_plan(layout: Any) -> tuple[dict[int, int], list[tuple[int, int, int, int]]]:
    """The process's staging segments ({index: bytes}) and allocations [(index, bytes, segment, offset)],
    sorted; the process is not trusted: each allocation of a positive size inside a segment it has."""
    try:
        return _plan_of(layout)
    except (KeyError, TypeError, ValueError) as exc:
        raise GpucrError(f"the process's layout is malformed ({type(exc).__name__}: {exc})") from exc


def _plan_of(layout: dict[str, Any]) -> tuple[dict[int, int], list[tuple[int, int, int, int]]]:
    declared = {int(g["index"]): int(g["bytes"]) for g in layout["segments"]}
    plan = sorted((int(a["index"]), int(a["bytes"]), int(a["segment"]), int(a["offset"])) for a in layout["allocations"])
    for idx, size, seg, off in plan:
        if seg not in declared or size <= 0 or off < 0 or off + size > declared[seg]:
            raise GpucrError(f"the process's layout puts allocation {idx} outside its staging")
    return declared, plan


def reach(plan: list[tuple[int, int, int, int]]) -> dict[int, int]:
    """What of each segment a copy needs pinned: as far as its allocations reach."""
    out: dict[int, int] = {}
    for _idx, size, seg, off in plan:
        out[seg] = max(out.get(seg, 0), off + size)
    return out
