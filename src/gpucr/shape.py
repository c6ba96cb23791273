"""What the agents answer and the coordinator measured, made into results' dataclasses. The one
place that knows both the agent's status keys (native/agent/report.c) and the schema's fields, so
the coordinator keeps its working dicts and builds results only at its edges."""
from __future__ import annotations

from typing import Any

from . import coverage, gpus
from .results import (Allocations, GpuMemoryChange, GpuStatus, ImageTransfer, LastCycle, MemoryCgroup, ProcessCheckpoint,
                      ProcessRestore, ProcessStatus, SharedMemory)

MS = 1e-3   # the agent times in milliseconds; results say seconds


def _seconds(ms: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) * MS for k, v in ms.items()}


def gpu_changes(before: dict[str, gpus.Usage], after: dict[str, gpus.Usage]) -> list[GpuMemoryChange]:
    """Every GPU seen before or after, in that order."""
    out = []
    for uuid in [*before, *(u for u in after if u not in before)]:
        b, a = before.get(uuid), after.get(uuid)
        name = (a or b).name
        total = (a.total if a else None) or (b.total if b else None)
        out.append(GpuMemoryChange(uuid=uuid, name=name, process_before_bytes=b.process if b else None,
                                   process_after_bytes=a.process if a else None,
                                   gpu_used_before_bytes=b.used if b else None,
                                   gpu_used_after_bytes=a.used if a else None, gpu_total_bytes=total,
                                   server_made_before_bytes=b.server_made if b else 0,
                                   server_made_after_bytes=a.server_made if a else 0,
                                   server_before_bytes=b.server if b else None,
                                   server_after_bytes=a.server if a else None))
    return out


def image(raw: dict[str, Any] | None, where: str, image_id: str | None) -> ImageTransfer | None:
    """image.write's or image.read's statistics."""
    if raw is None:
        return None
    return ImageTransfer(dir=where, id=image_id, bytes=raw["bytes"], bytes_written=raw.get("bytes_written"),
                         bytes_read=raw.get("bytes_read"), transfer_s=float(raw["transfer_s"]), gbps=raw["gbps"],
                         direct_io=bool(raw["direct_io"]), bytes_zeroed=raw.get("bytes_zeroed"))


def checkpoint(r: dict[str, Any], changes: list[GpuMemoryChange]) -> ProcessCheckpoint:
    im = r.get("image")
    return ProcessCheckpoint(pid=r["pid"], state=r["state"], level=r["level"], generation=r["generation"],
                             bytes_moved=r["bytes_moved"], bytes_left_to_driver=r["bytes_left_to_driver"],
                             phases_s=dict(r["phases_s"]), agent_phases_s=_seconds(r.get("agent_ms", {})),
                             gpus=changes, image=image(im, im["dir"], im["id"]) if im else None,
                             warnings=list(r.get("warnings", [])), coverage=coverage.from_agent(r.get("coverage")),
                             routes=dict(r.get("routes", {})), data_plane=r.get("data_plane", "agent"),
                             bytes_zero_skipped=r.get("bytes_zero_skipped", 0),
                             bytes_unchanged_skipped=r.get("bytes_unchanged_skipped", 0), scanned=bool(r.get("scanned", False)),
                             bytes_scanned=r.get("bytes_scanned", 0), staging_lent_bytes=r.get("staging_lent_bytes", 0),
                             staging_made_bytes=r.get("staging_made_bytes", 0))


def restore(r: dict[str, Any], changes: list[GpuMemoryChange], moved: dict[str, str],
            image_dir: str | None) -> ProcessRestore:
    return ProcessRestore(pid=r["pid"], state=r["state"], bytes_moved=r.get("bytes_moved", 0),
                          phases_s=dict(r["phases_s"]), agent_phases_s=_seconds(r.get("agent_ms", {})),
                          gpus=changes, moved={o: n for o, n in moved.items() if o != n},
                          image=image(r.get("image"), image_dir or "", r.get("image_id")),
                          warnings=list(r.get("warnings", [])), routes=dict(r.get("routes", {})),
                          data_plane=r.get("data_plane", "agent"), checked=bool(r.get("checked", False)),
                          chunks_checked=r.get("chunks_checked", 0), bytes_zeroed=r.get("bytes_zeroed", 0))


def process_status(st: dict[str, Any], now: dict[str, gpus.Usage]) -> ProcessStatus:
    """The agent's status (with what the coordinator added: driver_state, level, cmd, start_time,
    certificate) and each GPU's memory now."""
    al = st.get("allocations", {})
    cyc = st.get("last_cycle_ms", {})
    gpu_rows = []
    for d in st.get("devices", []):
        u = now.get(d["uuid"])
        gpu_rows.append(GpuStatus(ordinal=d["ordinal"], uuid=d["uuid"], name=u.name if u else "unknown",
                                  vmm_bytes=d.get("vmm_bytes", 0), driver_bytes=d.get("driver_bytes", 0),
                                  process_bytes=u.process if u else None, gpu_used_bytes=u.used if u else None,
                                  gpu_total_bytes=u.total if u else None))
    counts = ("tracked", "tracked_bytes", "converted", "app_vmm", "vmm_left_to_driver", "vmm_left_to_driver_bytes",
              "native", "native_bytes", "pool", "pool_bytes", "managed", "managed_bytes", "ipc_exports",
              "not_exportable", "pieces", "own_fds", "fd_limit")
    times = ("gate", "sync", "release")
    return ProcessStatus(
        pid=st["pid"], state=st["state"], phase=st.get("phase", ""), level=st.get("level"),
        driver_state=st.get("driver_state"),
        cmd=st.get("cmd", ""), start_time=st["start_time"], cuda=bool(st.get("cuda")),
        simulated=bool(st.get("simulated")), group=st.get("group", ""), busy=bool(st.get("busy")),
        rolling_back=bool(st.get("rolling_back")), committed=bool(st.get("committed")),
        gate_closed=bool(st.get("gate_closed")), checkpoint_phase=st.get("checkpoint_phase", ""), staged=bool(st.get("staged")),
        generation=st.get("generation", 0), allocations=Allocations(**{k: int(al.get(k, 0)) for k in counts}),
        bytes_left_to_driver=st.get("bytes_left_to_driver", 0), gpus=gpu_rows,
        staging_kind=st.get("staging", ""), staging_bytes=st.get("staging_bytes", 0),
        staging_segments=st.get("staging_segments", 0),
        last_cycle=LastCycle(**{f"{k}_s": float(cyc.get(k, 0.0)) * MS for k in times},
                             bytes_out=int(cyc.get("bytes_out", 0))),
        refusal=st.get("refusal") or None,
        shared=[SharedMemory(role=s["role"], key=s.get("key", 0), bytes=s["bytes"], unlinked=bool(s.get("unlinked")),
                             open_fds=s.get("open_fds", 0), owner=s.get("owner") or None)
                for s in st.get("shared", [])],
        certificate=st.get("certificate"), coverage=coverage.from_agent(st.get("coverage")),
        host_budget_bytes=st.get("host_budget_bytes") or None, host_budget_used_bytes=st.get("host_budget_used_bytes", 0),
        memory_cgroup=MemoryCgroup(**st["memory_cgroup"]) if st.get("memory_cgroup") else None)
