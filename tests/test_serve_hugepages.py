"""`gpucr serve --prepare-staging SIZE --reserve-hugepages` (gpucr.server.hugepages) on simcuda, with the host's
real hugepages: SIZE reserved in 2 MiB pages at the start, the pool made on them and lent to an app's first park,
all given back at the stop; a server killed before that leaves its count, which the next server gives back. These
change /proc/sys/vm/nr_hugepages for the whole machine, so they run alone (serial): another test's staging would
otherwise find hugepages free and take them."""
from __future__ import annotations

import os
import signal

import pytest

import gpucr
from gpucr.dataplane.hostmem import NR_HUGEPAGES, meminfo_kib
from gpucr.server import hugepages

from conftest import RunningServer, gpucr_cli
from test_server import one_line_error
from test_staging_pool import _segments, pool, wait_for  # noqa: F401 (16 MiB segments, autouse)

MiB = 1 << 20
PAGES = 32   # --prepare-staging 64M


def _can_reserve() -> str | None:
    """Why hugepages cannot be reserved here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to write /proc/sys/vm/nr_hugepages"
    if not os.access(NR_HUGEPAGES, os.W_OK):
        return f"{NR_HUGEPAGES} is read-only here (a container without it)"
    try:
        os.close(os.memfd_create("gpucr-test", os.MFD_HUGETLB))
    except OSError as exc:
        return f"this kernel makes no hugetlbfs memfd ({exc.strerror})"
    return None


def nr() -> int:
    return int(NR_HUGEPAGES.read_text())


@pytest.mark.parametrize("args, words", [
    ((), "give one"),
    (("--prepare-staging", "auto"), "give one"),
    (("--prepare-staging", "0"), "give one"),
])
def test_reserving_hugepages_needs_a_size_to_reserve(args, words):
    one_line_error(gpucr_cli("serve", "--simulate", "--reserve-hugepages", *args), "--reserve-hugepages", words)


@pytest.mark.serial
@pytest.mark.skipif(_can_reserve() is not None, reason=str(_can_reserve()))
def test_the_pool_is_made_on_the_hugepages_the_server_reserves_and_gives_back(sim_app, monkeypatch):
    monkeypatch.setenv("GPUCR_STAGING", "auto")   # (shm in test_staging_pool's fixture) as users run apps
    before, free_before = nr(), meminfo_kib("HugePages_Free")
    srv = RunningServer(True, "--prepare-staging", "64M", "--reserve-hugepages")
    try:
        wait_for(lambda: pool(srv)["making_bytes"] == 0 and pool(srv)["free_bytes"] == 64 * MiB, what="the pool")
        assert nr() == before + PAGES
        assert meminfo_kib("HugePages_Free") == free_before, "the pool's segments are not on the reserved hugepages"
        assert f"reserved {PAGES} of {PAGES} hugepages (64 MiB)" in srv.log.read_text()
        app = sim_app("--sizes", "8M,8M,8M,6M")   # its first park is lent two segments of them
        digest = app.ask("digest")
        ck = gpucr.checkpoint(app.pid)
        assert ck.staging_lent_bytes == 32 * MiB and ck.staging_made_bytes == 0, ck
        gpucr.restore(app.pid)
        assert app.ask("digest") == digest
    finally:
        srv.stop()
    assert nr() == before   # the two segments the app holds are surplus now, freed when it lets go
    assert f"gave back {PAGES} hugepages reserved for staging made ahead" in srv.log.read_text()
    assert not hugepages.record_of(srv.socket).exists()


@pytest.mark.serial
@pytest.mark.skipif(_can_reserve() is not None, reason=str(_can_reserve()))
def test_hugepages_a_killed_server_left_are_given_back_by_the_next_one():
    before = nr()
    srv = RunningServer(True, "--prepare-staging", "64M", "--reserve-hugepages")
    try:
        wait_for(lambda: pool(srv)["free_bytes"] == 64 * MiB, what="the pool")
    finally:
        os.kill(srv.pid, signal.SIGKILL)
        srv.stop()
    assert nr() == before + PAGES and hugepages.record_of(srv.socket).read_text().strip() == str(PAGES)
    again = RunningServer(True)   # no flag: it gives back what the killed one left, then serves
    try:
        assert nr() == before
        assert f"gave back {PAGES} hugepages that a server stopped without giving back left reserved" in \
            again.log.read_text()
        assert not hugepages.record_of(again.socket).exists()
    finally:
        again.stop()
