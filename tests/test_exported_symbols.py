"""The symbols libgpucr.so exports, held to a checked-in list (issue 25, "pins while moving"): the C agent
is cut into new files while it shrinks, and an application links against none of that, only against these
names. A move that changes them by accident fails here; one that changes them on purpose updates the list:

    PYTHONPATH=src python3 tests/test_exported_symbols.py     # rewrites tests/golden/libgpucr.symbols
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpucr import paths

GOLDEN = Path(__file__).resolve().parent / "golden" / "libgpucr.symbols"
UPDATE = f"PYTHONPATH=src python3 tests/{Path(__file__).name}"


def exported(lib: Path) -> list[str]:
    """`TYPE NAME` of each symbol the library defines and exports, sorted by name (addresses left out:
    they move with any change of code)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted((" ".join(line.split()[-2:]) for line in out.splitlines() if line.strip()),
                  key=lambda s: s.split()[1])


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils) to list the agent's symbols")
def test_exported_symbols_are_the_checked_in_list():
    got, want = exported(paths.agent_lib()), GOLDEN.read_text().splitlines()
    added, gone = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not added and not gone, (f"libgpucr.so exports other symbols than {GOLDEN.name} lists (added {added}, "
                                    f"gone {gone}); if that is on purpose, run '{UPDATE}' and commit the list")


if __name__ == "__main__":
    GOLDEN.write_text("\n".join(exported(paths.agent_lib())) + "\n")
    print(f"wrote {len(GOLDEN.read_text().splitlines())} symbols to {GOLDEN}", file=sys.stderr)
