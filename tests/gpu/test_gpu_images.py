"""Images on the H200 (issue 4): a >= 20 GiB PyTorch process written to disk with its staging released,
restored byte-exact, and every broken or foreign image refused with the process still restorable.
The disk holds about one such image, so damaged images are made in place and repaired."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

import gpucr
from gpucr.workloads.runner import Workload

from conftest import gpu

pytestmark = [gpu, pytest.mark.gpu]
IMAGE_ROOT = Path(os.environ.get("GPUCR_GPU_IMAGE_DIR", "/var/tmp"))


def rss_shmem(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def refused(pid: int, image: Path, why: str) -> None:
    with pytest.raises(gpucr.GpucrError, match=why):
        gpucr.restore(pid, image=image, timeout=120)
    assert gpucr.status(pid).state == "checkpointed"


def test_large_image_and_every_refusal():
    with tempfile.TemporaryDirectory(dir=IMAGE_ROOT) as tmp, Workload("torch_app", "--gib", "20") as app, \
            Workload("torch_app", "--gib", "1", "--seed", "5") as other:
        tmp = Path(tmp)
        before, result = app.ask("digest"), app.ask("compute")
        gen1 = tmp / "gen1"
        ck = gpucr.checkpoint(app.pid, image=gen1, timeout=120)
        assert ck.image.bytes >= 20 << 30
        assert rss_shmem(app.pid) < 64 << 20, "staging released once the image is on disk"
        data = gen1 / "data.bin"
        m = json.loads((gen1 / "manifest.json").read_text())
        alloc, chunk = next((a, c) for a in m["processes"][0]["data"] for c in a["chunks"] if not c.get("zero"))
        where = alloc["file_offset"] + chunk["offset"] + 4096

        with open(data, "r+b") as f:   # one corrupt byte, then repaired
            f.seek(where); b = f.read(1); f.seek(where); f.write(bytes([b[0] ^ 0x40])); f.flush()
            refused(app.pid, gen1, "does not match its digest")
            f.seek(where); f.write(b)
        size = data.stat().st_size
        with open(data, "r+b") as f:   # truncated, then its tail put back
            f.seek(size - 4096); tail = f.read(4096)
            f.truncate(size - 4096); f.flush()
            refused(app.pid, gen1, "truncated")
            f.seek(size - 4096); f.write(tail)
        (gen1 / "manifest.json").rename(gen1 / "manifest.hidden")
        refused(app.pid, gen1, "no checkpoint manifest")
        (gen1 / "manifest.hidden").rename(gen1 / "manifest.json")
        foreign = tmp / "other"
        gpucr.checkpoint(other.pid, image=foreign, timeout=120)
        refused(app.pid, foreign, f"not of process {app.pid}")

        gpucr.restore(app.pid, image=gen1, timeout=120)
        assert app.ask("digest") == before and app.ask("compute") == result
        gpucr.checkpoint(app.pid, timeout=120)   # generation 2, in memory
        refused(app.pid, gen1, "stale image")
        gpucr.restore(app.pid, timeout=120)
        assert app.ask("digest") == before
        gpucr.restore(other.pid, image=foreign, timeout=120)
