"""No source file of gpucr over 650 lines (issue 25): a file that long does several jobs. Tests, simcuda
(a test double) and the .def tables (one line per entry point or setting) are left out."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 650
SOURCES = [(ROOT / "src" / "gpucr", ("*.py", "*.c", "*.h")), (ROOT / "native" / "agent", ("*.c", "*.h"))]


def line_counts() -> dict[str, int]:
    counts = {}
    for base, patterns in SOURCES:
        for pattern in patterns:
            for f in base.rglob(pattern):
                counts[f.relative_to(ROOT).as_posix()] = len(f.read_text(errors="replace").splitlines())
    return counts


def test_no_file_over_the_limit():
    counts = line_counts()
    assert len(counts) > 50, "the scan found too few files: it is broken"
    over = {f: n for f, n in counts.items() if n > LIMIT}
    assert not over, f"these files are over {LIMIT} lines: {over}; split each into files that do one job"
