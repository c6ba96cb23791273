"""Every command block of the README, run as written (issue 25, item 5). Each fenced bash/sh/console block
is one of three kinds, and a block of none of them fails here until this file says how to check it:

- set-up: the two scripts that set up a fresh machine. Each is checked, not run in full: its set-up as a dry
  run (a real one installs into this machine's Python or a .venv) and the command it then runs with --help
  (scripts/test runs this suite, this file among them: running it here would recurse).
- a session, pasted into a shell as it is (it uses `$!`): run by bash in a fresh temp dir, on simcuda.
- a synopsis, one command a line with PLACEHOLDERS (PID, DIR, CMD): every line must parse with gpucr's own
  parser; then the lines are run in order as one session, the placeholders standing for a process started
  by the block's own `gpucr run` line, an image dir and a results file. As written, the lines that take a
  driver of their own need a GPU: that run skips without one, and the run on simcuda gives those lines the
  --simulate each takes. `gpucr bench` (minutes, with torch and the peer) and the foreground `gpucr serve`
  are parsed only.

Everything this runs sees README_BLOCK_ENV set, and this file skips itself under it: nothing a block starts
can run these tests again."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpucr
from gpucr import cli

from conftest import ROOT, gpucr_cli, nvidia_gpu, user_env

README = ROOT / "README.md"
README_BLOCK_ENV = "GPUCR_TEST_README_BLOCK"
BLOCK_TIMEOUT_S = 180
pytestmark = pytest.mark.skipif(os.environ.get(README_BLOCK_ENV) == "1",
                                reason="needs to run outside a README block (one of them runs the test suite)")

# the commands that take a driver of their own: as written they need the CUDA driver and a GPU (the others
# act through the driver their target process runs on)
OWN_DRIVER = ("gpucr run", "gpucr serve", "gpucr doctor", "gpucr recover", "gpucr bench",
              "python3 -m gpucr.bench.alloc_rate")
# parsed, never run: a bench takes minutes and needs torch and the peer on a GPU; `gpucr serve` runs in the
# foreground until stopped (the session's `gpucr run` started one already); `gpucr top` is a terminal's, and shows the
# swap service, which the session does not use (tests/test_top.py runs it)
PARSED_ONLY = ("gpucr bench", "gpucr serve", "gpucr top")
PLACEHOLDER = re.compile(r"\b(PID|DIR|CMD|R\.json)\b")
YOUR_PROGRAM = "serve.py"   # the user's own program in the synopsis; examples/cuda_counter.py stands for it


@dataclass
class Block:
    text: str

    @property
    def commands(self) -> list[str]:
        """Its lines without comments; a line that is only a comment is left out."""
        return [c for c in (line.split("#")[0].strip() for line in self.text.splitlines()) if c]

    @property
    def kind(self) -> str:
        if self.commands and all(c.split()[0].startswith("scripts/") for c in self.commands):
            return "set-up"
        if "$!" in self.text:
            return "session"
        if any(PLACEHOLDER.search(c) for c in self.commands):
            return "synopsis"
        return "unknown"


def blocks() -> list[Block]:
    return [Block(text) for text in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", README.read_text(), re.S | re.M)]


def block(kind: str) -> Block:
    found = [b for b in blocks() if b.kind == kind]
    assert len(found) == 1, f"the README has {len(found)} {kind} blocks; this test expects one"
    return found[0]


def guarded_env() -> dict[str, str]:
    """This test's environment (its own runtime dir), marked so that nothing started from it runs this file."""
    return dict(os.environ, **{README_BLOCK_ENV: "1"})


def run_in_fresh_dir(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """bash runs `script` in a new dir holding only the examples the README names (linked), as a user's
    shell in a checkout would; the gpucr server it starts is stopped after."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    env = dict(user_env(tmp_path), **{README_BLOCK_ENV: "1"})
    try:
        return subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
    finally:
        for simulate in (["--simulate"], []):
            gpucr_cli("serve", *simulate, "--stop", env=env)


def test_the_readme_is_short():
    text = README.read_text()
    assert len(text.splitlines()) <= 250 and len(text.split()) <= 2500, \
        "the README is at most 250 lines and 2,500 words: move details to docs/"


def test_every_block_is_of_a_kind_this_test_runs():
    found = blocks()
    assert len(found) >= 3, "the block scan is broken"
    unknown = [b.text for b in found if b.kind == "unknown"]
    assert not unknown, f"README blocks that test_readme.py does not know how to run: {unknown}; say how in Block.kind"


# ---- set-up ----

def script_steps(script: Path) -> tuple[list[str], list[str]]:
    """What a set-up script runs: the arguments of its set-up (scripts/install.py) and the module command it
    then execs with the Python that set-up printed."""
    text = script.read_text()
    setup = re.search(r"^PY=\$\(python3 scripts/install\.py([^)]*)\)$", text, re.M)[1].split()
    run = re.search(r'exec "\$PY" -m (.*)"\$@"', text)[1].split()
    return setup, run


def test_the_set_up_block_runs_what_it_says():
    """Each script exists and its steps work, checked cheaply: the set-up as a dry run (it installs
    nothing) and the command it then runs with --help (scripts/test would run this suite)."""
    commands = [c.split() for c in block("set-up").commands]
    assert [c[0] for c in commands] == ["scripts/demo", "scripts/test"]
    for cmd in commands:
        script = ROOT / cmd[0]
        assert script.is_file() and os.access(script, os.X_OK), cmd
        setup, run = script_steps(script)
        r = subprocess.run([sys.executable, "scripts/install.py", *setup, "--dry-run"], cwd=ROOT, env=guarded_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "pip install" in r.stderr and str(ROOT) in r.stderr, (cmd, r.stderr)
        r = subprocess.run([sys.executable, "-m", *run, "--help"], cwd=ROOT, env=guarded_env(), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and "usage:" in r.stdout, (cmd, r.stdout, r.stderr)
    # how to see why tests skip, as the README says: scripts/test hands its arguments to pytest
    assert "scripts/test -rs" in README.read_text()
    assert script_steps(ROOT / "scripts/test")[1][0] == "pytest"


# ---- the session ----

def test_the_session_block_pasted_into_a_shell(tmp_path):
    """As pasted: the checkpoint comes at once after the start, and only `gpucr run` says --simulate."""
    session = block("session")
    assert sum("--simulate" in c for c in session.commands) == 1, "the flag is needed only to start a simulated process"
    r = run_in_fresh_dir("set -e\n" + session.text + "wait $! 2>/dev/null || true\n", tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert re.search(r"process \d+: checkpointed \(level full\) in [0-9.]+ s", r.stdout), r.stdout
    assert "checkpointed (level full) [simcuda]" in r.stdout and "restored and running" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr and "not running under gpucr" not in r.stderr, r.stderr


def test_the_session_survives_its_checkpoint():
    """The session's program, under the session's commands: the counter it keeps on the GPU goes on from
    where it stopped, its buffer intact."""
    env = {k: v for k, v in guarded_env().items() if k != "GPUCR_SIMULATE"}
    run, *steps = [shlex.split(c.replace("&", "")) for c in block("session").commands]
    assert run[:2] == ["gpucr", "run"] and steps[-1] == ["kill", "$!"]
    argv = [sys.executable, "-m", "gpucr.cli", *run[1:]]
    argv[argv.index("python3")] = sys.executable
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("cuda_counter: 32 MiB on the GPU")
        assert proc.stdout.readline().strip() == "step 1: counter 1, buffer intact"
        for cmd in steps[:-1]:
            r = gpucr_cli(*[str(proc.pid) if w == "$!" else w for w in cmd[1:]], env=env)
            assert r.returncode == 0, (cmd, r.stderr)
            if cmd[1] == "checkpoint":
                assert gpucr.status(proc.pid).state == "checkpointed"
        for n in (2, 3):
            assert proc.stdout.readline().strip() == f"step {n}: counter {n}, buffer intact"
    finally:
        proc.kill()
        proc.wait()
        gpucr_cli("serve", "--simulate", "--stop", env=env)   # the server `gpucr run --simulate` started


# ---- the synopsis ----

def results_file() -> str:
    """The results file the README's table comes from: R.json of the synopsis."""
    return re.search(r"\((bench/results/[\w.-]+\.json)\)", README.read_text())[1]


def filled(command: str, pid: str, image: str) -> str:
    command = command.replace("[PID...]", "PID").replace(YOUR_PROGRAM, "examples/cuda_counter.py")
    values = {"PID": pid, "DIR": image, "CMD": "python3 examples/cuda_counter.py", "R.json": str(ROOT / results_file())}
    return PLACEHOLDER.sub(lambda m: values[m[1]], command)


def test_every_synopsis_line_parses(capsys):
    """Each command as the synopsis writes it, placeholders filled: its command and options exist."""
    for command in block("synopsis").commands:
        argv = shlex.split(filled(command, "4242", "/tmp/image"))
        if argv[0] == "gpucr":
            try:
                if argv[1] == "bench":
                    cli._bench_parser().parse_args(argv[2:])
                else:
                    cli._parser().parse_args(argv[1:])
            except SystemExit as exc:   # --version prints and exits 0; a bad command or option exits 2
                assert exc.code == 0, f"the README's '{command}' does not parse: {capsys.readouterr().err}"
        else:
            assert argv[:2] == ["python3", "-m"], command
            r = subprocess.run([sys.executable, *argv[1:], "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0 and "usage:" in r.stdout, (command, r.stderr)


def as_run_here(command: str, on_gpu: bool) -> str:
    """The line as this machine runs it: without a GPU, a command that starts a driver of its own runs on
    simcuda, with the --simulate that each of them takes."""
    own = next((p for p in OWN_DRIVER if command.startswith(p)), None)
    if on_gpu or own is None or "--simulate" in command:
        return command
    return f"{own} --simulate{command[len(own):]}"


def synopsis_session(on_gpu: bool) -> str:
    """The synopsis as one bash session. Its first `gpucr run` line starts, in the background, the process
    that PID names in the other lines; its other `gpucr run` lines would start more of the same, and with
    PARSED_ONLY's lines they are only parsed (test_every_synopsis_line_parses)."""
    commands = block("synopsis").commands
    start = next(c for c in commands if c.startswith("gpucr run "))
    rest = [c for c in commands if not c.startswith(("gpucr run ", *PARSED_ONLY))]
    lines = ["set -ex", "DIR=$PWD/image", f"{filled(as_run_here(start, on_gpu), '', '')} &", "PID=$!",
             "trap 'kill $PID 2>/dev/null || true' EXIT"]   # a line that fails ends the process too
    lines += [filled(as_run_here(c, on_gpu), "$PID", "$DIR") for c in rest]
    return "\n".join(lines) + "\n"


def check_session(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, (r.stdout, r.stderr[-4000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert "restored and running" in r.stdout and f"gpucr {gpucr.__version__}" in r.stdout, r.stdout


def test_the_synopsis_runs_on_simcuda(tmp_path):
    script = synopsis_session(on_gpu=False)
    for line in ("gpucr checkpoint --image $DIR $PID", "gpucr inspect $DIR", "gpucr doctor --simulate",
                 "gpucr recover --simulate $PID"):
        assert line in script, script
    check_session(run_in_fresh_dir(script, tmp_path))


@pytest.mark.skipif(not nvidia_gpu(), reason="needs an NVIDIA GPU: the synopsis's 'gpucr run', 'gpucr doctor', "
                                              "'gpucr recover' and alloc_rate lines, as written, use the CUDA driver")
def test_the_synopsis_runs_on_the_gpu(tmp_path):
    script = synopsis_session(on_gpu=True)
    assert "--simulate" not in script.split("\n", 3)[2], script
    check_session(run_in_fresh_dir(script, tmp_path))


def test_readme_points_at_files_that_exist():
    readme = README.read_text()
    named = set(re.findall(r"\b((?:examples|scripts|bench/results)/[\w./-]+\w)", readme))
    assert "examples/cuda_counter.py" in named
    assert [n for n in named if not (ROOT / n).exists()] == []
