"""Staging for a process, before its data moves: the agent says what it lacks (its status's staging_plan, by the
first-fit rule it places allocations with), the data plane makes it within the one host budget, and the agent holds
it (`hold`). Asked only when staging must grow, so a cycle that reuses its staging adds no request."""
from __future__ import annotations

import os
import time
from typing import Any

from .. import paths
from ..errors import GpucrError
from ..plane import DataPlane, MadeStaging, StagingAsk
from .members import _Member

HOLD_BATCH = 63       # the agent takes 64 fds with a request (verbs.h MAX_IN_FDS): the segments, then the entry
NO_ROOM = "staging has no room"   # the agent's refusal when an allocation has no place (dataplane.c place_in_staging)


def staging_ask(m: _Member, status: dict[str, Any]) -> StagingAsk | None:
    """What the agent's status asks the plane to make, None when its staging holds a place for everything."""
    plan = status.get("staging_plan") or {}
    add = [int(n) for n in plan.get("add", [])]
    if not add and not plan.get("replace"):
        return None
    entry = paths.ledger_entry(m.t.socket.name)
    if entry is None:
        raise GpucrError(f"process {m.pid}'s agent socket {m.t.socket.name} does not name its pid and pid namespace")
    settings = status.get("staging_settings") or {}
    return StagingAsk(pid=m.pid, ledger_dir=m.t.socket.parent, entry=entry, add=add,
                      replace=bool(plan.get("replace")), held_memory=int(status.get("staging_memory_bytes", 0)),
                      staging=str(settings.get("staging", "auto")), host_budget=str(settings.get("host_budget", "")),
                      cgroup_root=str(settings.get("test_cgroup_root", "")))


def provide_staging(m: _Member, plane: DataPlane, status: dict[str, Any] | None = None) -> None:
    """Staging made by the plane and held by m's agent, when its status (m.status unless given) says it lacks
    some; GpucrError (the plane's one-line refusal, nothing made) when the host budget or memory says no."""
    ask = staging_ask(m, m.status if status is None else status)
    if ask is None:
        return
    t0 = time.perf_counter()
    made = plane.make_staging(ask)
    try:
        _hand_to_agent(m, made, ask.replace)
    finally:
        for fd in made.fds + ([made.entry] if made.entry is not None else []):
            os.close(fd)
    m.result.setdefault("phases_s", {})["staging"] = time.perf_counter() - t0
    m.result["staging_lent_bytes"] = m.result.get("staging_lent_bytes", 0) + made.lent
    m.result["staging_made_bytes"] = m.result.get("staging_made_bytes", 0) + made.made


def _hand_to_agent(m: _Member, made: MadeStaging, replace: bool) -> None:
    """The segments held by the agent, HOLD_BATCH fds a request: the first request gives back what it held (replace)
    and carries the ledger entry last."""
    entry = [made.entry] if made.entry is not None else []
    first = made.fds[:HOLD_BATCH - len(entry)]
    m.agent.call_sending_fds("hold", first + entry, timeout=60.0, replace=int(replace), entry=len(entry))
    rest = made.fds[len(first):]
    for k in range(0, len(rest), HOLD_BATCH):
        m.agent.call_sending_fds("hold", rest[k:k + HOLD_BATCH], timeout=60.0, replace=0, entry=0)


def refused_for_room(exc: GpucrError) -> bool:
    """Whether the agent refused a handover or stage because an allocation made since its staging was planned
    has no place (then: ask its status again, provide, retry once)."""
    return NO_ROOM in str(exc)
