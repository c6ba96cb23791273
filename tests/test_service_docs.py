"""docs/api.md's curl examples run as written (issue 29): against `gpucr serve --http 127.0.0.1:0` on simcuda with a
swap app named `chat`, in bash, each answer checked. `gpucr` on the PATH is this checkout's (a shim of
`python -m gpucr.cli`); curl is the system's (under CI=true it must be there: .ci/run installs it)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_swap
from test_swap import _until

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
END = "<<<gpucr-docs-test>>>"


@pytest.fixture
def server_args() -> list[str]:
    return ["--http", "127.0.0.1:0"]


def curl_examples() -> list[str]:
    """The commands of the sh block under docs/api.md's "### With curl", one a line."""
    section = DOC.read_text().split("### With curl\n", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "docs/api.md's curl section has no sh block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def run_as_written(commands: list[str], tmp_path: Path) -> list[str]:
    """Each command's output, the commands run one after another in one bash (the first sets the variables)."""
    if shutil.which("curl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("curl is missing: .ci/run installs it")
        pytest.skip("needs curl")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "gpucr"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m gpucr.cli "$@"\n')
    shim.chmod(0o755)
    script = "set -eo pipefail\n" + "".join(f"{c}\necho; echo '{END}'\n" for c in commands)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    outs = [o.strip() for o in r.stdout.split(END)]
    assert len(outs) == len(commands) + 1, r.stdout
    return outs[:-1]


def _switches_2(out: str) -> bool:
    return [s["direction"] for s in json.loads(out)["switches"]] == ["park", "resume"]


def _metrics(out: str) -> bool:
    lines = out.splitlines()
    return len(lines) == 2 and all(re.fullmatch(r'gpucr_app_switches_total\{.*app="chat".*\} 1\.0', x) for x in lines)


# each example, in the doc's order: what its command says, and what its answer must be
EXPECTED = [
    (r"^eval ", lambda out: out == ""),
    (r"--unix-socket .*/health$", lambda out: json.loads(out)["status"] == "ok"),
    (r"--unix-socket .*/apps/chat$", lambda out: json.loads(out)["name"] == "chat"),
    (r"Bearer .*/gpus\"$", lambda out: json.loads(out)["gpus"][0]["apps"]["chat"] > 0),
    (r"-X POST .*/chat/park\"$", lambda out: json.loads(out)["state"] == "parked"),
    (r"-X POST .*/chat/resume\"$", lambda out: json.loads(out)["state"] == "resident"),
    (r"-X PATCH .*/apps/chat\"$", lambda out: (json.loads(out)["priority"], json.loads(out)["idle_park_s"]) == (5, 600)),
    (r"/switches\?limit=2\"$", _switches_2),
    (r"/metrics\" \| grep", _metrics),
]


def test_the_curl_examples_of_docs_api_md_work_as_written(swap_server, swap_app, tmp_path):
    swap_app("chat").ask("work 1")
    _until("chat is registered with its memory", lambda: (a := swap_server.info()["swap"]) and sum(
        a[0]["held_bytes"].values()) > 0)
    commands = curl_examples()
    assert len(commands) == len(EXPECTED) and all(re.search(p, c) for c, (p, _) in zip(commands, EXPECTED)), commands
    for command, out, (_p, good) in zip(commands, run_as_written(commands, tmp_path), EXPECTED):
        assert good(out), (command, out)
