"""No source file of gpucr over 650 lines (issue 25): a file that long does several jobs. Tests, simcuda
(a test double) and the .def tables (one line per entry point or setting) are left out."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 650
SOURCES = [(ROOT / "src" / "gpucr", ("*.py", "*.c", "*.h")), (ROOT / "native" / "agent", ("*.c", "*.h"))]

# The files over the limit today, each with its length today as its ceiling: each may shrink, none may
# grow. Issue 25 is done when this list is empty; a file that comes down to the limit leaves it.
OVER_TODAY = {
    "src/gpucr/cli.py": 781,
}


def line_counts() -> dict[str, int]:
    counts = {}
    for base, patterns in SOURCES:
        for pattern in patterns:
            for f in base.rglob(pattern):
                counts[f.relative_to(ROOT).as_posix()] = len(f.read_text(errors="replace").splitlines())
    return counts


def test_no_file_over_the_limit_or_over_its_ceiling():
    counts = line_counts()
    assert len(counts) > 50, "the scan found too few files: it is broken"
    grew = {f: f"{n} lines, ceiling {OVER_TODAY[f]}" for f, n in counts.items() if f in OVER_TODAY and n > OVER_TODAY[f]}
    new = {f: n for f, n in counts.items() if f not in OVER_TODAY and n > LIMIT}
    assert not grew, f"these files grew past their ceiling: {grew}; split them, never raise a ceiling"
    assert not new, f"these files are over {LIMIT} lines: {new}; split each into files that do one job"


def test_the_list_of_files_over_the_limit_only_shrinks():
    counts = line_counts()
    done = sorted(f for f in OVER_TODAY if counts.get(f, 0) <= LIMIT)
    assert not done, (f"{done} are at most {LIMIT} lines now (or gone): take them out of OVER_TODAY in "
                      f"{Path(__file__).name}, so that they stay so")
