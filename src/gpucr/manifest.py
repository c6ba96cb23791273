"""The recovery-cut certificate: what a checkpoint covers, and the checks a restore must pass.

A manifest is versioned JSON. It names the checkpoint (id, time, host), the GPU and driver, and per
process its identity (pid and start time), generation (how many checkpoints it has had), its
allocations (which gpucr moved, which it left to the driver), per-chunk digests, the state domains
that joined the cut, and an explicit `unknown` list. A restore proceeds only when every check passes.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from . import coverage
from .errors import GpucrError
from .imagefs import ImageDir

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
            "coverage": coverage.manifest_entry(status.get("coverage")),
            "domains": domains,
            "unknown": unknown,
            "data": allocations,
        }],
    }


def save(idir: ImageDir, manifest: dict[str, Any]) -> None:
    """Write the manifest (mode 0600, like the data) whole or not at all: a temporary file renamed into place."""
    fd, tmp = idir.create(NAME)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        idir.publish(tmp, NAME)
    except BaseException:
        idir.discard(tmp)
        raise


def load(directory: Path | ImageDir, max_bytes: int = 256 << 20) -> dict[str, Any]:
    """Read a manifest through its image directory's fd: never through a link, a hard link or a special file
    (and, given an ImageDir with an owner, only one of that owner)."""
    idir = directory if isinstance(directory, ImageDir) else None
    path = Path(directory.path if idir else directory) / NAME
    try:
        if idir is None:
            with ImageDir(Path(directory)) as own:
                m = _read_json(own, max_bytes)
        else:
            m = _read_json(idir, max_bytes)
    except FileNotFoundError:
        raise GpucrError(f"{path.parent} holds no checkpoint manifest ({NAME} is missing); nothing there can be trusted") from None
    except (OSError, ValueError) as exc:
        raise GpucrError(f"the manifest {path} cannot be read ({exc}); the image cannot be trusted") from exc
    if not isinstance(m, dict) or m.get("version") != VERSION or not m.get("processes"):
        raise GpucrError(f"the manifest {path} is not a gpucr manifest of version {VERSION}")
    _rename_old_keys(m.get("image"))
    return m


OLD_IMAGE_KEYS = {"seconds": "transfer_s", "gb_per_s": "gbps"}   # as results name them (written before issue 24)


def _rename_old_keys(image: Any) -> None:
    """An older manifest's image statistics, under today's names."""
    if isinstance(image, dict):
        for old, new in OLD_IMAGE_KEYS.items():
            if old in image and new not in image:
                image[new] = image.pop(old)


def cuda_version(v: int) -> str:
    """The driver's CUDA version as people write it: 13000 -> 13.0."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _read_json(idir: ImageDir, max_bytes: int) -> Any:
    fd = idir.open_read(NAME)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes >> 20} MiB")
    return json.loads(raw)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_coverage(allocations: Any) -> None:
    """The certificate covers every byte exactly: each allocation's chunks tile [0, bytes) with no gap and
    no overlap, and the allocations tile the data file the same way. Raises naming the first fault."""
    if not isinstance(allocations, list):
        raise GpucrError("refused: the manifest's allocation list is malformed")
    foff = 0
    for a in allocations:
        if not isinstance(a, dict) or not all(_int(a.get(k)) for k in ("va", "bytes", "file_offset")) \
                or not isinstance(a.get("chunks"), list):
            raise GpucrError("refused: the manifest has a malformed allocation record")
        if a["file_offset"] != foff:
            raise GpucrError(f"refused: allocation {a['va']:#x} starts at {a['file_offset']:#x} of the data file, "
                             f"not {foff:#x}: the manifest does not cover the data file exactly")
        end = 0
        for c in sorted(a["chunks"], key=lambda c: c.get("offset", -1) if isinstance(c, dict) else -1):
            if not isinstance(c, dict) or not _int(c.get("offset")) or not _int(c.get("bytes")) or c["bytes"] == 0:
                raise GpucrError(f"refused: allocation {a['va']:#x} has a malformed chunk record")
            if c["offset"] != end:
                what = "a gap" if c["offset"] > end else "an overlap"
                raise GpucrError(f"refused: the chunks of allocation {a['va']:#x} leave {what} at {min(end, c['offset']):#x}: "
                                 "the manifest does not cover every byte exactly")
            if not c.get("zero") and not isinstance(c.get("xxh3_64"), str):
                raise GpucrError(f"refused: chunk {c['offset']:#x} of allocation {a['va']:#x} has no digest")
            end = c["offset"] + c["bytes"]
        if end != a["bytes"]:
            raise GpucrError(f"refused: the chunks of allocation {a['va']:#x} cover {end} of its {a['bytes']} bytes: "
                             "the manifest does not cover every byte exactly")
        foff += a["bytes"]


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
    check_coverage(entry.get("data"))
    if entry["unknown"] and not force:
        raise GpucrError(f"refused: the checkpoint does not cover everything ({'; '.join(entry['unknown'])}); "
                         "use --force to restore anyway")
    return entry
