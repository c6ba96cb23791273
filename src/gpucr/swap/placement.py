"""Where a parked app allowed on any GPU (`gpucr run --swap --any-gpu`, issue 27 item 6) comes back: a pure function of
each GPU's free memory, no I/O. Each GPU's memory is counted apart.

The rule: on its own GPUs when each has room for what the app held there; else each GPU short of room is replaced
by another of the same chip (the driver restores only onto the same chip) that the app does not use, with room, the
one with the most free memory first. When one short GPU finds no such GPU, the app stays on its own (and room is made
there by the policy, as for any app). The answer names every GPU of the app, as the driver's restore wants.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuRoom:
    uuid: str
    name: str           # the chip, as the machine names it
    free: int | None    # bytes free now; None: unknown (never chosen, and never called short)


def place(needs: dict[str, int], gpus: list[GpuRoom]) -> dict[str, str]:
    """{old UUID: new UUID} for each of the app's GPUs (`needs`: its GPUs and the bytes it needs on each), or {} when
    it comes back where it was."""
    by_uuid = {g.uuid: g for g in gpus}
    short = [u for u, n in needs.items() if (g := by_uuid.get(u)) is not None and g.free is not None and g.free < n]
    if not short:
        return {}
    taken = set(needs)
    moves = {u: u for u in needs}
    for u in sorted(short, key=lambda u: -needs[u]):   # the largest need picks first
        fits = [g for g in gpus if g.uuid not in taken and g.name == by_uuid[u].name and g.free is not None
                and g.free >= needs[u]]
        if not fits:
            return {}
        best = max(fits, key=lambda g: (g.free, g.uuid))
        moves[u] = best.uuid
        taken.add(best.uuid)
    return moves
