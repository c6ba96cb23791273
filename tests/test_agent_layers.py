"""No circle among the agent's files (issue 25): each .c file of native/agent depends only on files below it. A
file depends on another when its code calls a function, takes the address of one or uses a global variable that
the other defines. The sources are read as the compiler sees them (gcc -E): macros expanded, so a name the
table of entry points only turns into a string is no use of it, and a wrapper a macro defines is defined."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

AGENT = ROOT / "native" / "agent"
USE = re.compile(r"(?<![\w.>])([A-Za-z_]\w*)")   # a name, not a member (.x, ->x)


def preprocessed(c: Path) -> str:
    out = subprocess.run(["gcc", "-E", "-P", "-D_GNU_SOURCE", f"-I{AGENT}", str(c)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', out.stdout)      # strings: no uses
    return re.sub(r"'(?:[^'\\\n]|\\.)*'", "0", text)


def top_level(text: str) -> tuple[dict[str, str], str]:
    """The names a file defines at its top level ({name: 'function' | 'variable'}, static ones left out), and the
    text of its function bodies and initialisers, where its uses are (a type's body holds none)."""
    defined: dict[str, str] = {}
    uses: list[str] = []
    depth, start, body_start, keep = 0, 0, 0, False
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                head = text[start:i]
                var = re.search(r"\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*=\s*$", head)
                call = re.search(r"\b([A-Za-z_]\w*)\s*\((?:[^()]|\([^()]*\))*\)\s*$", head)
                keep = bool(var or call) and not re.search(r"\btypedef\b", head) and not (
                    not var and re.search(r"\b(struct|union|enum)\b[^()]*$", head))
                if keep and not re.search(r"\bstatic\b", head):
                    defined[(var or call)[1]] = "variable" if var else "function"
                body_start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                if keep:
                    uses.append(text[body_start:i + 1])
                start = i + 1
        elif ch == ";" and depth == 0:
            stmt = text[start:i]
            if not re.search(r"\b(static|extern|typedef|struct|union|enum)\b", stmt) and "(" not in stmt:
                m = re.search(r"\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*(?:=(.*))?$", stmt, re.S)
                if m:
                    defined[m[1]] = "variable"
                    uses.append(m[2] or "")
            start = i + 1
    return defined, "\n".join(uses)


def dependencies() -> dict[str, set[str]]:
    files = {c.stem: top_level(preprocessed(c)) for c in sorted(AGENT.glob("*.c"))}
    owner: dict[str, str] = {}
    for stem, (defined, _) in files.items():
        for name in defined:
            owner[name] = stem if name not in owner else ""   # defined twice (a header's inline): nobody's
    deps = {stem: set() for stem in files}
    for stem, (_, uses) in files.items():
        for name in set(USE.findall(uses)):
            if owner.get(name) and owner[name] != stem:
                deps[stem].add(owner[name])
    return deps


def circles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in deps[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in deps:
        if v not in index:
            visit(v)
    return out


needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc, which reads the agent's sources as it compiles them")


@needs_gcc
def test_the_agent_has_no_circle_among_its_files():
    deps = dependencies()
    assert len(deps) >= 15 and deps["channel"] >= {"dataplane", "registry"}, "the reading found too little: it is broken"
    found = circles(deps)
    why = "; ".join(f"{a} -> {b}" for group in found for a in group for b in sorted(deps[a]) if b in group)
    assert not found, f"files that depend on each other in a circle: {found} ({why}); move what both need below both"


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
