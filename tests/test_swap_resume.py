"""The swap service's resume on demand against what its benchmark found (issues 27/28), on simcuda through a real
`gpucr serve --simulate` and real apps under `gpucr run --swap`: a resume that would fail half way (its context
back, its data short) is refused up front and gets room; a resume whose try fails is tried again, never left
hanging; room is made before the restore where the known need does not fit; an app parked before the service read
its memory gets room from its checkpoint's own count; the fewest apps are parked, the least recently active first."""
from __future__ import annotations

import re
import time

import pytest

from conftest import gpucr_cli
from gpucr.server import route
import test_swap
from test_swap import _state, _until, _watched

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app   # its fixtures: a server kept running, its apps
BY = "test"


def _park(name: str) -> None:
    """The service's own park of an app, by hand (as `gpucr top`'s p): its next demanding call resumes it."""
    assert route.swap("swap_park", {"name": name, "by": BY}, BY)["state"] == "parked"


@pytest.fixture
def gpu_320(monkeypatch):
    """A simulated GPU of 320 MiB (simcuda counts 64 MiB for each context), set before the server that reads it."""
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(320 << 20))


def _a_parked_beside_b(srv, swap_app):
    """On 320 MiB: a (32 MiB and its context) parked by hand, then b (104 MiB and its context) resident beside the
    server's context: 88 MiB free, where a's context (64) fits, or its data, not both. a's digest before its park."""
    a = swap_app("a", sizes="32M")
    _watched(srv, "a")
    before = a.ask("digest")["digest"]
    _park("a")
    b = swap_app("b", sizes="104M")
    _watched(srv, "b")
    b.ask("work 1")
    return a, b, before


def test_a_resume_whose_context_fits_but_not_its_data_is_refused_up_front_and_gets_room(gpu_320, swap_server,
                                                                                       swap_app):
    """The room check counts the context the park freed, so room is made (b parked) and a comes back intact, instead
    of its data failing to allocate after its context came back, and hanging."""
    a, b, before = _a_parked_beside_b(swap_server, swap_app)
    assert a.ask("digest", timeout=60)["digest"] == before   # its demand: the resume, with room made
    _until("a resident", lambda: _state(swap_server, "a") == "resident")
    assert _state(swap_server, "b") == "parked"
    log = swap_server.log.read_text()
    assert "resuming swap app a" in log, log
    assert not re.search(r"failed at (driver restore|data in)|making \d+ MiB", log), log   # never half way
    assert b.ask("digest", timeout=60)["digest"]   # and b comes back in turn


def test_room_is_made_before_the_restore_where_the_known_need_does_not_fit_and_it_restores_once(
        gpu_320, swap_server, swap_app):
    """a's need (what the driver counted it held when parked: 96 MiB) is more than the 88 MiB free: b is parked
    first, then a is restored once, with no restore refused for memory before it."""
    a, b, before = _a_parked_beside_b(swap_server, swap_app)
    assert a.ask("digest", timeout=60)["digest"] == before
    _until("a resident", lambda: _state(swap_server, "a") == "resident")
    log = swap_server.log.read_text()
    # a restore, or a two-way switch with b (b out while a comes in, docs/swap.md): once, with room first
    tries = re.findall(rf"(?:restore|two-way switch) of process {a.pid} \(swap\): (\w+)", log)
    assert tries == ["done"], log
    room = re.search(r"room for swap app a \(pid \d+\): its resume, \d+ bytes on GPU \S+: (parked|switched both ways "
                     r"with) b", log)
    done = re.search(rf"(?:restore|two-way switch) of process {a.pid} \(swap\): done", log)
    assert room and done and (room[1] == "parked" and room.start() < done.start() or room[1] != "parked"), log
    assert "waits for room for its resume" not in log, log
    assert route.swap("swap_app", {"name": "a"}, BY)["refusals"]["resume_retried"] == 0


def test_a_restore_counts_the_context_its_checkpoint_freed_and_is_refused_before_anything_is_restored(
        gpu_320, swap_server, sim_app):
    """Through the server, as `gpucr checkpoint` and `gpucr restore`: with 88 MiB free, a process of 32 MiB of data and
    its context (64 MiB) is refused by the room check (some 94 MiB needed), not half way by the driver or the data plane."""
    a = sim_app("--sizes", "32M")
    before = a.ask("digest")["digest"]
    r = gpucr_cli("checkpoint", str(a.pid))
    assert r.returncode == 0, r.stderr
    b = sim_app("--sizes", "104M")
    b.ask("work 1")
    r = gpucr_cli("restore", str(a.pid))
    assert r.returncode != 0
    m = re.search(r"not enough free GPU memory on \S+ to restore process \d+: (\d+) MiB are needed", r.stderr)
    assert m and int(m.group(1)) > 88, r.stderr   # its data (32) and its context, as its checkpoint freed it (~62)
    assert "nothing was restored" in r.stderr, r.stderr
    b.close()
    r = gpucr_cli("restore", str(a.pid))
    assert r.returncode == 0, r.stderr
    assert a.ask("digest")["digest"] == before


def test_a_resume_that_fails_is_tried_again_never_left_hanging_and_counted(swap_server, swap_app, monkeypatch):
    """The driver refuses the app's first restore (SIMCUDA_FAIL_RESTORE: CUDA_ERROR_UNKNOWN, once): its demanding call
    does not wait at the gate with nobody working on it; the service tries again, the app comes back intact, and the
    failed try is logged and counted (refusals: resume_retried)."""
    monkeypatch.setenv("SIMCUDA_FAIL_RESTORE", "1")   # the app's simcuda reads it; the server runs already
    app = swap_app("flaky", sizes="8M")
    _watched(swap_server, "flaky")
    before = app.ask("digest")["digest"]
    _park("flaky")
    assert app.ask("digest", timeout=60)["digest"] == before
    _until("flaky resident", lambda: _state(swap_server, "flaky") == "resident")
    row = route.swap("swap_app", {"name": "flaky"}, BY)
    assert row["refusals"]["resume_retried"] >= 1 and row["refusals"]["resume_failed"] == 0, row
    assert row["resumes"] == 1, row
    log = swap_server.log.read_text()
    assert re.search(r"swap app flaky \(pid \d+\) waits for another try of its resume: .*CUDA error 999", log), log


def test_an_app_parked_before_its_memory_was_read_gets_room_for_its_resume_from_its_checkpoint(
        gpu_320, swap_server, swap_app):
    """late (80 MiB and its context) is parked the moment it is up, before the service has read its memory; then b
    (64 MiB and its context) leaves 128 MiB free. The service knows late's need from its park's own result (bytes
    per GPU, as the driver counted them), so b is parked for its resume, and it comes back intact."""
    late = swap_app("late", sizes="80M")
    before = late.ask("digest")["digest"]
    _park("late")
    row = route.swap("swap_app", {"name": "late"}, BY)
    assert sum(row["peak_bytes"].values()) >= (80 + 64) << 20, row   # its need, read or not
    b = swap_app("b", sizes="64M")
    _watched(swap_server, "b")
    b.ask("work 1")
    assert late.ask("digest", timeout=60)["digest"] == before
    _until("late resident", lambda: _state(swap_server, "late") == "resident")
    assert _state(swap_server, "b") == "parked"


@pytest.fixture
def gpu_400(monkeypatch):
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(400 << 20))


def _active_in_order(*apps) -> None:
    """Each app launches work, one after another, more than a status read (a second) apart: the first is the least
    recently active."""
    for w in apps:
        w.ask("work 1")
        time.sleep(1.5)


def test_room_parks_the_one_app_that_makes_it_rather_than_an_older_one_too(gpu_400, swap_server, swap_app):
    """400 MiB: the server's context, old (8 MiB, 72 with its context), big (96 MiB, 160) and asker (72) leave 32 MiB;
    asker's 120 MiB need 90 more. old alone is too little: the least recently active first would park old, then big;
    the fewest that make room is big alone."""
    old, big, asker = swap_app("old", sizes="8M"), swap_app("big", sizes="96M"), swap_app("asker", sizes="8M")
    _watched(swap_server, "old", "big", "asker")
    _active_in_order(old, big)
    assert asker.ask(f"alloc {120 << 20}", timeout=60).get("ptr")
    assert _state(swap_server, "big") == "parked" and _state(swap_server, "old") == "resident"
    assert re.search(r"room for swap app asker \(pid \d+\): \d+ bytes \(\d+ free\) on GPU \S+: parked big\n",
                     swap_server.log.read_text())


def test_room_parks_the_least_recently_active_as_of_the_request_not_of_the_last_status_read(gpu_320, swap_server,
                                                                                           swap_app):
    """320 MiB: the server's context and three apps of 8 MiB (72 with their contexts) leave 40 MiB; asker's 64 MiB
    need one app parked. y was active first, then x, then y again just before the request: x is the least recently
    active, though the status read a second ago still has y's first launch."""
    x, y, asker = swap_app("x", sizes="8M"), swap_app("y", sizes="8M"), swap_app("asker", sizes="8M")
    _watched(swap_server, "x", "y", "asker")
    _active_in_order(y, x)
    y.ask("work 1")
    assert asker.ask(f"alloc {64 << 20}", timeout=60).get("ptr")
    assert _state(swap_server, "x") == "parked" and _state(swap_server, "y") == "resident"
