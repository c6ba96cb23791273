"""One home for each rule the agent (C) and gpucr's controller (Python) both follow (issue 25, item 3):
- the settings (native/agent/settings.def), the runtime dir rules and the UUID text (native/agent/rules.h) are
  data there; gpucr.agent_tables is generated from them (scripts/gen-agent-tables), and no other file holds a copy;
- what is movable and how staging is sized are the agent's alone: Python reads what the agent reports.
Each test fails where a second copy appears, and names the one home."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from gpucr.agent_tables import RUNTIME_DIR_DEFAULT, RUNTIME_DIRS, SETTINGS
from gpucr.driver import uuid_text

from conftest import ROOT

AGENT = ROOT / "native" / "agent"
SRC = ROOT / "src" / "gpucr"
GENERATED = SRC / "agent_tables.py"


def code_of(path: Path) -> str:
    """A source file without its comments (what it does, not what it says)."""
    text = path.read_text()
    if path.suffix != ".py":
        return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
    lines = text.splitlines(keepends=True)
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT:   # a comment ends its line
            row, col = t.start
            lines[row - 1] = lines[row - 1][:col] + "\n"
    return "".join(lines)


def python_code() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): code_of(p) for p in sorted(SRC.rglob("*.py")) if p != GENERATED}


def agent_code(but: str) -> dict[str, str]:
    return {p.name: code_of(p) for p in sorted([*AGENT.glob("*.c"), *AGENT.glob("*.h")]) if p.name != but}


def holders(files: dict[str, str], pattern: str) -> list[str]:
    return [name for name, text in files.items() if re.search(pattern, text)]


def quoted(text: str) -> str:
    return rf"[\"']{re.escape(text)}[\"']"


def test_agent_tables_are_generated_from_todays_agent():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-agent-tables"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_runtime_dir_rules_live_in_rules_h_alone():
    pieces = [quoted(s) for s, _ in RUNTIME_DIRS] + [quoted(x) for _, x in RUNTIME_DIRS if x]
    pieces += [quoted(RUNTIME_DIR_DEFAULT[1]), r"gpucr-(%u|\{[^}]*uid)"]
    for piece in pieces:
        assert not holders(python_code(), piece), f"a copy of the runtime dir rules ({piece}): read agent_tables"
        assert not holders(agent_code("rules.h"), piece), f"a copy of the runtime dir rules ({piece}): use rules.h"
    for setting, _ in RUNTIME_DIRS:   # the agent reads them around its settings table, so they must be in it
        assert not setting.startswith("GPUCR_") or setting in SETTINGS, f"{setting} is not in settings.def"


def test_the_uuid_text_lives_in_rules_h_alone():
    assert uuid_text(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"   # nvidia-smi -L's form
    assert not holders(python_code(), r"GPU-[{%]"), "a copy of the UUID text: use driver.uuid_text"
    assert not holders(agent_code("rules.h"), r"GPU-%|%02x%02x"), "a copy of the UUID text: use GPUCR_UUID_TEXT"


def test_the_cli_holds_no_copy_of_the_agents_settings():
    """`gpucr run` checks the settings it passes on against the agent's table: no word or limit of its own."""
    modules = {name: text for name, text in python_code().items() if name.startswith("src/gpucr/cli/")}
    assert "src/gpucr/cli/args.py" in modules, "the CLI's modules were not found: the test is broken"
    cli = "\n".join(modules.values())
    words = [w for n in ("GPUCR_STAGING", "GPUCR_STAGING_POLICY") for w in SETTINGS[n].accepted.split("|")]
    copies = [w for w in words if w != "file:DIR" and re.search(quoted(w), cli)]
    assert not copies, f"gpucr.cli spells {copies} itself: take them from agent_tables.SETTINGS"
    limit = rf"(?<![\w.]){SETTINGS['GPUCR_GROUP'].hi}(?![\w.])"   # 127.0.0.1 is an address, not the limit
    assert not re.search(limit, cli), "gpucr.cli spells GPUCR_GROUP's limit itself"


def test_what_is_movable_is_the_agents_alone():
    """reg_phys_movable (registry.c) decides; the agent says it per allocation in its memory listing, and Python
    only reads that field."""
    assert holders(agent_code(""), r"\bbool\s+reg_phys_movable\s*\([^;]*\{") == ["registry.c"]
    for name, text in python_code().items():
        for line in text.splitlines():
            said = re.sub(r"\.get\(\"movable\"\)|\.movable\b|\bmovable: bool\b", "", line)
            assert "movable" not in said, f"{name} decides what is movable ({line.strip()}): read the agent's field"


def test_staging_is_sized_by_the_agent_and_made_by_the_plane_alone():
    """staging.c sizes every segment (GPUCR_STAGING_SEGMENT_MIB, whole hugepages) in its plan; the data plane alone
    makes the segments the plan names (dataplane/staging_make.py) and the agent holds them: no C file makes one,
    and no Python module sizes one. The server's staging pool alone reads the setting, to make ahead segments of
    the size an app's plan will name (`gpucr serve --prepare-staging`), and says no rule of its own."""
    python = {name: text for name, text in python_code().items() if name != "src/gpucr/agent_tables.py"}
    readers = holders(python, r"STAGING_SEGMENT")
    assert readers in ([], ["src/gpucr/dataplane/staging_pool.py"]), f"Python sizes staging ({readers}): the agent's plan does"
    assert holders(python, r"memfd_create") == ["src/gpucr/dataplane/staging_make.py"], "staging is made in one place"
    assert not holders(agent_code(""), r"memfd_create\("), "the agent makes staging: the data plane does"
    assert holders(agent_code(""), r"SET_STAGING_SEGMENT_MIB\)") == ["report.c", "staging.c"]
