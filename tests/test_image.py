"""Checkpoint images and their certificate, on simcuda: written, host memory freed, restored
byte-exact; every broken or foreign image refused with the process still restorable."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import gpucr
from gpucr.driver import ProcessState

from conftest import RunningServer, gpucr_cli, sim_driver
from test_server import wait_for

# every test here goes through one gpucr server reused by the module, as a user's requests do; those marked
# in_process run a server of their own, or the CLI's own mover
pytestmark = pytest.mark.usefixtures("reused_server")

MiB = 1 << 20
PLANES = ["server", pytest.param("cli", marks=pytest.mark.in_process)]   # in-process: the CLI's own mover


def rss_shmem(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def chunk_file_offset(image: Path, zero: bool = False) -> int:
    m = json.loads((image / "manifest.json").read_text())
    for a in m["processes"][0]["data"]:
        for c in a["chunks"]:
            if bool(c.get("zero")) == zero:
                return a["file_offset"] + c["offset"]
    raise AssertionError("no such chunk")


def server_staging_of(server, pid: int) -> list[dict]:
    """What the gpucr server still maps or pins of process pid's staging (none without a server)."""
    return [h for h in server.info()["staging"] if h["pid"] == pid] if server is not None else []


@pytest.mark.parametrize("plane", PLANES)
def test_image_frees_host_memory_and_restores_byte_exact(sim_app, tmp_path, reused_server, plane):
    app = sim_app("--sizes", "64M,16M,3M,100K", "--vmm-mib", "16")
    app.ask(f"alloc {32 * MiB}")   # filled with a pattern; plus a zero buffer below
    before = app.ask("digest")
    img = tmp_path / "img"
    ck = gpucr.checkpoint(app.pid, image=img)
    assert ck.data_plane == plane, ck
    # written from the GPU straight to the image through the plane's ring: no staging made, pinned or kept
    assert "staging" not in ck.phases_s and "server_pin" not in ck.phases_s, ck.phases_s
    assert (img / "manifest.json").exists() and (img / "data.bin").exists()
    st = gpucr.status(app.pid)
    assert st.staging_bytes == 0 and st.staged is False
    assert rss_shmem(app.pid) < 16 * MiB, "the staging must be released after the image is written"
    assert server_staging_of(reused_server, app.pid) == [], "the server must let go of the staging too"
    assert ck.image.bytes >= 64 * MiB
    m = json.loads((img / "manifest.json").read_text())
    p = m["processes"][0]
    assert p["pid"] == app.pid and p["generation"] == 1 and m["simulated"] is True
    assert p["domains"]["cuda_data"] == "covered" and p["domains"]["app_epoch"] == "unknown" and p["unknown"] == []
    r = gpucr_cli("inspect", str(img))
    assert r.returncode == 0 and f"process {app.pid}" in r.stdout and "chunks" in r.stdout
    # without the image, a restore is refused clearly
    with pytest.raises(gpucr.GpucrError, match="--image"):
        gpucr.restore(app.pid)
    rs = gpucr.restore(app.pid, image=img)
    assert rs.data_plane == plane and rs.bytes_moved == ck.bytes_moved, rs
    assert rs.image.bytes == ck.image.bytes and rs.image.bytes_read == ck.image.bytes_written
    assert app.ask("digest") == before   # every buffer's bytes, read at its own address
    # read straight from the image into the plane's ring and on to the GPU: no staging was made for it
    assert gpucr.status(app.pid).staging_bytes == 0 and "stage" not in rs.phases_s, rs.phases_s
    assert server_staging_of(reused_server, app.pid) == []


def test_zero_chunks_are_recorded_not_written(sim_app, tmp_path):
    app = sim_app("--sizes", "8M,256M")
    app.ask("zero 1")
    before = app.ask("digest")
    img = tmp_path / "z"
    ck = gpucr.checkpoint(app.pid, image=img)
    assert ck.image.bytes >= 264 * MiB and ck.image.bytes_written <= 8 * MiB
    m = json.loads((img / "manifest.json").read_text())
    zero = [c for a in m["processes"][0]["data"] for c in a["chunks"] if c.get("zero")]
    assert len(zero) == 4 and all("xxh3_64" not in c for c in zero)
    assert os.stat(img / "data.bin").st_blocks * 512 <= 16 * MiB, "zero chunks must not take disk space"
    gpucr.restore(app.pid, image=img)
    assert app.ask("digest") == before


def test_broken_and_foreign_images_are_refused(imaged_app, tmp_path):
    app, before, old = imaged_app("64M,8M", "gen1")
    gpucr.restore(app.pid, image=old)
    assert app.ask("digest") == before

    good = tmp_path / "gen2"
    gpucr.checkpoint(app.pid, image=good)
    def broken(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    corrupt = broken("corrupt")
    with open(corrupt / "data.bin", "r+b") as f:
        off = chunk_file_offset(corrupt) + 4096
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    truncated = broken("truncated")
    os.truncate(truncated / "data.bin", (truncated / "data.bin").stat().st_size - 4096)
    no_manifest = broken("nomanifest")
    (no_manifest / "manifest.json").unlink()
    split = broken("split")   # chunks that still tile every byte, but not in the pieces the data plane reads
    m = json.loads((split / "manifest.json").read_text())
    first = m["processes"][0]["data"][0]
    whole = first["chunks"][0]
    first["chunks"][:1] = [{**whole, "bytes": whole["bytes"] // 2},
                           {**whole, "offset": whole["offset"] + whole["bytes"] // 2, "bytes": whole["bytes"] // 2}]
    (split / "manifest.json").write_text(json.dumps(m))

    other, _, foreign = imaged_app("64M,8M", "foreign")

    cases = [(corrupt, "does not match its digest"), (truncated, "truncated"), (no_manifest, "no checkpoint manifest"),
             (foreign, f"not of process {app.pid}"), (old, "stale image"), (split, "MiB pieces (not an image gpucr wrote)")]
    for image, why in cases:
        r = gpucr_cli("restore", "--image", str(image), str(app.pid))
        assert r.returncode != 0, image
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and why in lines[0], (image, r.stderr)
        assert gpucr.status(app.pid).state == "checkpointed"
    gpucr.restore(app.pid, image=good)
    assert app.ask("digest") == before
    gpucr.restore(other.pid, image=foreign)


def test_an_image_is_read_in_the_pieces_the_data_plane_copies():
    """Each piece the ring reads from an image is one chunk of it, checked whole against its digest."""
    from gpucr.dataplane.mover import CHUNK as PIECE
    from gpucr.image import CHUNK
    assert CHUNK == PIECE


def test_app_joins_the_cut(sim_app, tmp_path):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    app.ask("join ok 41")
    img = tmp_path / "joined"
    gpucr.checkpoint(app.pid, image=img, timeout=5)
    m = json.loads((img / "manifest.json").read_text())
    assert m["processes"][0]["domains"]["app_epoch"] == 41
    gpucr.restore(app.pid, image=img)
    assert app.ask("joined") == {"prepared": 1, "resumed": 1}
    assert app.ask("digest") == before


@pytest.mark.parametrize("mode,why", [("fail", "refused to prepare"), ("hang", "did not finish within the deadline")])
def test_app_prepare_failing_or_hanging_aborts_and_app_runs_on(sim_app, mode, why):
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    app.ask(f"join {mode}")
    t0 = time.perf_counter()
    with pytest.raises(gpucr.GpucrError, match=why):
        gpucr.checkpoint(app.pid, timeout=1.0)
    assert time.perf_counter() - t0 < 5
    assert gpucr.status(app.pid).state == "running"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    app.ask("work 2")
    app.ask("work -2")
    assert app.ask("digest")["digest"] == before["digest"]


@pytest.mark.parametrize("plane", PLANES)
def test_zero_chunks_are_set_on_the_device_at_restore(sim_app, tmp_path, plane):
    app = sim_app("--sizes", "8M,192M")
    app.ask("zero 1")
    before = app.ask("digest")
    img = tmp_path / "z2"
    gpucr.checkpoint(app.pid, image=img)
    rs = gpucr.restore(app.pid, image=img)
    assert rs.data_plane == plane
    assert app.ask("digest") == before
    assert rs.image.bytes_zeroed == 192 * MiB, "zero chunks set by memset, not copied"
    # then the buffer is changed and checkpointed to memory: no zero-chunk marks may linger
    app.ask("work 3")
    after_work = app.ask("digest")
    gpucr.checkpoint(app.pid)
    again = gpucr.restore(app.pid)
    assert app.ask("digest") == after_work
    assert again.image is None and again.bytes_moved == 200 * MiB, again
    assert rs.image.bytes >= 200 * MiB


def test_status_shows_the_live_certificate(sim_app):
    app = sim_app("--sizes", "16M,4M")
    app.ask("join ok 7")
    assert gpucr.status(app.pid).certificate is None
    gpucr.checkpoint(app.pid)
    cert = gpucr.status(app.pid).certificate
    p = cert["processes"][0]
    assert cert["version"] == 1 and cert["id"] == "live" and cert["level"] == "full" and cert["where"] == "host memory"
    assert p["pid"] == app.pid and p["generation"] == 1 and p["allocations"]["count"] == 2
    assert p["allocations"]["bytes"] == 20 * MiB and p["domains"]["app_epoch"] == 7 and p["unknown"] == []
    r = gpucr_cli("status", "--json", str(app.pid))
    assert json.loads(r.stdout)["processes"][0]["certificate"]["processes"][0]["pid"] == app.pid
    gpucr.restore(app.pid)


def _own_server(monkeypatch, **env: str) -> RunningServer:
    """A gpucr server of the test's own, started with these settings in its environment only."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        return RunningServer(True)
    finally:
        for k in env:
            monkeypatch.delenv(k)


@pytest.mark.in_process   # a server of its own, killed
def test_server_killed_reading_an_image_leaves_it_restorable_from_the_image(sim_app, tmp_path, monkeypatch):
    """The server SIGKILLed while it reads the image into staging: what it read in part is dropped by the agent
    (never restored from), and the process, checkpointed, comes back from the image through the next server."""
    app = sim_app("--sizes", "200M,8M")
    before = app.ask("digest")
    img = tmp_path / "img"
    srv = _own_server(monkeypatch, GPUCR_TEST_KILL_AT="during-image-read")
    try:
        assert gpucr.checkpoint(app.pid, image=img).data_plane == "server"
        r = gpucr_cli("restore", "--image", str(img), str(app.pid))
        assert r.returncode == 1 and "died during 'restore'" in r.stderr, r.stderr
        assert srv.proc.wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: not gpucr.status(app.pid).staged, what="the agent dropping the staging read in part")
        st = gpucr.status(app.pid)
        assert st.state == "checkpointed" and st.gate_closed and not st.busy, st
        with pytest.raises(gpucr.GpucrError, match="--image"):
            gpucr.restore(app.pid)
        srv = RunningServer(True)
        assert gpucr.restore(app.pid, image=img).data_plane == "server"
        assert app.ask("digest") == before
    finally:
        srv.stop()


@pytest.mark.in_process   # a server of its own, whose fill fails
def test_a_failed_fill_leaves_the_process_restorable_from_the_image(sim_app, tmp_path, monkeypatch):
    """The server cannot make the new memory: the restore fails saying so, the process stays checkpointed,
    and the next restore from the image brings every byte back, zero chunks included."""
    app = sim_app("--sizes", "8M,192M")
    app.ask("zero 1")
    before = app.ask("digest")
    img = tmp_path / "img"
    srv = _own_server(monkeypatch, SIMCUDA_FAIL_CALL="cuMemCreate")
    try:
        assert gpucr.checkpoint(app.pid, image=img).data_plane == "server"
        with pytest.raises(gpucr.GpucrError, match="making 192 MiB on GPU 0 failed"):
            gpucr.restore(app.pid, image=img)
        assert gpucr.status(app.pid).state == "checkpointed"
        rs = gpucr.restore(app.pid, image=img)
        assert rs.data_plane == "server" and rs.image.bytes_zeroed == 192 * MiB, rs
        assert app.ask("digest") == before
        assert gpucr.checkpoint(app.pid).data_plane == "server"   # the fault fired once: the next cycle is the server's
        assert gpucr.restore(app.pid).data_plane == "server" and app.ask("digest") == before
    finally:
        srv.stop()
