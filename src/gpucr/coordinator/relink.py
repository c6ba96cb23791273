"""Memory shared between processes: checked to be checkpointed whole, and relinked after a restore (each exporter
exports again, each importer maps it at its old addresses); an exporter that died leaves zeroed memory instead."""
from __future__ import annotations

import os
import time
from typing import Any

from .. import sharing
from .. import proc
from .. import target as targets
from ..errors import GpucrError
from .members import PhaseError, _Member


def _relink(restoring: list[_Member], shared_before: dict[int, list[dict[str, Any]]], sources: list[_Member]) -> None:
    """Every importer's unlinked memory mapped again from its exporter, named by key."""
    wanted: dict[int, list[_Member]] = {}   # key -> importers waiting for it
    owners: dict[int, int] = {}
    for m in restoring:
        for o in shared_before[m.pid]:
            if o["role"] == "importer" and o.get("unlinked", True) and o.get("key"):
                wanted.setdefault(o["key"], []).append(m)
                owners[o["key"]] = o.get("owner", 0)
    if not wanted:
        return
    by_key = {o["key"]: m for m in sources if not proc.process_ended(m.pid)
              for o in m.status.get("shared", []) if o["role"] == "exporter"}
    outside: dict[int, Any] = {}
    try:
        for key, importers in wanted.items():
            exp_pid, exp = (by_key[key].pid, by_key[key].agent) if key in by_key else (owners[key], None)
            if exp is None:   # an exporter running outside this restore (it never stopped): ask it directly
                if not exp_pid or proc.process_ended(exp_pid):
                    continue  # gone: _orphans deals with it
                try:
                    if exp_pid not in outside:
                        outside[exp_pid] = targets.resolve(exp_pid).connect()
                    exp = outside[exp_pid]
                except GpucrError as exc:
                    raise PhaseError(importers[0].pid, f"relink of memory shared by process {exp_pid}", exc) from exc
            try:
                _reply, fds = exp.call_with_fds("export", timeout=60.0, key=key)
            except GpucrError as exc:
                raise PhaseError(exp_pid, "re-export of shared memory", exc) from exc
            try:
                for imp in {m.pid: m for m in importers}.values():   # once each: a relink maps every import of the key
                    try:
                        imp.agent.call_sending_fds("relink", fds[:1], timeout=60.0, key=key)
                    except GpucrError as exc:
                        raise PhaseError(imp.pid, "relink of shared memory", exc) from exc
            finally:
                for fd in fds:
                    os.close(fd)
    finally:
        for agent in outside.values():
            agent.close()


def _ends_soon(pid: int, within_s: float = 1.0) -> bool:
    """Whether a process whose agent just failed has ended or ends within a moment: a SIGKILLed
    process closes its sockets a little before it becomes a zombie."""
    deadline = time.monotonic() + within_s
    while not proc.process_ended(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _owner_gone(o: dict[str, Any]) -> bool:
    """Whether the exporter an importer was bound to has ended (pid and start time name it)."""
    return bool(o.get("owner")) and proc.process_ended(o["owner"], o.get("owner_start"))


def _orphans(restoring: list[_Member], shared_before: dict[int, list[dict[str, Any]]]) -> None:
    """Memory a process imported from an exporter that has died (a rank killed mid-checkpoint) can
    never be relinked: the agent puts zeroed memory at those addresses, so the process runs on with
    its own data intact instead of waiting for ever with its gate closed; the result says so."""
    exported = {o["key"] for m in restoring for o in shared_before[m.pid] if o["role"] == "exporter"}
    for m in restoring:
        gone = {o["key"]: o for o in shared_before[m.pid] if o["role"] == "importer" and o.get("unlinked", True)
                and o["key"] not in exported and _owner_gone(o)}
        for key, o in gone.items():
            try:
                out = m.agent.call("orphan", timeout=60.0, key=key)
            except GpucrError as exc:
                raise PhaseError(m.pid, "replacing memory shared by a process that ended", exc) from exc
            m.result.setdefault("warnings", []).append(
                f"{out['bytes'] >> 20} MiB it shared with process {o['owner']}, which ended, were replaced by zeroed memory "
                "at the same addresses (a communicator with that process cannot work again)")


def _check_sharing(members: list[_Member], timeout: float) -> None:
    """Memory shared between processes is checkpointed only with every process that shares it
    (sharing.py says how that is found); importers are given their exporters' keys for the relink."""
    uuids = {d["uuid"] for m in members for d in m.status.get("devices", [])}
    sharing.check_and_bind({m.pid: m.agent for m in members}, members[0].drv, uuids, timeout)
