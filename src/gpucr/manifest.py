"""The recovery-cut certificate: what a checkpoint covers, and the checks a restore must pass.

A manifest is versioned JSON. It names the checkpoint (id, time, host), the GPU and driver, and per
process its identity (pid and start time), generation (how many checkpoints it has had), its
allocations (which gpucr moved, which it left to the driver), per-chunk digests, the state domains
that joined the cut, and an explicit `unknown` list. A restore proceeds only when every check passes.
"""
from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from .errors import GpucrError

VERSION = 1
NAME = "manifest.json"


def build(*, pid: int, start_time: int, generation: int, level: str, gpus: list[dict[str, Any]], driver_version: int,
          status: dict[str, Any], allocations: list[dict[str, Any]], epoch: int | None,
          simulated: bool) -> dict[str, Any]:
    al = status.get("allocations", {})
    domains = {"cuda_data": "covered", "cuda_control": "covered" if level == "full" else "left in the process (level data)",
               "app_epoch": epoch if epoch is not None else "unknown"}
    unknown = []
    if status.get("refusal"):
        unknown.append(status["refusal"])
    return {
        "version": VERSION,
        "id": str(uuid.uuid4()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        # the GPUs the process ran on (by UUID, with the controller's name for each); "gpu" is the first
        "gpu": {k: gpus[0][k] for k in ("name", "uuid")} if gpus else {"name": "unknown", "uuid": "unknown"},
        "gpus": gpus,
        "driver_version": driver_version,
        "simulated": simulated,
        "level": level,
        "processes": [{
            "pid": pid,
            "start_time": start_time,
            "generation": generation,
            "allocations": {
                "count": len(allocations),
                "bytes": sum(a["bytes"] for a in allocations),
                "moved_by_gpucr": len(allocations),
                "left_to_driver": al.get("native", 0) + al.get("pool", 0) + al.get("vmm_left_to_driver", 0),
                "left_to_driver_bytes": status.get("bytes_left_to_driver", 0),
            },
            "domains": domains,
            "unknown": unknown,
            "data": allocations,
        }],
    }


def save(directory: Path, manifest: dict[str, Any]) -> None:
    tmp = directory / (NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(directory / NAME)   # a manifest is either whole or absent


def load(directory: Path) -> dict[str, Any]:
    path = Path(directory) / NAME
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise GpucrError(f"{directory} holds no checkpoint manifest ({NAME} is missing); nothing there can be trusted") from None
    except (OSError, ValueError) as exc:
        raise GpucrError(f"the manifest {path} cannot be read ({exc}); the image cannot be trusted") from exc
    if not isinstance(m, dict) or m.get("version") != VERSION or not m.get("processes"):
        raise GpucrError(f"the manifest {path} is not a gpucr manifest of version {VERSION}")
    return m


def check_restore(m: dict[str, Any], *, pid: int, start_time: int, generation: int, gpus: list[dict[str, Any]],
                  force: bool) -> dict[str, Any]:
    """The checks before anything is re-created; returns the process's entry, or raises naming the check."""
    entry = next((p for p in m["processes"] if p["pid"] == pid), None)
    if entry is None:
        owners = ", ".join(str(p["pid"]) for p in m["processes"])
        raise GpucrError(f"refused: the image is of process {owners}, not of process {pid}")
    if entry["start_time"] != start_time:
        raise GpucrError(f"refused: the image is of an earlier process that had pid {pid} (start time differs)")
    if entry["generation"] != generation:
        raise GpucrError(f"refused: stale image: it holds checkpoint {entry['generation']} of process {pid}, "
                         f"which is at checkpoint {generation}")
    taken = sorted(g["name"] for g in m.get("gpus", [m["gpu"]]))
    now = sorted(g["name"] for g in gpus)
    if taken and now and taken != now:
        raise GpucrError(f"refused: the image was taken on {' + '.join(taken)}, the process would be restored onto "
                         f"{' + '.join(now)} (the driver needs the same chips)")
    if entry["unknown"] and not force:
        raise GpucrError(f"refused: the checkpoint does not cover everything ({'; '.join(entry['unknown'])}); "
                         "use --force to restore anyway")
    return entry
