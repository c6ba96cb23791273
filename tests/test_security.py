"""Security (docs/security.md): each test plays the attacker of one line of the threat model, on simcuda.

Attacks across users need root to create the users (`gpucr-attacker`, `gpucr-victim`) and run as them;
pid namespaces need root for `unshare`. Processes of those users run the system's python with gpucr's
sources on PYTHONPATH (the test interpreter may sit where they cannot read).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import gpucr
from gpucr import paths
from gpucr import target as targets
from gpucr.agent import PROTOCOL
from gpucr.driver import Driver, ProcessState

from conftest import ROOT, RunningServer, gpucr_cli, sim_driver

MiB = 1 << 20
SYS_PY = "/usr/bin/python3"
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a second user")


# ---- helpers ----

def one_line(r: subprocess.CompletedProcess, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def users() -> dict[str, int]:
    """An attacker and a victim, two unprivileged local users."""
    if os.getuid() != 0:
        pytest.skip("needs root to create a second user")
    if not os.access(SYS_PY, os.X_OK):
        pytest.skip(f"needs {SYS_PY} to run code as another user")
    out = {}
    for name in ("gpucr-attacker", "gpucr-victim"):
        try:
            pwd.getpwnam(name)
        except KeyError:   # another test worker may make it at the same moment: then useradd says it exists (9)
            r = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], capture_output=True, text=True)
            assert r.returncode in (0, 9), r.stderr
        out[name.split("-")[1]] = pwd.getpwnam(name).pw_uid
    return out


def user_dir(uid: int, mode: int = 0o700) -> Path:
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="gpucr-test-"))
    os.chown(d, uid, uid)
    os.chmod(d, mode)
    return d


def as_user(uid: int, argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    """argv as `uid`, with `env` set only after the switch (LD_PRELOAD must not reach setpriv itself)."""
    assigns = [f"{k}={v}" for k, v in env.items()]
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env", "-i", *assigns,
                             *argv], env={"PATH": "/usr/bin:/bin"}, **kw)


def user_env(uid: int, **extra: str) -> dict[str, str]:
    """A plain environment of that user: no runtime dir setting, so the agent takes the default rule."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "HOME": "/", "GPUCR_SIMULATE": "1",
           "SIMCUDA_TOTAL_MEM": str(1 << 30)}
    env.update(extra)
    return env


def user_cli(uid: int, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    p = as_user(uid, [SYS_PY, "-m", "gpucr.cli", *args], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def clear_default_dirs(uid: int) -> None:
    for d in Path("/tmp").glob(f"gpucr-{uid}*"):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() and not d.is_symlink() else d.unlink()


def wait_for(cond, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)


# A stand-in agent: listens on the given socket paths and answers as gpucr's agent would, with whatever
# the attacker chooses (a driver library to load, another pid, another protocol).
FAKE_AGENT = r'''
import json, os, socket, sys, threading
cfg = json.loads(sys.argv[1])
if cfg.get("own_dir"):
    ino = os.stat("/proc/self/ns/pid").st_ino
    cfg["paths"] = [os.path.join(cfg["own_dir"], f"{os.getpid()}-{ino}.sock")]
hello = {"ok": True, "agent": "gpucr", "protocol": cfg["protocol"], "pid": cfg.get("pid") or os.getpid(),
         "uid": os.getuid(), "cuda": True, "simulated": cfg["simulated"], "libcuda": cfg["libcuda"], "group": ""}
status = {"ok": True, "pid": hello["pid"], "cuda": True, "simulated": cfg["simulated"], "state": "running",
          "group": "", "staged": False, "busy": False, "generation": 0, "allocations": {}, "devices": [], "shared": []}
def serve(conn):
    with conn:
        for line in conn.makefile("rb"):
            verb = line.split()[0].decode() if line.split() else ""
            conn.sendall(json.dumps(hello if verb == "hello" else status).encode() + b"\n")
servers = []
for p in cfg["paths"]:
    s = socket.socket(socket.AF_UNIX)
    s.bind(p)
    s.listen(8)
    servers.append(s)
def loop(s):
    while True:
        threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
for s in servers:
    threading.Thread(target=loop, args=(s,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
'''


def fake_agent(uid: int | None, cfg: dict, env: dict[str, str]) -> subprocess.Popen:
    argv = [SYS_PY if uid is not None else sys.executable, "-c", FAKE_AGENT, json.dumps(cfg)]
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p = as_user(uid, argv, env, **kw) if uid is not None else subprocess.Popen(argv, env=env, **kw)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def evil_dir():
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="gpucr-evil-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def evil_library(tmp: Path, owner: int) -> tuple[Path, Path]:
    """A library whose constructor leaves a mark: loading it is running the attacker's code (in a dir every
    user can reach, so that whoever loads it can leave the mark)."""
    if not shutil.which("gcc"):
        pytest.skip("needs gcc to build the attacker's library")
    mark = tmp / "ran-as-uid"
    src = tmp / "evil.c"
    src.write_text('#include <stdio.h>\n#include <unistd.h>\n__attribute__((constructor)) static void own(void) {'
                   f' FILE *f = fopen("{mark}", "w"); if (f) {{ fprintf(f, "%u", getuid()); fclose(f); }} }}\n'
                   'int cuInit(unsigned f) { return 0; }\n')
    lib = tmp / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    os.chown(lib, owner, owner)
    os.chmod(tmp, 0o777)
    return lib, mark


# ---- 1: root never loads a library, nor trusts a location, that the target names ----

@root_only
def test_root_never_loads_the_driver_a_target_names(users, evil_dir):
    attacker = users["attacker"]
    lib, mark = evil_library(evil_dir, attacker)
    rdir = user_dir(attacker)
    try:
        env = user_env(attacker, GPUCR_RUNTIME_DIR=str(rdir))   # the fake's own setting says where it listens
        fake = fake_agent(attacker, {"own_dir": str(rdir), "protocol": PROTOCOL, "simulated": True,
                                     "libcuda": str(lib)}, env)
        try:
            r = gpucr_cli("status", "--json", str(fake.pid))
            assert r.returncode == 0, r.stderr
            assert not mark.exists(), "root ran the library the target named"
            # the same target claiming the real driver, while this controller is on simcuda: refused, one line
            fake2 = fake_agent(attacker, {"own_dir": str(rdir), "protocol": PROTOCOL, "simulated": False,
                                          "libcuda": str(lib)}, env)
            one_line(gpucr_cli("checkpoint", str(fake2.pid)), "system's CUDA driver", "simcuda")
            fake2.kill()
            assert not mark.exists()
        finally:
            fake.kill()
    finally:
        shutil.rmtree(rdir, ignore_errors=True)


def test_protocol_mismatch_is_refused_in_one_line(tmp_path):
    rdir = Path(os.environ["GPUCR_RUNTIME_DIR"])
    fake = fake_agent(None, {"own_dir": str(rdir), "protocol": PROTOCOL + 7, "simulated": True, "libcuda": ""},
                      dict(os.environ))
    try:
        one_line(gpucr_cli("status", str(fake.pid)), f"protocol {PROTOCOL + 7}", f"speaks protocol {PROTOCOL}")
    finally:
        fake.kill()


def test_a_library_without_cuInit_is_one_clear_line(tmp_path):
    lib = tmp_path / "nocuda.so"
    (tmp_path / "nocuda.c").write_text("int nothing_here(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "nocuda.c")], check=True)
    with pytest.raises(gpucr.GpucrError, match="is not a CUDA driver library .*no cuInit"):
        Driver(str(lib))


# ---- 2: a squatted default runtime dir ----

@root_only
def test_a_squatted_runtime_dir_is_never_trusted(users, evil_dir):
    attacker, victim = users["attacker"], users["victim"]
    lib, mark = evil_library(evil_dir, attacker)
    clear_default_dirs(victim)
    squat = Path(f"/tmp/gpucr-{victim}")
    sim = user_dir(victim)
    try:
        subprocess.run(["setpriv", f"--reuid={attacker}", f"--regid={attacker}", "--clear-groups", "mkdir", "-m",
                        "777", str(squat)], check=True)
        env = user_env(victim, SIMCUDA_DIR=str(sim))
        app = as_user(victim, [SYS_PY, "-m", "gpucr.workloads.driver_app", "--sizes", "8M"],
                      paths.run_env(simulate=True, base=env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
        try:
            assert json.loads(app.stdout.readline()).get("ready")
            # the attacker plants sockets under every name the victim's controller might look for
            name = targets.agent_socket_name(app.pid)
            planted = [str(squat / f"{app.pid}.sock"), str(squat / name)]
            fake = fake_agent(attacker, {"paths": planted, "pid": app.pid, "protocol": PROTOCOL, "simulated": True,
                                         "libcuda": str(lib)}, user_env(attacker))
            for junk in ("999999-1.sock", "999999.sock"):
                (squat / junk).write_text("")
            try:
                r = user_cli(victim, env, "status", "--json", str(app.pid))
                assert r.returncode == 0, r.stderr
                assert json.loads(r.stdout)["processes"][0]["allocations"]["tracked_bytes"] >= 8 * MiB   # the real agent answered
                assert not mark.exists(), "the victim ran the attacker's library"
                assert user_cli(victim, env, "ps").returncode == 0
                assert (squat / "999999-1.sock").exists() and (squat / "999999.sock").exists(), \
                    "the controller removed files in a dir that failed the checks"
                own = [d for d in paths.fallback_dirs(victim) if (d / name).exists()]
                assert own and own[0].stat().st_uid == victim and (own[0].stat().st_mode & 0o777) == 0o700
            finally:
                fake.kill()
        finally:
            app.kill()
            _, err = app.communicate()
            assert "not a private directory of this user" in err and "instead" in err
    finally:
        clear_default_dirs(victim)
        shutil.rmtree(sim, ignore_errors=True)


# The runtime dir rules, one table (native/agent/rules.h) that the agent (C) and the controller (Python, through
# gpucr.agent_tables) each read: for each case, where the agent listens (or that it refuses) must be where the
# controller looks (or finds nothing).
def _table_cases(base: Path, other: int | None) -> list[tuple[str, dict[str, str], str]]:
    priv = base / "private"
    priv.mkdir(mode=0o700)
    opened = base / "opened"
    opened.mkdir(mode=0o755)
    (base / "link").symlink_to(priv)
    xdg = base / "xdg"
    xdg.mkdir(mode=0o700)
    xdg_open = base / "xdg-open"
    (xdg_open / "gpucr").mkdir(parents=True, mode=0o777)
    os.chmod(xdg_open / "gpucr", 0o777)
    cases = [("GPUCR_RUNTIME_DIR private", {"GPUCR_RUNTIME_DIR": str(priv)}, str(priv)),
             ("GPUCR_RUNTIME_DIR 0755", {"GPUCR_RUNTIME_DIR": str(opened)}, "refused"),
             ("GPUCR_RUNTIME_DIR a link", {"GPUCR_RUNTIME_DIR": str(base / "link")}, "refused"),
             ("XDG_RUNTIME_DIR", {"XDG_RUNTIME_DIR": str(xdg)}, str(xdg / "gpucr")),
             ("XDG_RUNTIME_DIR/gpucr 0777", {"XDG_RUNTIME_DIR": str(xdg_open)}, "refused")]
    if other is not None:
        foreign = base / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, other, other)
        cases.append(("GPUCR_RUNTIME_DIR of another user", {"GPUCR_RUNTIME_DIR": str(foreign)}, "refused"))
    return cases


def _agent_listens(env: dict[str, str], uid: int | None) -> subprocess.Popen:
    """A process under the agent (of `uid`, or this user), its stderr piped."""
    full = paths.run_env(base=env)
    argv = ["sleep", "30"]
    p = as_user(uid, argv, full, stderr=subprocess.PIPE, text=True) if uid is not None else \
        subprocess.Popen(argv, env=full, stderr=subprocess.PIPE, text=True)
    return p


def test_runtime_dir_rules_are_one_table_for_agent_and_controller(tmp_path):
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="gpucr-table-"))
    try:
        other = pwd.getpwnam("nobody").pw_uid if os.getuid() == 0 else None
        for label, env, want in _table_cases(base, other):
            p = _agent_listens({"PATH": os.environ["PATH"], **env}, None)
            try:
                name = targets.agent_socket_name(p.pid)
                if want == "refused":
                    time.sleep(0.3)
                    assert paths.agent_dirs(os.getuid(), env) == [], label
                    assert not list(base.rglob(name)), label
                else:
                    wait_for(lambda: (Path(want) / name).exists(), what=f"{label}: the socket in {want}")
                    # asked once the agent has made its dir (asked before, a loaded machine could see none yet)
                    assert paths.agent_dirs(os.getuid(), env) == [Path(want)], label
            finally:
                p.kill()
                _, err = p.communicate()
            if want == "refused":
                assert "control channel is OFF" in err, (label, err)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@root_only
def test_runtime_dir_table_default_rule_falls_back_to_a_private_dir(users):
    victim = users["victim"]
    clear_default_dirs(victim)
    try:
        rows = [("free", None), ("squatted: another user's", (users["attacker"], 0o700)), ("squatted: open", (victim, 0o777))]
        for label, squat in rows:
            clear_default_dirs(victim)
            named = Path(f"/tmp/gpucr-{victim}")
            if squat:
                named.mkdir()
                os.chown(named, squat[0], squat[0])
                os.chmod(named, squat[1])
            p = _agent_listens({"PATH": "/usr/bin:/bin"}, victim)
            try:
                name = targets.agent_socket_name(p.pid)
                wait_for(lambda: any((d / name).exists() for d in paths.agent_dirs(victim, {})), what=label)
                where = next(d for d in paths.agent_dirs(victim, {}) if (d / name).exists())
                assert (where == named) == (squat is None), label
            finally:
                p.kill()
                p.communicate()
    finally:
        clear_default_dirs(victim)


# ---- 3: image files: planted links, hard links, another user's identity ----

def test_a_link_planted_in_the_image_dir_is_never_followed(sim_app, tmp_path, monkeypatch):
    from gpucr.coordinator import steps as co
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    precious = tmp_path / "precious"
    precious.write_text("not yours")
    img = tmp_path / "img"
    img.mkdir(mode=0o777)
    real_check = co._check_image_dir

    def check_then_plant(d, owner):   # the race: planted after the check, before the data out writes the image
        real_check(d, owner)
        (img / "data.bin").symlink_to(precious)
    monkeypatch.setattr(co, "_check_image_dir", check_then_plant)
    with pytest.raises(gpucr.GpucrError, match="appeared while the image was written|no longer empty"):
        gpucr.checkpoint(app.pid, image=img)
    assert precious.read_text() == "not yours"
    assert not [n for n in os.listdir(img) if n != "data.bin"], "a temporary file was left behind"
    assert gpucr.status(app.pid).state == "running", "the checkpoint is undone before anything left the GPU"
    assert app.ask("digest") == before


def test_image_reads_follow_no_link_and_no_hard_link(imaged_app, tmp_path):
    app, before, good = imaged_app("16M,4M", "good")
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copy(good / "data.bin", elsewhere)     # the very same bytes: only the way to them differs
    linked = tmp_path / "linked"
    shutil.copytree(good, linked)
    (linked / "data.bin").unlink()
    (linked / "data.bin").symlink_to(elsewhere)
    hard = tmp_path / "hard"
    shutil.copytree(good, hard)
    (hard / "data.bin").unlink()
    os.link(elsewhere, hard / "data.bin")
    mlink = tmp_path / "mlink"
    shutil.copytree(good, mlink)
    os.rename(mlink / "manifest.json", tmp_path / "m.json")
    (mlink / "manifest.json").symlink_to(tmp_path / "m.json")
    for img, why in ((linked, "symbolic link"), (hard, "2 links"), (mlink, "symbolic link")):
        one_line(gpucr_cli("restore", "--image", str(img), str(app.pid)), why)
        assert gpucr.status(app.pid).state == "checkpointed"
    gpucr.restore(app.pid, image=good)
    assert app.ask("digest") == before


def test_image_files_are_private(sim_app, tmp_path):
    app = sim_app("--sizes", "8M")
    img = tmp_path / "img"
    gpucr.checkpoint(app.pid, image=img)
    for name in ("data.bin", "manifest.json"):
        assert (os.stat(img / name).st_mode & 0o777) == 0o600, name
    gpucr.restore(app.pid, image=img)


@root_only
def test_root_does_image_io_as_the_processs_user(users, tmp_path):
    from gpucr.imagefs import ImageDir
    victim = users["victim"]
    theirs = user_dir(victim)
    rootonly = Path(tempfile.mkdtemp(dir="/tmp", prefix="gpucr-root-"))
    os.chmod(rootonly, 0o755)
    secret = rootonly / "secret"
    secret.write_text("root's")
    os.chmod(secret, 0o600)
    try:
        owner = (victim, victim)
        with pytest.raises(gpucr.GpucrError, match="Permission denied"):
            ImageDir(rootonly / "img", owner, create=True)   # root could; the victim could not
        with ImageDir(theirs / "img", owner, create=True) as d:
            fd, tmp = d.create("data.bin")
            os.close(fd)
            d.publish(tmp, "data.bin")
        assert (theirs / "img" / "data.bin").stat().st_uid == victim
        os.symlink(secret, theirs / "img" / "manifest.json")
        os.link(secret, theirs / "img" / "hard") if os.stat(secret).st_dev == os.stat(theirs).st_dev else None
        with ImageDir(theirs / "img", owner) as d:
            with pytest.raises(gpucr.GpucrError, match="symbolic link"):
                d.open_read("manifest.json")
            if (theirs / "img" / "hard").exists():
                with pytest.raises((gpucr.GpucrError, PermissionError)):
                    d.open_read("hard")
        assert os.getresuid() == (0, 0, 0)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
        shutil.rmtree(rootonly, ignore_errors=True)


@root_only
def test_a_full_disk_leaves_no_partial_image(sim_app, tmp_path):
    app = sim_app("--sizes", "48M")
    before = app.ask("digest")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("needs a tmpfs mount for a small disk")
    try:
        img = small / "img"
        # written from the GPU as it is copied out: the checkpoint is undone before anything left the GPU
        one_line(gpucr_cli("checkpoint", "--image", str(img), str(app.pid)), "No space left", "runs on")
        assert list(img.iterdir()) == [], "a partial image was left"
        assert gpucr.status(app.pid).state == "running"
        assert app.ask("digest") == before
    finally:
        subprocess.run(["umount", str(small)])


# ---- 4: a controller killed during an image restore ----

def test_controller_killed_during_image_restore_frees_the_agent_at_once(imaged_app):
    app, before, img = imaged_app("200M,8M")
    r = gpucr_cli("restore", "--image", str(img), str(app.pid), env=dict(os.environ, GPUCR_TEST_KILL_AT="during-image-read"))
    assert r.returncode == -signal.SIGKILL
    t0 = time.time()
    wait_for(lambda: not gpucr.status(app.pid).busy, timeout=5, what="the agent noticing its controller died")
    assert time.time() - t0 < 5
    st = gpucr.status(app.pid)
    assert st.state == "checkpointed" and st.gate_closed and not st.staged, st   # parked, restorable
    gpucr.restore(app.pid, image=img)
    assert app.ask("digest") == before


# ---- 5: a stopped process ----

def test_a_stopped_process_is_named_at_once(sim_app):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    os.kill(app.pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        one_line(gpucr_cli("checkpoint", "--timeout", "2", str(app.pid)), "is stopped (SIGSTOP)", f"kill -CONT {app.pid}")
        assert time.time() - t0 < 10
    finally:
        os.kill(app.pid, signal.SIGCONT)
    assert gpucr.status(app.pid).state == "running" and app.ask("digest") == before


def _recovered_whole(app, before: str) -> None:
    """`gpucr recover` of a process left held when it was stopped: every byte back, and it cycles again."""
    r = gpucr_cli("recover", str(app.pid))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: (lambda s: s.state == "running" and not s.busy)(gpucr.status(app.pid)), timeout=30,
             what="the recover")
    assert app.ask("digest") == before
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_a_process_stopped_during_data_out_is_named_and_left_restorable(sim_app):
    """The driver's checkpoint runs beside the plane's copy, so a process stopped then is held by the driver: the
    controller names the stop within seconds, says it left the process checkpointed whole, and `gpucr recover`
    brings every byte back once it runs again."""
    app = sim_app("--sizes", "1500M")
    before = app.ask("digest")
    p = subprocess.Popen([sys.executable, "-m", "gpucr.cli", "checkpoint", "--timeout", "2", str(app.pid)],
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    # a second connection sees the data out start: the agent has handed its memory over and the plane copies
    wait_for(lambda: gpucr.status(app.pid).phase == "handed", timeout=20, what="the data out starting")
    os.kill(app.pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)   # where each of its threads waits, for the failure's report
            raise AssertionError(f"the controller still ran after 30 s:\n{p.communicate()[1][-6000:]}") from None
        assert time.time() - t0 < 8, "the controller must answer within seconds"
        assert p.returncode == 1 and "is stopped (SIGSTOP)" in err, err
        lines = [line for line in err.splitlines() if line.startswith("gpucr:")]
        assert len(lines) == 1, err
        # stopped before the driver held it (the stop landed while the plane listed its memory, seen under load in
        # CI): nothing is held, and once it runs its agent takes its memory back from its own fds (the lease)
        held = f"gpucr recover {app.pid}" in lines[0]
        assert held or f"kill -CONT {app.pid}" in lines[0], err
    finally:
        os.kill(app.pid, signal.SIGCONT)
    if held:
        _recovered_whole(app, before)
        return
    wait_for(lambda: (lambda s: s.state == "running" and not s.busy and s.phase != "handed")(gpucr.status(app.pid)),
             timeout=30, what="its own roll-back")
    assert app.ask("digest") == before



@pytest.mark.parametrize("step", ["driver-lock", "driver-checkpoint"])
def test_a_process_stopped_as_the_driver_is_asked_never_hangs_the_controller(sim_app, step):
    """A stopped process cannot answer the driver, whose call then waits for it to run again: the controller names
    the stop within seconds instead of waiting with it, and the step it asked is finished by the driver later on,
    so `gpucr recover` brings every byte back once the process runs again (seen in CI: a controller hung here)."""
    app = sim_app("--sizes", "600M")
    before = app.ask("digest")
    env = {**os.environ, "GPUCR_TEST_KILL_TARGET": f"{step}:{app.pid}:SIGSTOP"}
    t0 = time.time()
    try:
        try:
            r = subprocess.run([sys.executable, "-m", "gpucr.cli", "checkpoint", "--timeout", "2", str(app.pid)],
                               capture_output=True, text=True, env=env, timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the controller still ran after 30 s with the process stopped at {step}") from None
        assert time.time() - t0 < 10, "the controller must answer within seconds"
        line = one_line(r, "is stopped (SIGSTOP)", f"gpucr recover {app.pid}")
        assert f"kill -CONT {app.pid}" in line
    finally:
        os.kill(app.pid, signal.SIGCONT)
    _recovered_whole(app, before)


@pytest.mark.parametrize("via_server", [False, True], ids=["in-process", "server"])
def test_a_driver_that_does_not_answer_is_given_up_on_and_the_process_left_to_it(sim_app, via_server):
    """A driver that does not answer a checkpoint (stuck, or slow past its limit) cannot hang the controller, nor
    the server serving many: it gives up at the limit and says the driver holds the process and that `gpucr recover`
    brings it back; once the driver has finished the step it was asked, it does, every byte intact."""
    srv = RunningServer(True) if via_server else None
    try:
        app = sim_app("--sizes", "64M", env={**os.environ, "SIMCUDA_CHECKPOINT_DELAY_MS": "5000"})
        before = app.ask("digest")
        t0 = time.time()
        r = gpucr_cli("checkpoint", str(app.pid), env={**os.environ, "GPUCR_TEST_DRIVER_LIMIT_S": "1"}, timeout=60)
        assert time.time() - t0 < 4.5, "given up at its limit, not when the driver answered"
        one_line(r, f"the driver did not answer the checkpoint of process {app.pid} within 1 s",
                 "once the driver answers for it again", f"gpucr recover {app.pid}")
        wait_for(lambda: sim_driver().state(app.pid) == ProcessState.CHECKPOINTED, timeout=20,
                 what="the driver's checkpoint")
        _recovered_whole(app, before)
        if srv is not None:
            assert srv.info()["pid"] == srv.pid, "the server serves on"
    finally:
        if srv is not None:
            srv.stop()

# ---- 6: idle connections ----

def _open_idle(sock: Path, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(sock))
        s.sendall(b"hello\n")
        assert json.loads(s.makefile().readline())["ok"]
        out.append(s)
    return out


def test_idle_connections_never_keep_out_a_controller(sim_app):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    sock = paths.runtime_dir() / targets.agent_socket_name(app.pid)
    idle = _open_idle(sock, 8)       # every slot: a hung monitor, `gpucr status` calls left open
    time.sleep(0.6)
    try:
        gpucr.checkpoint(app.pid)
        # a controller's leased connection is never evicted by newcomers: the checkpoint is not rolled back
        leased = socket.socket(socket.AF_UNIX)
        leased.connect(str(sock))
        gpucr.restore(app.pid)
        leased.sendall(b"handover lease=1\n")   # released to a data plane, not committed
        assert json.loads(leased.makefile().readline())["ok"]
        more = []
        for _ in range(3):               # newcomers push the idle ones out, never the controller's
            more += _open_idle(sock, 4)
            time.sleep(0.6)
        assert gpucr.status(app.pid).state == "checkpointed"
        leased.close()       # the controller goes away: now the lease ends and the agent rolls back
        wait_for(lambda: gpucr.status(app.pid).state == "running", what="the roll-back")
        assert app.ask("digest") == before
        idle += more
    finally:
        for s in idle:
            s.close()


def test_an_idle_connection_times_out(sim_app):
    app = sim_app("--sizes", "4M")
    sock = paths.runtime_dir() / targets.agent_socket_name(app.pid)
    s = _open_idle(sock, 1)[0]
    half = socket.socket(socket.AF_UNIX)
    half.connect(str(sock))
    half.sendall(b"stat")            # half a request, then nothing
    s.settimeout(45)
    half.settimeout(45)
    t0 = time.time()
    assert s.recv(10) == b"" and half.recv(10) == b"", "the agent must close idle connections"
    assert 25 < time.time() - t0 < 40
    s.close()
    half.close()


# ---- what held: floods, no newline, bad values ----

def test_floods_and_garbage_are_handled(sim_app):
    app = sim_app("--sizes", "4M")
    sock = paths.runtime_dir() / targets.agent_socket_name(app.pid)
    big = socket.socket(socket.AF_UNIX)
    big.connect(str(sock))
    big.settimeout(30)
    try:
        big.sendall(b"x" * (10 << 20))   # 10 MiB with no newline
    except OSError:
        pass                             # the agent answered and closed after 4 KiB
    answers: list[bool] = []

    def hammer() -> None:
        for _ in range(10):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(30)
                s.connect(str(sock))
                s.sendall(b"status timeout_ms=99999999999 lease=7\x00\n")
                line = s.makefile().readline()
                answers.append(bool(line) and isinstance(json.loads(line)["ok"], bool))
                s.close()
            except OSError:
                answers.append(True)     # refused under load is an answer too
    threads = [threading.Thread(target=hammer) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    big.close()
    assert len(answers) == 500 and all(answers)
    assert gpucr.status(app.pid).state == "running"
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)


def test_odd_file_staging_names_execute_nothing(sim_app, tmp_path):
    mark = tmp_path / "pwned"
    for name in (f"file:{tmp_path}/a;touch {mark}", f"file:$(touch {mark})", f"file:`touch {mark}`"):
        try:
            app = sim_app("--sizes", "4M", env=dict(os.environ, GPUCR_STAGING=name))
        except RuntimeError:
            continue   # refused at start is fine
        try:
            gpucr.checkpoint(app.pid)
            gpucr.restore(app.pid)
        except gpucr.GpucrError:
            pass
        app.proc.kill()
    assert not mark.exists()


# ---- 7: pid namespaces sharing one runtime dir ----

def _ns_app(size: str, sim: Path) -> tuple[subprocess.Popen, int]:
    """driver_app as pid 2 of a new pid namespace (unshare -p -f --mount-proc); (unshare, its host pid)."""
    env = paths.run_env(simulate=True, base=dict(os.environ, SIMCUDA_DIR=str(sim)))
    preload = env.pop("LD_PRELOAD")     # the agent in the app only: sh then forks it as pid 2
    cmd = f"env LD_PRELOAD={preload} {sys.executable} -m gpucr.workloads.driver_app --sizes {size}; true"
    p = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", "--kill-child", "sh", "-c", cmd], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert json.loads(p.stdout.readline()).get("ready")
    for entry in os.listdir("/proc"):
        if entry.isdigit() and targets.command_line(int(entry)).endswith(f"driver_app --sizes {size}") and \
                targets.pid_namespace(int(entry))[0] == 2:
            if targets.pid_namespace(int(entry))[1] != os.stat("/proc/self/ns/pid").st_ino:
                return p, int(entry)
    raise AssertionError("the namespaced app was not found")


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("unshare"), reason="needs root for unshare -p (pid namespaces)")
def test_pid_namespaces_sharing_a_runtime_dir_do_not_collide(tmp_path):
    sims = [tmp_path / "simA", tmp_path / "simB"]
    for s in sims:
        s.mkdir(mode=0o700)
    a, pid_a = _ns_app("16M", sims[0])
    try:
        b, pid_b = _ns_app("32M", sims[1])
        try:
            assert targets.pid_namespace(pid_a)[0] == targets.pid_namespace(pid_b)[0] == 2
            rdir = paths.runtime_dir()
            socks = {p.name for p in rdir.glob("2-*.sock")}
            assert len(socks) >= 2, socks          # one each: neither replaced the other
            assert 16 * MiB <= gpucr.status(pid_a).allocations.tracked_bytes < 32 * MiB
            assert gpucr.status(pid_b).allocations.tracked_bytes >= 32 * MiB
            listed = dict(targets.list_sockets())
            assert pid_a in listed and pid_b in listed
        finally:
            b.stdin.write("quit\n")     # a clean exit: its agent removes its own socket, and only that
            b.stdin.flush()
            wait_for(lambda: not os.path.exists(f"/proc/{pid_b}"), what="B's app exiting")
            b.kill()
            b.wait()
        # B's exit removed nothing of A's
        assert (paths.runtime_dir() / targets.agent_socket_name(pid_a)).exists()
        assert 16 * MiB <= gpucr.status(pid_a).allocations.tracked_bytes < 32 * MiB
    finally:
        os.kill(pid_a, signal.SIGKILL)
        a.kill()
        a.wait()


def test_a_peer_with_the_overflow_uid_is_told_why(sim_app):
    """Through a user namespace, a user with no uid there (host root seen from a container) appears as the
    overflow uid: the agent says so rather than a bare refusal."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    overflow = int(Path("/proc/sys/kernel/overflowuid").read_text())
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        app = sim_app("--sizes", "4M", env=dict(os.environ, GPUCR_RUNTIME_DIR=str(d)))
        sock = d / targets.agent_socket_name(app.pid)
        os.chmod(d, 0o711)
        os.chmod(sock, 0o666)
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'status\\n');"
                 "print(s.recv(4096).decode())")
        r = subprocess.run(["setpriv", f"--reuid={overflow}", f"--regid={overflow}", "--clear-groups", SYS_PY, "-c",
                            probe, str(sock)], capture_output=True, text=True, timeout=30)
        reply = json.loads(r.stdout)
        assert not reply["ok"] and "overflow uid" in reply["error"] and "namespace" in reply["error"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- 8: the certificate covers every byte ----

@pytest.mark.parametrize("edit,why", [("drop", "gap"), ("dup", "overlap"), ("short", "cover")])
def test_an_image_that_does_not_cover_every_byte_is_refused(imaged_app, tmp_path, edit, why):
    app, before, good = imaged_app("200M", "good")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    m = json.loads((bad / "manifest.json").read_text())
    chunks = m["processes"][0]["data"][0]["chunks"]
    if edit == "drop":
        del chunks[1]
    elif edit == "dup":
        chunks.insert(1, dict(chunks[0]))
    else:
        chunks.pop()
    (bad / "manifest.json").write_text(json.dumps(m))
    one_line(gpucr_cli("restore", "--image", str(bad), str(app.pid)), why)
    assert gpucr.status(app.pid).state == "checkpointed"
    gpucr.restore(app.pid, image=good)
    assert app.ask("digest") == before
