"""Every setting is parsed strictly (issue 14, item 2): the agent's one table of settings
(native/agent/settings.def, which gpucr.agent_tables is generated from), its one-line warning for a bad value
with the default kept, the CLI's checks of its flags and its own environment, and docs/how-it-works.md held to
the table. Also the bound on
what the controller reads from an application's callback channel (item 10)."""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gpucr
from gpucr import cli, paths
from gpucr.agent_tables import SETTINGS
from gpucr.app import MAX_ANSWER, AppChannel

from conftest import ROOT, gpucr_cli

MiB = 1 << 20
AGENT = ROOT / "native" / "agent"


def agent_stderr(env: dict[str, str]) -> list[str]:
    """What the agent says on stderr when a process loads it with these settings."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUCR_") or k == "GPUCR_RUNTIME_DIR"}
    full.update(env, LD_PRELOAD=str(paths.agent_lib()))
    r = subprocess.run([sys.executable, "-c", "pass"], env=full, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stderr.splitlines() if line.strip()]


# ---- the agent ----

BAD = [
    ("GPUCR_STAGING_SEGMENT_MIB", "abc"),   # was (a ring's size): atol -> 0, silently
    ("GPUCR_STAGING_SEGMENT_MIB", "-5"),
    ("GPUCR_STAGING_SEGMENT_MIB", "64x"),
    ("GPUCR_STAGING_SEGMENT_MIB", "99999999999999999999999"),
    ("GPUCR_STAGING_SEGMENT_MIB", " 64"),
    ("GPUCR_STAGING", "bogus"),
    ("GPUCR_STAGING", "file:"),
    ("GPUCR_STAGING_POLICY", "junk"),
    ("GPUCR_STAGING_SEGMENT_MIB", "1"),
    ("GPUCR_LOG", "true"),
    ("GPUCR_NATIVE_ALLOC", "2"),
    ("GPUCR_MIN_VMM_BYTES", "2M"),
    ("GPUCR_GROUP", "g" * 128),        # was: cut to 127 bytes, silently
    ("GPUCR_HOST_BUDGET", "64GB"),
    ("GPUCR_HOST_BUDGET", "0"),
    ("GPUCR_HOST_BUDGET", "101%"),
    ("GPUCR_HOST_BUDGET", "-1G"),
    ("GPUCR_HOST_BUDGET", "99999999999T"),   # overflows 64 bits
    ("GPUCR_HOST_BUDGET", "1.5G"),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v[:12]}" for n, v in BAD])
def test_agent_warns_in_one_line_about_a_bad_setting(name, value):
    s = SETTINGS[name]
    lines = agent_stderr({name: value})
    assert len(lines) == 1, lines
    line = lines[0]
    shown = value if len(value) <= 64 else f"{value[:64]}... ({len(value)} bytes)"
    assert f"{name}={shown} is not valid" in line, line
    assert f"(accepted: {s.accepted})" in line and f"using the default, {s.default or 'none'}" in line, line


def test_agent_is_quiet_about_good_settings_and_when_disabled():
    good = {"GPUCR_STAGING": "file:/tmp", "GPUCR_STAGING_POLICY": "drop", "GPUCR_STAGING_SEGMENT_MIB": "2",
            "GPUCR_LOG": "0", "GPUCR_MIN_VMM_BYTES": "4096", "GPUCR_GROUP": "g" * 127, "GPUCR_HOST_BUDGET": ""}
    assert agent_stderr(good) == []
    for budget in ("64G", "50%", "100%", "1048576", "3T", "512M", "4K"):
        assert agent_stderr({"GPUCR_HOST_BUDGET": budget}) == [], budget
    assert agent_stderr({"GPUCR_AGENT_DISABLE": "1", "GPUCR_STAGING": "bogus"}) == []


def test_bad_settings_keep_the_defaults(sim_app):
    bad = {"GPUCR_STAGING_SEGMENT_MIB": "abc", "GPUCR_GROUP": "g" * 128, "GPUCR_STAGING": "bogus",
           "GPUCR_STAGING_POLICY": "junk"}
    app = sim_app("--sizes", "16M", env={**os.environ, **bad})
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert st.staging_kind in ("shm", "hugetlbfs"), st.staging_kind
    assert not st.group, "a group name too long is refused, not cut"
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
    assert gpucr.status(app.pid).staging_bytes > 0, "staging kept after the restore (the default policy)"


def test_no_bare_getenv_of_a_setting():
    """Each GPUCR_ setting the agent reads is in settings.def; the files that read through the
    table (staging, logging) have no getenv of their own."""
    for c in AGENT.glob("*.c"):
        for name in re.findall(r'getenv\("(GPUCR_\w+)"\)', c.read_text()):
            assert name in SETTINGS, f"{c.name} reads {name}, which settings.def does not list"
    for name in ("staging.c", "util.c"):
        src = (AGENT / name).read_text()
        assert not re.search(r'getenv\("GPUCR_|gpucr_env_long\("', src), f"{name} reads a setting around the table"


def test_the_docs_list_every_setting_as_the_table_says():
    """The settings table of docs/how-it-works.md and settings.def agree, row for row (GPUCR_TEST_ ones are
    the test suite's own)."""
    rows = {}
    for line in (ROOT / "docs" / "how-it-works.md").read_text().splitlines():
        m = re.match(r"\|\s*`(GPUCR_\w+)`\s*\|(.*)\|(.*)\|(.*)\|\s*$", line.replace("\\|", "\0"))
        if m:
            default, accepted, meaning = (c.strip().replace("\0", "|") for c in m.groups()[1:])
            rows[m[1]] = (default.strip("`"), accepted, meaning)
    want = {n: (s.default or "unset", s.accepted, s.meaning) for n, s in SETTINGS.items()
            if not n.startswith("GPUCR_TEST_")}
    expected_rows = "\n".join(f"| `{n}` | `{d}` | {a.replace('|', chr(92) + '|')} | {m} |" for n, (d, a, m) in want.items())
    assert rows == want, f"docs/how-it-works.md's agent settings table should read:\n{expected_rows}"


# ---- the CLI ----

BAD_ARGS = [
    (["run", "--staging", "bogus", "--", "true"], "--staging"),
    (["run", "--staging", "file:/no/such/dir", "--", "true"], "--staging"),
    (["run", "--staging-policy", "junk", "--", "true"], "--staging-policy"),
    (["run", "--group", "g" * 128, "--", "true"], "--group"),
    (["run", "--group", "", "--", "true"], "--group"),
    (["run", "--host-budget", "64GB", "--", "true"], "--host-budget"),
    (["run", "--host-budget", "0%", "--", "true"], "--host-budget"),
    (["serve", "--simulate", "--host-budget", "1.5G"], "--host-budget"),
    (["checkpoint", "--group", "g" * 128], "--group"),
    (["checkpoint", "--timeout", "soon", "1"], "--timeout"),
    (["checkpoint", "--level", "most", "1"], "--level"),
    (["status", "notapid"], "PID"),
]


@pytest.mark.parametrize("argv,flag", BAD_ARGS, ids=[" ".join(a[:3])[:40] for a, _ in BAD_ARGS])
def test_cli_refuses_a_bad_flag_in_one_line(argv, flag):
    r = gpucr_cli(*argv)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("gpucr: error: argument ") and flag in lines[0], lines[0]


def test_cli_passes_good_flags_on_to_the_agent(tmp_path):
    show = [sys.executable, "-c", "import os; print(os.environ['GPUCR_STAGING'], os.environ['GPUCR_STAGING_POLICY'], "
            "len(os.environ['GPUCR_GROUP']))"]
    (tmp_path / "st").mkdir()
    r = subprocess.run([sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--staging", "file:st", "--staging-policy",
                        "drop", "--group", "g" * 127, "--", *show], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.count("gpucr[") == 0, r.stderr
    assert r.stdout.split() == [f"file:{tmp_path / 'st'}", "drop", "127"], "file:DIR is made absolute"


@pytest.mark.parametrize("argv,word", [(["run", "--bounce", "512"], "--bounce"), (["run", "--staging-ahead"], "--staging-ahead"),
                                       (["run", "--no-staging-ahead"], "--no-staging-ahead"), ([], "GPUCR_BOUNCE_MIB")])
def test_settings_of_the_deleted_in_process_copy_engine_are_said_and_ignored(tmp_path, argv, word):
    """The agent copies nothing any more (issue 25): its ring's and pinning's settings still run, said once."""
    env = {**os.environ, "GPUCR_BOUNCE_MIB": "64"} if not argv else None
    r = subprocess.run([sys.executable, "-m", "gpucr.cli", *(argv or ["run"]), "--simulate", "--no-server", "--", "true"],
                       capture_output=True, text=True, timeout=60, env=env)
    said = [l for l in r.stderr.splitlines() if word in l]
    assert r.returncode == 0 and len(said) == 1 and "has no effect and is ignored" in said[0], r.stderr


def test_no_setting_retired_in_the_cli_is_still_the_agents():
    assert not set(cli.RETIRED_ENV) & set(SETTINGS), "a setting retired in the CLI is still the agent's"


BUDGETS = ["64G", "50%", "100%", "1", "4K", "3T", "16777215T", "16777216T", "0", "0%", "101%", "64GB", "1.5G",
           "-1G", " 64G", "64g", "G", "%"]


def test_cli_and_agent_read_a_budget_alike():
    """`gpucr run --host-budget` takes exactly the GPUCR_HOST_BUDGET values the agent takes."""
    for v in BUDGETS:
        try:
            cli.host_budget(v)
            taken = True
        except argparse.ArgumentTypeError:
            taken = False
        assert taken == (agent_stderr({"GPUCR_HOST_BUDGET": v}) == []), v


def test_a_budget_in_bytes_as_the_server_counts_it():
    from gpucr.sizes import budget_bytes
    assert [budget_bytes(v, mem_total=1000) for v in ("64G", "4K", "1", "50%", "100%")] == [64 << 30, 4096, 1, 500, 1000]
    with pytest.raises(ValueError, match="'64GB' is not a host-memory budget: give bytes, a size with K, M, G or T"):
        budget_bytes("64GB")


@pytest.mark.parametrize("name", cli.CONTROLLER_FLAGS)
def test_cli_checks_its_own_environment(name):
    r = gpucr_cli("ps", env={**os.environ, name: "yes"})
    assert r.returncode != 0 and r.stderr.strip() == \
        f"gpucr: error: {name}=yes is not valid: use 0 or 1 (or leave it unset)"
    assert gpucr_cli("ps", env={**os.environ, name: "1"}).returncode == 0


# ---- what the controller reads from an application (item 10) ----

def _serve_once(path: Path, answer) -> threading.Thread:
    """A stand-in application channel at path that answers one request with answer(conn)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            conn.recv(100)
            try:
                answer(conn)
            except OSError:   # the controller hung up, as it should
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_app_answer_is_bounded(tmp_path):
    sent = [0]

    def flood(conn: socket.socket) -> None:   # an answer that never ends
        while sent[0] < 256 * MiB:
            conn.sendall(b"x" * (1 * MiB))
            sent[0] += 1 * MiB
    t = _serve_once(tmp_path / "a.sock", flood)
    ch = AppChannel(str(tmp_path / "a.sock"))
    with pytest.raises(ValueError, match=f"longer than {MAX_ANSWER} bytes"):
        ch.ask("epoch", 30)
    ch.close()
    t.join(30)
    assert sent[0] < 32 * MiB, "the controller stopped reading at the bound"


def test_app_answer_must_be_an_object_within_the_deadline(tmp_path):
    _serve_once(tmp_path / "b.sock", lambda c: c.sendall(b"[1, 2]\n"))
    with pytest.raises(ValueError, match="not a JSON object"):
        AppChannel(str(tmp_path / "b.sock")).ask("epoch", 10)

    def trickle(conn: socket.socket) -> None:   # a byte at a time, each within the timeout
        for _ in range(40):
            conn.sendall(b" ")
            time.sleep(0.1)
    _serve_once(tmp_path / "c.sock", trickle)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        AppChannel(str(tmp_path / "c.sock")).ask("epoch", 0.5)
    assert time.monotonic() - t0 < 2.0, "the timeout bounds the whole answer, not each byte"
