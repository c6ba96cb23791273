"""F24 (issue 24): a process that shrinks its staging file under the gpucr server's mapping must not fault the
server. The agent seals its staging memfds against shrinking; the server refuses a memfd not sealed so and a
file shorter than it says right before each request's copies; simcuda, as the driver copies from the pages it
pinned, never faults on a pinned range whose file was truncated (the copy fails instead)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

import gpucr

from conftest import ROOT


def _staging_fds(pid: int) -> list[str]:
    """Paths under /proc/PID/fd of the process's staging memfds."""
    fds, out = f"/proc/{pid}/fd", []
    for n in os.listdir(fds):
        with contextlib.suppress(FileNotFoundError):   # closed meanwhile by one of its threads
            if os.readlink(f"{fds}/{n}").startswith("/memfd:gpucr-staging"):
                out.append(f"{fds}/{n}")
    return out


@pytest.mark.parametrize("kind", ["shm", "hugetlbfs"])
def test_the_agent_seals_its_staging_memfds_against_shrinking(sim_app, kind):
    """The target plays the attacker on its own staging: ftruncate to 0 is refused by the kernel, the data stays."""
    free = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("HugePages_Free:"))
    if kind == "hugetlbfs" and free < 24:
        pytest.skip("needs 24 free hugepages (as root: echo 24 > /proc/sys/vm/nr_hugepages)")
    app = sim_app("--sizes", "16M", env={**os.environ, "GPUCR_STAGING": kind})
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    segs = _staging_fds(app.pid)
    assert segs, "the checkpoint made staging"
    for path in segs:
        fd = os.open(path, os.O_RDWR)
        try:
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK, path
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_the_server_refuses_an_unsealed_memfd_and_survives_a_file_shrunk_under_its_pin(tmp_path):
    """A staging memfd that can be shrunk did not come from gpucr's agent: refused before it is mapped. A file
    staging (which cannot be sealed) shrunk after the server mapped and pinned it fails the next copy with an
    error; the server lives (it took SIGBUS): run in a process of its own."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from gpucr import paths
        from gpucr.driver import driver_for
        from gpucr.errors import GpucrError
        from gpucr.memory import Managed
        from gpucr.dataplane.mover import Mover
        mover = Mover(driver_for(str(paths.simcuda_dir() / "libcuda.so.1")))
        uuid = next(iter(mover.vmm.device_by_uuid()))
        layout = {{"segments": [{{"index": 0, "bytes": 4 << 20}}], "allocations": []}}
        unsealed = os.memfd_create("gpucr-staging")
        os.ftruncate(unsealed, 4 << 20)
        try:
            mover.pin_ahead(1, layout, [unsealed], uuid)
            print("unsealed memfd: mapped")
        except GpucrError as exc:
            print("unsealed memfd: refused:", exc)
        disk = os.open({str(tmp_path / "seg")!r}, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(disk, 4 << 20)
        mover.pin_ahead(2, layout, [disk], uuid)   # mapped and pinned, kept for the next copy
        os.ftruncate(disk, 0)
        h = mover.vmm.create(2 << 20, 0)
        va, s = mover.vmm.map(h, 2 << 20, 0), mover.vmm.stream()
        mover.vmm.memset(va, 2 << 20, s, 1)   # not zero: a zero chunk would not be copied at all
        mover.vmm.sync(s)
        mover.vmm.unmap(va, 2 << 20)
        mem = [Managed(0, "converted", 2 << 20, 0, True, False, [], mover.vmm.export_fd(h), uuid, True, True)]
        placed = {{**layout, "allocations": [{{"index": 0, "bytes": 2 << 20, "segment": 0, "offset": 0}}]}}
        try:
            mover.copy_out(2, placed, [disk], mem)
            print("shrunk file: copied")
        except GpucrError as exc:
            print("shrunk file: refused:", exc)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout}{r.stderr}"
    assert "unsealed memfd: refused:" in r.stdout and "not sealed against shrinking" in r.stdout, r.stdout
    # the copy itself fails, as the driver fails a copy through pages gone from under its pin (simcuda: 700)
    assert ("shrunk file: refused: the gpucr server's copy out failed: copying out failed: an illegal memory "
            "access was encountered (CUDA error 700)") in r.stdout, r.stdout


def test_simcuda_never_faults_on_a_pinned_range_whose_file_was_truncated(tmp_path):
    """As the driver copies from the pages it pinned: a copy into or out of a registered file mapping truncated
    since fails with an error, and the process lives (it took SIGBUS)."""
    script = textwrap.dedent(f"""
        import ctypes, mmap, os, sys
        sys.path.insert(0, {str(ROOT / "src")!r})
        from gpucr import paths
        from gpucr.driver import DriverError, driver_for
        from gpucr.vmm import Vmm
        vmm = Vmm(driver_for(str(paths.simcuda_dir() / "libcuda.so.1")))
        vmm.use(vmm.retain_context(0))
        s, n = vmm.stream(), 4 << 20
        dev = vmm.alloc(n)
        fd = os.open({str(tmp_path / "staging")!r}, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, n)
        m = mmap.mmap(fd, n)
        host = ctypes.addressof(ctypes.c_char.from_buffer(m))
        vmm.pin(host, n)
        vmm.d2h(host, dev, n, s); vmm.sync(s)
        os.ftruncate(fd, 0)
        for what, copy in (("out", lambda: vmm.d2h(host, dev, n, s)), ("in", lambda: vmm.h2d(dev, host, n, s))):
            try:
                copy(); vmm.sync(s)
                print(what, "copied")
            except DriverError as exc:
                print(what, "refused:", exc)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout}{r.stderr}"
    assert r.stdout.count("refused") == 2, r.stdout
