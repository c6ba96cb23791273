"""First use as a new user meets it (issue 24, item 3; the README's blocks: test_readme.py): the
driver taken from the target, pipes, totals, errors under --json, and the smaller texts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from gpucr import manifest, paths, preflight
from gpucr.bench.report import faster
from gpucr.errors import GpucrError
from gpucr.target import Target

from conftest import ROOT, gpucr_cli, user_env


def test_links_of_the_readme_and_docs_lead_to_files():
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_simulated_targets_need_no_flag_and_ps_lists_them(sim_app, tmp_path):
    app = sim_app("--sizes", "4M")
    env = user_env(tmp_path)
    env[ "GPUCR_NO_SERVER"] = "1"
    r = gpucr_cli("checkpoint", str(app.pid), env=env)
    assert r.returncode == 0, r.stderr
    r = gpucr_cli("ps", env=env)
    row = next(l for l in r.stdout.splitlines() if l.split()[:1] == [str(app.pid)])
    assert "checkpointed [sim]" in row and "unreachable" not in r.stdout, r.stdout
    r = gpucr_cli("restore", str(app.pid), env=env)
    assert r.returncode == 0 and "restored and running" in r.stdout, r.stderr


def test_a_request_mixing_simcuda_and_the_driver_is_refused_by_name():
    sim = Target(11, 0, 0, ROOT, {"simulated": True})
    real = Target(22, 0, 0, ROOT, {"simulated": False})
    with pytest.raises(GpucrError, match=r"process 11 runs on simcuda.*process 22 on the system's CUDA driver"):
        preflight.take_kind([sim, real])


CLAIMS_DRIVER = ROOT / "tests" / "apps" / "claims_driver.py"


def test_ps_of_both_kinds_ends_at_once_with_one_helper(sim_app):
    """A simcuda process and one on the system's driver (claimed by a fake agent, as no driver is here): `ps`
    lists the other kind through one gpucr of its own, which lists only its own kind and starts nothing."""
    app = sim_app("--sizes", "4M")
    claim = subprocess.Popen([sys.executable, str(CLAIMS_DRIVER)], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(claim.stdout.readline())["ready"]
        env = dict(os.environ, GPUCR_NO_SERVER="1")
        t0 = time.monotonic()
        r = gpucr_cli("ps", env=env, timeout=30)
        assert time.monotonic() - t0 < 15, "ps took too long"
        assert r.returncode == 0, r.stderr
        assert any(l.split()[:2] == [str(app.pid), "running"] for l in r.stdout.splitlines()), r.stdout
        assert any(l.split()[:2] == [str(claim.pid), "unreachable"] for l in r.stdout.splitlines()), r.stdout
    finally:
        claim.kill()
        askers = {int(l) for l in claim.communicate()[0].split()}
    assert 1 <= len(askers) <= 2, f"the fake agent was asked by {len(askers)} processes: ps and at most one helper"


# gpucr's command with every hello it says to an agent counted (the last line on stderr)
COUNTING_HELLOS = """
import sys
from gpucr import cli
from gpucr.agent import AgentClient
hellos, call = [], AgentClient.call
def counted(self, verb, *args, **kw):
    hellos.extend([self.pid] if verb == "hello" else [])
    return call(self, verb, *args, **kw)
AgentClient.call = counted
code = cli.main(sys.argv[1:])
print(hellos, file=sys.stderr)
sys.exit(code)
"""


def test_a_ready_process_is_said_hello_once_per_request(sim_app):
    """checkpoint, restore, status and ps of a process that is up: the request's own hello is the only one
    (no look before it; ps asks again only a process it could not list)."""
    app = sim_app("--sizes", "4M")
    env = dict(os.environ, GPUCR_NO_SERVER="1")
    for cmd in ("checkpoint", "status", "restore", "status", "ps"):
        r = subprocess.run([sys.executable, "-c", COUNTING_HELLOS, cmd, *([str(app.pid)] if cmd != "ps" else [])],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stderr.splitlines()[-1] == f"[{app.pid}]", (cmd, r.stderr)


def test_a_process_gone_between_two_looks_reads_as_old_not_a_traceback():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert preflight._age_s(gone.pid) == float("inf")


def test_wait_and_a_process_not_starting(sim_app):
    app = sim_app("--sizes", "4M")
    r = gpucr_cli("wait", str(app.pid), "--timeout", "10")
    assert r.returncode == 0 and "ready under gpucr, CUDA loaded [simcuda]" in r.stdout, r.stderr
    p = subprocess.Popen(["sleep", "30"])
    try:
        r = gpucr_cli("wait", str(p.pid), "--timeout", "10")
        assert r.returncode == 1 and "not running under gpucr" in r.stderr, r.stderr
    finally:
        p.kill()
        p.wait()


def test_pipes_closed_early_end_quietly(sim_app):
    app = sim_app("--sizes", "4M")
    cli = f"{sys.executable} -m gpucr.cli"
    for cmd in (f"status {app.pid}", "ps --json", f"status {app.pid} --json"):
        r = subprocess.run(f"{cli} {cmd} | true", shell=True, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, (cmd, r.stderr)


def test_totals_first_phases_on_request(sim_app):
    app = sim_app("--sizes", "4M")
    r = gpucr_cli("checkpoint", str(app.pid))
    first = r.stdout.splitlines()[0]
    assert re.match(rf"process {app.pid}: checkpointed \(level full\) in [0-9.]+ s; 4 MiB moved by gpucr \([0-9.]+ GB/s",
                    first), first
    assert "phases" not in r.stdout and len(first) < 200, r.stdout
    r = gpucr_cli("restore", "-v", "--json", str(app.pid))
    out = json.loads(r.stdout)
    assert isinstance(out["total_s"], float) and out["total_s"] > 0, out
    r = gpucr_cli("checkpoint", "--phases", str(app.pid))
    assert "  phases       vet " in r.stdout, r.stdout
    r = gpucr_cli("status", str(app.pid))
    assert "1 allocation," in r.stdout and "1 segment " in r.stdout, r.stdout
    gpucr_cli("restore", str(app.pid))


def test_errors_under_json_are_objects():
    r = gpucr_cli("status", "999999999", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["command"] == "status" and out["processes"] == [] and out["schema_version"] == 1
    assert "no process with pid 999999999" in out["error"] and out["exit_status"] == 1
    r = gpucr_cli("serve", "--status", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["running"] is False


def test_run_without_a_driver_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCR_SIMULATE", "LD_LIBRARY_PATH")}
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("needs a machine with no CUDA driver")
    except OSError:
        pass
    r = gpucr_cli("run", "--", "true", env=env)
    assert r.returncode == 1 and "install the NVIDIA driver, or add --simulate" in r.stderr, r.stderr


def test_commands_and_texts():
    r = gpucr_cli()
    assert r.returncode == 2 and "usage: gpucr" in r.stdout and "checkpoint" in r.stdout
    assert gpucr_cli("lib", "--simcuda").stdout == gpucr_cli("lib", "--simulate").stdout != ""
    assert "--simcuda" not in gpucr_cli("lib", "--help").stdout
    for cmd in ("checkpoint", "restore", "status", "ps", "inspect", "recover", "doctor", "demo"):
        assert "print the result as JSON" in re.sub(r"\s+", " ", gpucr_cli(cmd, "--help").stdout), cmd
    r = gpucr_cli("checkpoint", "--group", "g", "123")
    assert r.returncode == 1 and "process 123 was named with it" in r.stderr, r.stderr
    r = gpucr_cli("checkpoint", "--no-server", "123", "123")
    assert "123" in r.stderr, r.stderr


def test_bench_says_slower_and_runs_the_server_by_default():
    from gpucr.bench import methods as M
    assert faster(2.0) == "2.0x faster" and faster(0.5) == "2.0x slower"
    assert "gpucr-server-full" in M.DEFAULT_METHODS


def test_old_manifests_read_under_todays_names():
    old = {"bytes": 1, "bytes_written": 0, "seconds": 0.5, "gb_per_s": 2.0, "direct_io": False}
    manifest._rename_old_keys(old)
    assert old == {"bytes": 1, "bytes_written": 0, "transfer_s": 0.5, "gbps": 2.0, "direct_io": False}
    assert manifest.cuda_version(13000) == "13.0" and manifest.cuda_version(12080) == "12.8"


def test_doctor_simulate_checks_simcuda_and_says_so(tmp_path):
    env = user_env(tmp_path)
    env.pop("LD_LIBRARY_PATH", None)
    r = gpucr_cli("doctor", "--simulate", env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith("checking simcuda, the simulated driver (a test double"), r.stdout
    assert "no NVIDIA GPU answered" not in r.stdout and "nothing missing on simcuda" in r.stdout, r.stdout
    d = json.loads(gpucr_cli("doctor", "--simulate", "--json", env=env).stdout)
    assert d["simulated"] is True and d["problems"] == [], d
    assert d["driver"]["simulated"] is True and d["driver"]["library"] == str(paths.simcuda_dir() / "libcuda.so.1")
    assert d["gpu"]["total_bytes"] == 4 << 30   # simcuda's device (SIMCUDA_TOTAL_MEM of the test's fixture)


def test_recover_simulate_acts_through_simcuda(tmp_path):
    env = user_env(tmp_path)
    env.pop("LD_LIBRARY_PATH", None)
    r = gpucr_cli("recover", "--simulate", "--list", "--no-server", env=env)
    assert r.returncode == 0 and "cannot load" not in r.stderr, r.stderr
    r = gpucr_cli("recover", "--list", "--no-server", env=env)   # no driver here: it says what to add
    assert r.returncode == 0 or "add --simulate" in r.stderr, r.stderr


def test_a_checkpoint_of_a_process_still_starting_obeys_timeout_and_says_what_to_do():
    """(3.7) An app that takes seconds to load CUDA (as torch does importing): a checkpoint meanwhile waits
    no longer than its --timeout and says what to do; given time, the same checkpoint waits and succeeds."""
    slow_start = ("import sys, time; time.sleep(4); sys.argv[1:] = ['--sizes', '4M']; import runpy; "
                  "runpy.run_module('gpucr.workloads.driver_app', run_name='__main__')")
    app = subprocess.Popen([sys.executable, "-c", slow_start], env=paths.run_env(simulate=True),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        r = gpucr_cli("checkpoint", "--timeout", "1", str(app.pid))
        took = time.monotonic() - t0
        assert r.returncode == 1 and f"process {app.pid} is still starting under gpucr after 1 s" in r.stderr, r.stderr
        assert f"wait for it with 'gpucr wait {app.pid}', then retry" in r.stderr, r.stderr
        assert 1 <= took < 4, f"--timeout 1 took {took:.1f} s"
        r = gpucr_cli("checkpoint", "--timeout", "30", str(app.pid))
        assert r.returncode == 0 and "checkpointed (level full)" in r.stdout, r.stderr
        assert gpucr_cli("restore", str(app.pid)).returncode == 0
    finally:
        app.kill()
        app.wait()
