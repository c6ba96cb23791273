"""The swap service's faults and room rules on simcuda (issue 27, items 3, 7 and 8): real `gpucr serve`, real apps under
`gpucr run --swap`, real sockets. A server killed in a resume loses no app; a park past its deadline leaves the app
resident; --wait-limit ends an allocation's wait with out-of-memory and never a launch's; waits are shown; a parked
app that is killed frees its staging; two apps taking turns switch no more often than --min-resident allows; room
is served in priority order, counts the server's own context, is asked on a retrying allocator's retry only, never
parks another user's app, and is rate-limited per app."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from conftest import RunningServer, gpucr_cli, kill_all
from gpucr.server import route
from gpucr.swap.limits import RateLimit
from gpucr.swap.queue import RoomQueue
from gpucr.workloads.runner import Workload
import test_swap
from test_swap import IDLE_PARK_S, _apps, _state, _status, _until, _watched

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app   # its fixtures: a server kept running, its apps


def _swap_argv(name: str, *flags: str, sizes: str) -> list[str]:
    return [sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--swap", "--name", name, *flags, "--",
            sys.executable, "-m", "gpucr.workloads.driver_app", "--sizes", sizes]


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    """fn() run in a thread: its result (or error) lands in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:   # noqa: BLE001 - the test looks at it
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.fixture
def gpu_mib(monkeypatch):
    """A simulated GPU of this many MiB (simcuda counts 64 MiB for each context: each app's and the server's), set
    before the server that reads it starts."""
    return lambda mib: monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(mib << 20))


@pytest.fixture
def gpu_320(monkeypatch):
    """320 MiB: the server's context, an app of 64 MiB and one of 16 MiB (with theirs) leave 48 MiB free."""
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(320 << 20))


@pytest.fixture
def gpu_300(monkeypatch):
    """300 MiB: the server's context and one app of 64 MiB with its own fit; a second one's does not."""
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(300 << 20))


# ---- item 7: faults ----

@pytest.mark.parametrize("point", ["after-driver-restore", "after-driver-unlock"])
def test_a_server_killed_during_a_resume_leaves_the_app_resident_or_parked_and_restorable(monkeypatch, point):
    """Never both, never neither: the app is either running with its data, or checkpointed and restored by hand; the
    call that woke it (waiting at the gate) then goes on with the data intact."""
    monkeypatch.setenv("GPUCR_TEST_KILL_AT", point)   # only a restore passes these points: the park goes through
    srv = RunningServer(True)
    monkeypatch.delenv("GPUCR_TEST_KILL_AT")
    app = Workload("driver_app", simulate=True, argv=_swap_argv("victim", "--idle-park", str(IDLE_PARK_S), sizes="8M,3M"))
    try:
        before = app.ask("digest")["digest"]
        _until("the app is parked", lambda: _state(srv, "victim") == "parked")
        waker, got = _in_thread(lambda: app.ask("digest", timeout=60)["digest"])   # demand: the server resumes
        _until("the server died resuming the app", lambda: srv.proc.poll() is not None)
        state = _until("the app settled", lambda: (s := _status(app.pid)) and not s["busy"] and s)
        assert state["state"] in ("running", "checkpointed"), state
        if state["state"] == "checkpointed":
            r = gpucr_cli("restore", "--no-server", str(app.pid))
            assert r.returncode == 0, r.stderr
        waker.join(60)
        assert got.get("result") == before, got
        assert app.ask("digest")["digest"] == before and app.proc.poll() is None
    finally:
        app.proc.kill()
        app.proc.wait()
        srv.stop()


def test_an_app_that_misses_its_park_deadline_stays_resident(swap_server, swap_app):
    """A kernel in flight longer than --park-deadline: the park is given up, the app stays resident and answers, its
    data intact; it is parked once the kernel has returned."""
    app = swap_app("busy", "--idle-park", str(IDLE_PARK_S), "--park-deadline", "1")
    before = app.ask("digest")["digest"]
    app.ask("spin 4000")   # simcuda runs the kernel on the launching thread: in flight for 4 s
    _until("a park failed", lambda: "park failed" in _apps(swap_server)["busy"]["why"], timeout=10)
    assert _state(swap_server, "busy") == "resident"
    log = swap_server.log.read_text()
    assert re.search(r"parking swap app busy \(pid \d+\) failed, it stays resident", log), log
    assert app.ask("digest", timeout=10)["digest"] == before
    _until("parked once the kernel returned", lambda: _state(swap_server, "busy") == "parked", timeout=20)
    assert app.ask("digest", timeout=30)["digest"] == before


def test_an_allocation_waiting_for_room_past_its_wait_limit_gets_out_of_memory_and_is_shown_waiting(
        gpu_320, swap_server, swap_app):
    """The room's park waits for the other app's kernel to drain (4 s); the asker's --wait-limit of 1 s ends its
    allocation's wait with CUDA_ERROR_OUT_OF_MEMORY meanwhile, and `gpucr ps` shows it waiting for room."""
    slow = swap_app("slow", "--park-deadline", "20", sizes="64M")
    asker = swap_app("asker", "--priority", "1", "--wait-limit", "1", sizes="16M")
    _watched(swap_server, "slow", "asker")
    slow.ask("spin 4000")
    t0 = time.monotonic()
    waiter, got = _in_thread(lambda: asker.ask(f"alloc {56 << 20}", timeout=60))
    shown = _until("ps shows the asker waiting for room", lambda: (m := re.search(
        r"asker\s.*\(WAITING [\d.]+ s for room: 58720256 bytes", gpucr_cli("ps").stdout)) and m, timeout=5)
    assert shown
    waiter.join(30)
    assert "CUDA error 2" in str(got.get("error")), got   # out-of-memory, as without the service
    assert time.monotonic() - t0 < 3.5, "the wait ended at its limit, not with the park"
    _until("slow parked once its kernel returned", lambda: _state(swap_server, "slow") == "parked", timeout=20)


def test_a_wait_for_a_resume_past_the_wait_limit_fails_an_allocation_and_never_a_launch(gpu_320, swap_server,
                                                                                        swap_app):
    """A parked app whose resume finds no room (the rest is a higher priority app's): its allocation gets
    out-of-memory at --wait-limit, its launch waits on (shown in ps and logged), and goes on once room is freed."""
    low = swap_app("low", "--idle-park", str(IDLE_PARK_S), "--wait-limit", "1", sizes="64M")
    before = low.ask("digest")["digest"]
    _until("low parked", lambda: _state(swap_server, "low") == "parked")
    boss = swap_app("boss", "--priority", "5", sizes="96M")   # 64 + 64 (server) + 160: 32 MiB left, low needs 128
    _watched(swap_server, "boss")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        low.ask("alloc 65536", timeout=30)
    assert 0.9 < time.monotonic() - t0 < 5
    launcher, got = _in_thread(lambda: low.ask("work 1", timeout=120))
    time.sleep(2.5)
    assert launcher.is_alive() and not got, f"a launch keeps waiting, and fails with nothing: {got}"
    row = _apps(swap_server)["low"]
    assert row["state"] == "resuming" and "its resume" in row["waiting"], row   # (or room for it, a moment)
    assert re.search(r"low\s.*resuming.*\(WAITING [\d.]+ s for (room: )?its resume", gpucr_cli("ps").stdout)
    log = swap_server.log.read_text()
    assert "swap app low" in log and "waits for room for its resume" in log, log
    assert "boss (its priority 5 is above the asker's 0)" in log, log
    boss.ask("free 0")   # room again: the resume goes through, the launch goes on
    launcher.join(60)
    assert got.get("result", {}).get("done"), got
    low.ask("work -1")
    assert low.ask("digest")["digest"] == before
    assert _apps(swap_server)["low"]["waiting"] == ""


def test_an_app_killed_while_parked_frees_its_staging(swap_server, swap_app):
    app = swap_app("doomed", "--idle-park", str(IDLE_PARK_S), sizes="32M")
    _until("parked", lambda: _state(swap_server, "doomed") == "parked")
    held = [h for h in swap_server.info()["staging"] if h["pid"] == app.pid]
    assert held and held[0]["mapped_bytes"] >= 32 << 20, swap_server.info()["staging"]
    server_pid = swap_server.info()["pid"]
    mapped = _memfd_bytes(server_pid)
    assert mapped >= 32 << 20
    app.proc.kill()
    app.proc.wait()
    _until("dropped", lambda: "doomed" not in _apps(swap_server))
    _until("the server holds none of its staging", lambda: not [h for h in swap_server.info()["staging"]
                                                                if h["pid"] == app.pid])
    assert _memfd_bytes(server_pid) <= mapped - (32 << 20), "the server's mapping of its memfds is gone"
    assert swap_server.info()["pinned_staging_bytes"] == 0


def _memfd_bytes(pid: int) -> int:
    """Bytes of staging memfds mapped in process pid (the server maps each app's to copy through)."""
    total = 0
    for line in open(f"/proc/{pid}/maps"):
        if "memfd:gpucr-staging" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total


def test_two_apps_taking_turns_switch_no_more_often_than_min_resident_allows(gpu_300, swap_server, swap_app):
    """Room for one of the two: each request to the parked one waits until the other's --min-resident is over."""
    a = swap_app("a", "--min-resident", "1.5", sizes="64M")
    b = swap_app("b", "--min-resident", "1.5", sizes="64K")
    _watched(swap_server, "a", "b")
    time.sleep(1.5)
    assert b.ask(f"alloc {64 << 20}", timeout=60).get("ptr")   # parks a
    digests = {"b": b.ask("digest")["digest"]}
    t0 = time.monotonic()
    for w, name in ((a, "a"), (b, "b")) * 3:   # request by request, in turn
        digests.setdefault(name, w.ask("digest", timeout=60)["digest"])
        assert w.ask("digest", timeout=60)["digest"] == digests[name]
    elapsed = time.monotonic() - t0
    rows = _apps(swap_server)
    switches = rows["a"]["resumes"] + rows["b"]["resumes"]
    assert switches == 6, rows
    assert elapsed >= (switches - 1) * 1.5, f"{switches} switches in {elapsed:.1f} s: more often than --min-resident"
    log = swap_server.log.read_text()
    assert re.search(r"waits for room \(its resume, \d+ bytes\) on GPU \S+ [\d.]+ s, until an app's --min-resident", log)


# ---- item 3: room rules ----

def test_room_requests_on_one_gpu_are_served_one_at_a_time_highest_priority_first():
    q, order = RoomQueue(), []
    held = threading.Event()

    def ask(name: str, prio: int) -> None:
        with q.turn("gpu", name, prio):
            order.append(name)

    with q.turn("gpu", "first", 0):
        threads = []
        for name, prio in (("low", 0), ("mid", 1), ("high", 5), ("low2", 0)):
            threads.append(threading.Thread(target=ask, args=(name, prio)))
            threads[-1].start()
            _until(f"{name} queued", lambda n=name: n in q.queued("gpu"), timeout=5)
        assert q.queued("gpu") == ["high", "mid", "low", "low2"]
        assert q.waits_on("gpu")["mid"] == {"first", "high"}
        with q.turn("other-gpu", "elsewhere", 0):   # another GPU's queue does not wait for this one
            held.set()
    for t in threads:
        t.join(5)
    assert held.is_set() and order == ["high", "mid", "low", "low2"]


@contextmanager
def _fresh_server() -> Iterator[tuple[RunningServer, Callable[..., Workload]]]:
    """A server started now (no context of its own on the GPU yet) and start(name, sizes): a swap app under it; all
    killed and stopped at the end."""
    srv = RunningServer(True)
    apps: list[Workload] = []

    def start(name: str, sizes: str) -> Workload:
        apps.append(Workload("driver_app", simulate=True, argv=_swap_argv(name, sizes=sizes)))
        return apps[-1]
    try:
        yield srv, start
    finally:
        kill_all(apps)
        srv.stop()


def test_room_counts_the_servers_own_context_measured_where_it_holds_none(gpu_mib):
    """A fresh server holds no context: 160 MiB are free, 200 asked; parking one app of 80 MiB (16 MiB and its context)
    would leave 176 once the server's context (64 MiB on simcuda, measured) is made for the park, so both are parked
    and the allocation fits at once."""
    gpu_mib(400)
    with _fresh_server() as (srv, start):
        *_, asker = [start(name, "16M") for name in ("one", "two", "asker")]
        _watched(srv, "one", "two", "asker")
        assert asker.ask(f"alloc {200 << 20}", timeout=60).get("ptr")
        assert _state(srv, "one") == "parked" and _state(srv, "two") == "parked"
        log = srv.log.read_text()
        assert re.search(r"the server's own context on GPU \S+: 64 MiB \(measured", log), log
        assert len(re.findall(r"room for swap app asker", log)) == 1, "one request was enough"


def test_room_is_made_where_the_gpu_is_too_full_to_make_the_servers_context(gpu_mib):
    """A fresh server, a 400 MiB GPU with 18 MiB free: its context (64 MiB) can be made neither to measure it nor for
    the park's copy, until the driver's checkpoint took the parked app's context off. The request was refused
    ('retaining a context ... out of memory' ended the server's watch). Now the app is parked, the allocation fits,
    and the parked app comes back on demand with its data."""
    gpu_mib(400)
    with _fresh_server() as (srv, start):
        big, asker = start("big", "2M,250M"), start("asker", "2M")
        _watched(srv, "big", "asker")
        digest = big.ask("digest")["digest"]
        assert asker.ask(f"alloc {100 << 20}", timeout=60).get("ptr"), srv.log.read_text()
        assert _state(srv, "big") == "parked"
        log = srv.log.read_text()
        assert re.search(r"the server's own context on GPU GPU-\S+ cannot be made to measure it", log), log
        assert re.search(r"room for swap app asker \(pid \d+\): .* on GPU GPU-\S+: parked big", log), log
        assert big.ask("digest", timeout=60)["digest"] == digest   # back on demand, the asker parked for it


def test_an_apps_first_allocation_gets_room_on_its_gpu(gpu_mib):
    """An app that holds no GPU memory yet has no device in its status: its room request was filed under GPU '0',
    where no app was found to park. The agent names the GPU's UUID in the request."""
    gpu_mib(600)
    with _fresh_server() as (srv, start):
        start("big", "2M,250M")
        _watched(srv, "big")
        fresh = start("fresh", "")
        _until("fresh registered", lambda: "fresh" in _apps(srv))
        time.sleep(1.0)   # the next tick starts its watch
        assert fresh.ask(f"alloc {250 << 20}", timeout=60).get("ptr"), srv.log.read_text()   # 220 MiB free
        assert _state(srv, "big") == "parked"
        assert re.search(r"room for swap app fresh \(pid \d+\): .* on GPU GPU-\S+: parked big", srv.log.read_text())


def test_an_allocation_in_an_apps_first_moments_waits_for_the_servers_first_watch_and_gets_room(gpu_mib):
    """An app that allocates as it starts, before the server watches it (its next tick), used to get out-of-memory
    with no word in the server's log; under `gpucr run --swap` it waits for the first watch (GPUCR_SWAP_FIRST_WATCH_MS)
    and room is made."""
    gpu_mib(600)
    with _fresh_server() as (srv, start):
        start("big", "2M,250M")
        _watched(srv, "big")
        early = start("early", "250M")   # allocated as it starts: 220 MiB free
        assert early.ask("digest", timeout=60)["digest"]
        assert _state(srv, "big") == "parked"
        assert re.search(r"room for swap app early \(pid \d+\): .*: parked big", srv.log.read_text())


@pytest.fixture
def gpu_500(monkeypatch):
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(500 << 20))


def test_an_app_starting_on_a_gpu_too_full_for_its_context_gets_room_for_it(gpu_500, swap_server, swap_app):
    """A swap app whose context the driver cannot make (the GPU filled by another, idle) used to die at its start
    with out-of-memory: its context asks room, sized as the server's own context there, and is made again."""
    big = swap_app("big", sizes="2M,310M")   # with its context and the server's, 440 of 500 MiB: 60 free, a context 64
    _watched(swap_server, "big")
    digest = big.ask("digest")["digest"]
    late = swap_app("late", sizes="2M")
    assert late.ask("digest", timeout=60)["digest"]
    assert _state(swap_server, "big") == "parked"
    log = swap_server.log.read_text()
    assert re.search(r"room for swap app late \(pid \d+\): a context \(64 MiB, as the server's own there\) on "
                     r"GPU GPU-\S+: parked big", log), log
    assert big.ask("digest", timeout=60)["digest"] == digest   # back on demand: the late one parked for it


def test_no_app_is_parked_for_an_app_that_ended_while_it_waited_for_room():
    """An app killed while its room request waits (here: behind another's --min-resident) gets nothing parked for it:
    the server parked the other one for a dead app after a failed two-way switch."""
    from gpucr.swap.room import Ask, RoomMaker
    from gpucr.swap.apps import Apps, SwapApp
    dead = subprocess.Popen(["true"])
    dead.wait()
    parks: list[int] = []
    log: list[str] = []
    apps = Apps()
    asker = SwapApp(dead.pid, 1, "gone")
    room = RoomMaker(apps, lambda pid, why: parks.append(pid) or True, log.append, _NoGpu())
    assert not room.make(asker, Ask("GPU-x", 1 << 20, "1 MiB", 5.0, free_hint=0))
    assert parks == [] and any("it ended, parked nobody" in line for line in log), log


class _NoGpu:
    def memory(self, uuid): return (0, 1 << 30)
    def server_cost(self, uuid): return 0
    def process_bytes(self, pid, status): return {}


def test_a_retrying_allocator_whose_cache_suffices_parks_nobody(gpu_320, swap_server, swap_app, monkeypatch):
    """As PyTorch: the first failure goes through, the app frees its cache and retries, and it fits: no room asked."""
    monkeypatch.setenv("GPUCR_SWAP_ASK_ON_RETRY", "1")
    _own_cache_suffices(swap_server, swap_app, "torchy")


def _own_cache_suffices(server: RunningServer, swap_app, name: str) -> None:
    """App `name`'s allocation fails, it frees its cache and retries, and it fits: no room asked, nobody parked."""
    swap_app("other", sizes="64M")
    app = swap_app(name, "--priority", "1", sizes="16M")
    _watched(server, "other", name)
    app.ask(f"cache {40 << 20}")   # 312 of 320 MiB held
    got = app.ask(f"alloc-retry {40 << 20}", timeout=60)
    assert got["tries"] == 2, got
    assert _state(server, "other") == "resident"
    assert f"room for swap app {name}" not in server.log.read_text()


def test_cupy_s_memory_pool_is_known_to_retry_with_no_setting(gpu_320, swap_server, swap_app, monkeypatch, tmp_path):
    """CuPy's pool frees its blocks and retries a failed allocation, as PyTorch's allocator does: an app with its module
    loaded (here a library of that name, cupy/cuda/memory.*.so: simcuda runs no CuPy) lets its first failure through
    with GPUCR_SWAP_ASK_ON_RETRY unset, so its own cache suffices and nobody is parked."""
    pool = tmp_path / "site" / "cupy" / "cuda" / "memory.cpython-311-x86_64-linux-gnu.so"
    pool.parent.mkdir(parents=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(pool), "-x", "c", "-"], input="int gpucr_test_pool;\n",
                   text=True, check=True)
    monkeypatch.delenv("GPUCR_SWAP_ASK_ON_RETRY", raising=False)
    monkeypatch.setenv("LD_PRELOAD", str(pool))   # gpucr run puts its agent before it
    _own_cache_suffices(swap_server, swap_app, "cupyish")


def test_a_retrying_allocator_asks_room_on_its_retry_and_a_plain_app_at_once(gpu_320, swap_server, swap_app,
                                                                              monkeypatch):
    monkeypatch.setenv("GPUCR_SWAP_ASK_ON_RETRY", "1")
    swap_app("other", sizes="64M")
    torchy = swap_app("torchy", "--priority", "1", sizes="16M")
    _watched(swap_server, "other", "torchy")
    torchy.ask(f"cache {8 << 20}")
    got = torchy.ask(f"alloc-retry {56 << 20}", timeout=60)   # the cache is too small: the retry asks, other parks
    assert got["tries"] == 2 and _state(swap_server, "other") == "parked", got
    assert len(re.findall(r"room for swap app torchy \(pid \d+\): 58720256 bytes", swap_server.log.read_text())) == 1


# ---- item 8: another user's apps, and the rate limit ----

def test_another_users_process_is_never_registered_and_unparked_memory_counts_as_unparkable(
        gpu_320, swap_server, swap_app, sim_app):
    """A user's server parks only that user's apps: a process of uid 65534 is refused at registration. Its memory
    cannot share a simcuda GPU with ours (simcuda's runtime dir is per user), so the memory a server cannot park is
    shown with a process of our own not under the service: named as unparkable, and left running."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user (setpriv)")
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        _until("the other user's process runs", lambda: os.path.exists(f"/proc/{other.pid}")
               and os.stat(f"/proc/{other.pid}").st_uid == 65534, timeout=5)
        with pytest.raises(Exception, match=f"process {other.pid} belongs to uid 65534: this gpucr server \\(uid 0\\) "
                                            "parks only its own user's apps"):
            route.register_swap(True, {"pid": other.pid, "name": "theirs", "priority": -5})
    finally:
        other.kill()
        other.wait()
    outsider = sim_app("--sizes", "64M")
    asker = swap_app("asker", sizes="16M")
    _watched(swap_server, "asker")
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        asker.ask(f"alloc {56 << 20}", timeout=60)
    log = swap_server.log.read_text()
    assert re.search(r"no room for swap app asker .* (\d+) MiB of the GPU are held by what this server cannot park", log)
    assert _status(outsider.pid)["state"] == "running" and "theirs" not in _apps(swap_server)


def test_an_app_asking_for_room_in_a_loop_is_slowed_to_its_rate(gpu_320, swap_server, swap_app):
    swap_app("boss", "--priority", "5", sizes="64M")
    looper = swap_app("looper", sizes="16M")
    _watched(swap_server, "boss", "looper")
    limit, asks = RateLimit(), 16
    t0 = time.monotonic()
    for _ in range(asks):
        with pytest.raises(RuntimeError, match="CUDA error 2"):
            looper.ask(f"alloc {56 << 20}", timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed >= (asks - limit.burst) / limit.per_s * 0.9, f"{asks} room requests in {elapsed:.2f} s"
    log = swap_server.log.read_text()
    assert f"swap app looper (pid {looper.pid}) asks for room faster than {limit.per_s:g} a second" in log, log
    assert _state(swap_server, "boss") == "resident"


def test_the_rate_limit_lets_a_burst_through_then_spaces_requests_at_its_rate():
    limit = RateLimit(per_s=4.0, burst=3)
    assert [limit.delay(1, 10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.delay(1, 10.0) == pytest.approx(0.25) and limit.delay(1, 10.0) == pytest.approx(0.5)
    assert limit.delay(2, 10.0) == 0.0, "per app"
    assert limit.delay(1, 20.0) == 0.0, "refilled with time"
