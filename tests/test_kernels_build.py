"""The checked-in fatbin of gpucr's kernels is the build of today's source: scripts/build-kernels stamps the
source's and the fatbin's sha256 beside it, and this fails, naming the command, when either has changed."""
from __future__ import annotations

import hashlib
from pathlib import Path

from gpucr.dataplane.kernels import FATBIN

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native" / "kernels" / "gpucr_kernels.cu"
STAMP = FATBIN.with_name(FATBIN.name + ".stamp")
REBUILD = "run scripts/build-kernels (it needs nvcc, CUDA 13.0) and commit the fatbin with its stamp"


def stamp() -> dict[str, str]:
    return dict(line.split(" ", 1) for line in STAMP.read_text().splitlines())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_fatbin_was_built_from_todays_source():
    assert stamp()["source-sha256"] == sha256(SOURCE), f"{SOURCE.name} changed since its fatbin was built: {REBUILD}"


def test_the_fatbin_is_the_one_its_stamp_names():
    assert stamp()["fatbin-sha256"] == sha256(FATBIN), f"{FATBIN.name} is not the build its stamp names: {REBUILD}"


def test_the_stamp_says_how_it_was_made_for_every_architecture():
    command = stamp()["command"]
    assert command.startswith("scripts/build-kernels: nvcc ") and "--no-compress" in command   # simcuda reads the names
    for sm in (75, 80, 86, 89, 90, 100, 120):
        assert f"arch=compute_{sm},code=sm_{sm}" in command
    assert "arch=compute_120,code=compute_120" in command   # PTX for GPUs newer than the package
