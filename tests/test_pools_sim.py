"""Stream-ordered allocation (cuMemAllocAsync, explicit pools) on simcuda: served by gpucr's agent from
VMM it owns, so its data plane moves it and restores it at the same addresses, with CUDA's reuse
order, release threshold, TrimTo and attributes kept (checked against simcuda's own pools and its
stream-ordering model); pools shared for IPC refused before anything is touched; coverage reported."""
from __future__ import annotations

import json

import pytest

import gpucr
from gpucr.driver import ProcessState, gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20


@pytest.fixture
def pool_app(sim_workload):
    return lambda *args, agent=True: sim_workload("pool_app", *args, agent=agent)


def used() -> int:
    return gpu_memory(sim_driver()).used


def test_cycles_byte_exact_same_pointers_all_moved_by_gpucr(pool_app):
    idle = used()
    app = pool_app("--sizes", "8M,3M,64K,1000,40M", "--pool-sizes", "6M,100K", "--streams", "4")
    running = used()
    cov = gpucr.status(app.pid).coverage
    assert cov.bytes_left_to_driver == 0, cov
    assert cov.stream_ordered.pools_served == 2 and cov.stream_ordered.pools_left_to_driver == 0
    # 8M + 4M (3M rounded) + 40M + two 2 MiB slabs (64K, 1000, 100K) + 6M (explicit pool)
    assert cov.bytes_moved_by_gpucr >= (8 + 4 + 40 + 6) * MiB
    for i in range(4):
        app.ask(f"work {i + 1}")
        before = app.ask("digest")
        ck = gpucr.checkpoint(app.pid, level="full" if i % 2 == 0 else "data", timeout=20)
        assert ck.bytes_left_to_driver == 0 and ck.bytes_moved == cov.bytes_moved_by_gpucr
        if i % 2 == 0:
            assert used() == idle, "stream-ordered memory given back: the card at simcuda's floor"
        gpucr.restore(app.pid, timeout=20)
        assert app.ask("digest") == before, f"cycle {i}: same bytes at the same addresses"
        assert used() == running
    # the pools go on working on the restored memory
    app.ask("churn 20")
    app.ask("work 7")
    assert gpucr.status(app.pid).coverage.bytes_left_to_driver == 0


def test_free_blocks_are_trimmed_so_only_memory_in_use_moves(pool_app):
    app = pool_app("--sizes", "4M", "--pool-sizes", "", "--streams", "3")
    app.ask("churn 30")   # freed blocks stay reserved: the app set its release threshold to "keep all"
    so = gpucr.status(app.pid).coverage.stream_ordered
    assert so.reserved_bytes > so.used_bytes + 8 * MiB, so
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid, timeout=20)
    assert ck.bytes_moved == 4 * MiB, "only the block in use was moved"
    gpucr.restore(app.pid, timeout=20)
    assert app.ask("digest") == before
    attrs = app.ask("attrs")["default"]
    assert attrs["reserved"] == attrs["used"] == 4 * MiB, attrs
    assert gpucr.status(app.pid).coverage.stream_ordered.segments_released > 0


REUSE = ["reuse-same", "sync", "trim 0", "reuse-cross", "sync", "trim 0", "reuse-cross 0", "reuse-after-sync",
         "sync", "trim 0", "reuse-per-thread"]


def test_reuse_order_matches_the_drivers_pools(pool_app):
    """Same stream: reused at once. Another stream: only once the free is ordered before it (simcuda's
    stream-ordering model says whether it is): through an event the agent records and waits on, or
    because a synchronize saw the free complete; with internal dependencies off and the free not
    complete, a different block; the same between two threads' per-thread default streams. The
    driver's own pools (no agent) answer the same."""
    with_agent = pool_app("--streams", "2")
    answers = [with_agent.ask(c) for c in REUSE]
    plain = pool_app("--streams", "2", agent=False)
    assert [plain.ask(c) for c in REUSE] == answers
    same, cross, no_deps, after_sync, per_thread = answers[0], answers[3], answers[6], answers[7], answers[10]
    assert same["same"]
    assert cross == {"same": True, "ordered": True}, "handed over only after a wait on the free"
    assert no_deps == {"same": False, "ordered": False}, "no order, no internal dependencies: another block"
    assert after_sync == {"same": True, "ordered": True}
    assert per_thread == {"same": True, "ordered": True}, "another thread's per-thread stream: handed over after a wait"
    assert gpucr.status(with_agent.pid).coverage.stream_ordered.cross_stream_waits >= 1


def test_threads_churning_across_streams_through_checkpoints(pool_app):
    """Threads allocate, write, check and free blocks handed from stream to stream while checkpoints land
    mid-loop: every block holds what its owner wrote, before, across and after the cycles."""
    app = pool_app("--sizes", "8M,64K", "--pool-sizes", "2M")
    before = app.ask("digest")
    app.ask("loop start 4")
    rounds = []
    for i in range(3):
        ck = gpucr.checkpoint(app.pid, level="full" if i % 2 == 0 else "data", timeout=20)
        assert ck.bytes_left_to_driver == 0
        # the threads wait at the gate, holding nothing a status answer needs
        assert gpucr.status(app.pid).state == "checkpointed"
        gpucr.restore(app.pid, timeout=20)
        rounds.append(gpucr.status(app.pid).coverage.stream_ordered.allocations)
    stop = app.ask("loop stop")
    assert stop["error"] is None and stop["rounds"] > 0, stop
    assert rounds == sorted(rounds) and rounds[-1] > rounds[0], "the threads went on between the cycles"
    assert app.ask("digest") == before
    # (whether a block crosses streams before its free is known complete depends on the threads' timing, so
    # the wait that orders such a crossing is asserted where it is made to happen: test_reuse_order_matches_the_drivers_pools'
    # cross_stream_waits; asserting it here failed about 1 run in 7 under load)


def test_threshold_trim_and_attributes_are_truthful(pool_app):
    app = pool_app("--sizes", "8M", "--pool-sizes", "6M", "--streams", "3")

    def attrs_match_status() -> dict:
        a = app.ask("attrs")
        so = gpucr.status(app.pid).coverage.stream_ordered
        assert a["default"]["reserved"] + a["explicit"]["reserved"] == so.reserved_bytes
        assert a["default"]["used"] + a["explicit"]["used"] == so.used_bytes
        return a["default"]

    d = attrs_match_status()
    assert d["used"] == 8 * MiB and d["reserved"] == 8 * MiB
    app.ask("churn 10")
    app.ask("sync")
    d = attrs_match_status()
    assert d["reserved"] > d["used"] == 8 * MiB, "a threshold above what is free keeps it at a synchronize"
    assert d["reserved_high"] >= d["reserved"] and d["used_high"] > d["used"]
    app.ask("trim 10M")
    d = attrs_match_status()
    assert d["used"] <= d["reserved"] <= max(10 * MiB, d["used"]), "TrimTo keeps at most what it was asked to"
    app.ask("churn 10")
    app.ask("threshold 0")
    app.ask("sync")
    d = attrs_match_status()
    assert d["reserved"] == d["used"] == 8 * MiB, "threshold 0: everything free goes at the next synchronize"
    assert d["threshold"] == 0


def test_pool_access_for_a_peer_is_granted_and_kept_by_a_restore(pool_app, monkeypatch):
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")
    app = pool_app("--sizes", "4M", "--pool-sizes", "")
    assert app.ask("peer-write 1 5")["rc"] != 0, "device 1 may not touch device 0's pool memory by default"
    app.ask("peer-access 1 on")
    assert app.ask("peer-write 1 5") == {"rc": 0, "word": 5}
    for level in ("full", "data"):
        gpucr.checkpoint(app.pid, level=level, timeout=20)
        gpucr.restore(app.pid, timeout=20)
        assert app.ask("peer-write 1 6") == {"rc": 0, "word": 6}, f"access kept by a {level} restore"
    app.ask("peer-access 1 off")
    assert app.ask("peer-write 1 7")["rc"] != 0


def test_ipc_pool_is_refused_up_front_and_the_target_untouched(pool_app):
    app = pool_app("--sizes", "4M", "--pool-sizes", "")
    out = app.ask("ipc-pool 4")
    assert out["fd"] >= 0
    st = gpucr.status(app.pid)
    left = {e.kind: e for e in st.coverage.left_to_driver}
    assert left["IPC pool"].bytes == 4 * MiB and "handle types" in left["IPC pool"].reason
    assert st.coverage.stream_ordered.ipc_exports == 1
    before, mem = app.ask("digest"), used()
    r = gpucr_cli("checkpoint", str(app.pid))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cuMemPoolExportToShareableHandle" in lines[0] and "refused" in lines[0], r.stderr
    st = gpucr.status(app.pid)
    assert st.state == "running" and not st.gate_closed and st.generation == 0
    assert st.staging_bytes == 0, "nothing was prepared either"
    assert sim_driver().state(app.pid) == ProcessState.RUNNING
    assert app.ask("digest") == before and used() == mem
    app.ask("churn 3")   # and it runs on


def test_coverage_in_status_checkpoint_and_manifest(sim_app, tmp_path):
    app = sim_app("--sizes", "8M,100K")   # 100 KB stays a plain driver allocation (below a granule)
    r = gpucr_cli("status", str(app.pid))
    assert r.returncode == 0
    assert "coverage" in r.stdout and "small allocations: 0.1 MiB in 1" in r.stdout, r.stdout
    assert "not counted  module globals" in r.stdout
    img = tmp_path / "img"
    r = gpucr_cli("checkpoint", "--image", str(img), str(app.pid))
    assert r.returncode == 0 and "left to the driver (small allocations 0.1 MiB)" in r.stdout, r.stdout
    cov = json.loads((img / "manifest.json").read_text())["processes"][0]["coverage"]
    assert cov["reported"] and cov["bytes_moved_by_gpucr"] == 8 * MiB and cov["bytes_left_to_driver"] == 100 << 10
    assert [e["kind"] for e in cov["left_to_driver"]] == ["small allocations"]
    r = gpucr_cli("inspect", str(img))
    assert "(small allocations 0.1 MiB)" in r.stdout, r.stdout
    gpucr.restore(app.pid, image=str(img))


def test_free_during_capture_is_answered_as_by_the_driver(pool_app):
    """CUDA turns a free during stream capture into a free node, which takes only a graph allocation:
    freeing a block the agent served (allocated outside any capture) is the driver's error (the H200
    says INVALID_VALUE, the capture going on), with gpucr as without it; the block stays the
    application's, holds its bytes and is moved by gpucr."""
    app = pool_app("--sizes", "4M,64K", "--pool-sizes", "")
    plain = pool_app("--sizes", "4M,64K", "--pool-sizes", "", agent=False)
    answer = app.ask("capture-free")
    assert answer == plain.ask("capture-free")
    assert answer == {"free_rc": 1, "status": 1, "end_rc": 0}, "INVALID_VALUE, the capture goes on"
    cov = gpucr.status(app.pid).coverage
    assert cov.stream_ordered.used_bytes == 4 * MiB + (64 << 10), "the block is still in use"
    app.ask("work 3")
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid, timeout=20)
    assert ck.bytes_left_to_driver == 0
    gpucr.restore(app.pid, timeout=20)
    assert app.ask("digest") == before
    app.ask("churn 5")   # the pools go on, the block among the live ones


def test_destroyed_pool_leaves_status_and_its_blocks_go_back_once_freed(pool_app):
    app = pool_app("--sizes", "4M", "--pool-sizes", "6M,100K")
    so = gpucr.status(app.pid).coverage.stream_ordered
    assert so.pools_served == 2 and so.reserved_bytes == (4 + 6 + 2) * MiB, so
    app.ask("pool-destroy")
    so = gpucr.status(app.pid).coverage.stream_ordered
    assert so.pools_served == 1, "a destroyed pool is no longer listed"
    assert so.used_bytes == 4 * MiB + 6 * MiB + 128 * 1024, "its blocks in use stay the application's"
    before = app.ask("digest")
    gpucr.checkpoint(app.pid, timeout=20)   # they are still moved by gpucr
    gpucr.restore(app.pid, timeout=20)
    assert app.ask("digest") == before
    app.ask("pool-free")
    app.ask("sync")
    so = gpucr.status(app.pid).coverage.stream_ordered
    assert so.used_bytes == so.reserved_bytes == 4 * MiB, "freed: the destroyed pool's memory went back"
    assert gpucr.checkpoint(app.pid, timeout=20).bytes_moved == 4 * MiB
    gpucr.restore(app.pid, timeout=20)


def test_opportunistic_reuse_follows_the_pool_attribute(pool_app):
    """With REUSE_ALLOW_OPPORTUNISTIC and internal dependencies off, a block freed on another stream is
    not reused even once its free completed (CUDA, and simcuda's pools); with it on, it is."""
    with_agent = pool_app("--streams", "2")
    plain = pool_app("--streams", "2", agent=False)
    for opp, same in (("0", False), ("1", True)):
        answer = with_agent.ask(f"reuse-after-sync {opp}")
        assert answer == plain.ask(f"reuse-after-sync {opp}")
        assert answer["same"] is same, (opp, answer)


def test_graph_memory_and_driver_pools_are_reported_and_trimmed_before_a_checkpoint(pool_app):
    """Graph memory nodes (allocations during stream capture) stay the driver's: status reports what
    graphs hold (USED_MEM_CURRENT), and before a checkpoint the gate-closed quiesce trims the rest
    (cuDeviceGraphMemTrim) and the driver's own pools (cuMemPoolTrimTo(pool, 0))."""
    app = pool_app("--sizes", "4M", "--pool-sizes", "")
    app.ask("graph 6M 8M")   # 6 MiB the graph left allocated, 8 MiB it freed: cached
    assert app.ask("graph-mem") == {"used": 6 * MiB, "used_high": 14 * MiB, "reserved": 14 * MiB,
                                    "reserved_high": 14 * MiB}
    app.ask("usage-pool 2")   # a pool with usage flags: the driver's, 2 MiB kept reserved
    assert app.ask("usage-attrs") == {"used": 0, "reserved": 2 * MiB}
    cov = gpucr.status(app.pid).coverage
    left = {e.kind: e.bytes for e in cov.left_to_driver}
    assert left == {"graph memory nodes": 6 * MiB}, left
    assert cov.stream_ordered.captured_allocations == 2 and cov.stream_ordered.pools_left_to_driver == 1
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid, timeout=20)
    assert ck.bytes_left_to_driver == 6 * MiB and ck.bytes_moved == 4 * MiB
    gpucr.restore(app.pid, timeout=20)
    assert app.ask("digest") == before
    assert app.ask("graph-mem")["reserved"] == 6 * MiB, "what no graph held was trimmed"
    assert app.ask("usage-attrs") == {"used": 0, "reserved": 0}, "the driver's pool was trimmed to 0"
