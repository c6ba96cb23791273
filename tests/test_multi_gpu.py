"""A process on two GPUs, on simcuda (the simulated driver, a test double) with SIMCUDA_DEVICES=2:
every GPU given back and restored, peer access kept across a restore (the agent grants it to the
VMM memory that stands in for plain allocations), and a restore onto the swapped GPUs (--map)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

import gpucr
from gpucr.driver import gpu_memory, process_gpu_memory

from conftest import gpucr_cli, sim_driver

MiB = 1 << 20
ILLEGAL_ADDRESS = 700


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch):
    monkeypatch.setenv("SIMCUDA_DEVICES", "2")


@pytest.fixture(params=["server", "cli"])
def plane(request, two_gpus):
    """The data plane a test's requests go through: the module's reused gpucr server's (on the same two GPUs), or,
    with no server, the same mover in the requesting process."""
    if request.param == "server":
        request.getfixturevalue("reused_server")
    return request.param


def cli(verb: str, pid: int, *args: str) -> dict:
    """A checkpoint or restore by a gpucr command of its own, its result: with no server, the command's own mover
    sees the GPUs as a fresh process does (this test process's simulated driver may have started with one, earlier)."""
    r = gpucr_cli(verb, "--json", *args, str(pid))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["processes"][0]


def dev_used(d: int) -> int:
    return gpu_memory(sim_driver(), d).used


def used_but_server(d: int) -> int:
    """Device d's memory in use, less what the gpucr server holds there itself (its context, once it copied on d)."""
    from gpucr.server import client
    info = client.info(True)
    server = process_gpu_memory(sim_driver(), info["pid"], d) or 0 if info is not None else 0
    return dev_used(d) - server


def test_process_on_two_gpus_keeps_peer_access(sim_app):
    idle = [dev_used(0), dev_used(1)]
    app = sim_app("--sizes", "16M,3M")
    app.ask("device 1 24M")
    app.ask("device 1 8M vmm")
    assert app.ask("peer-add 0")["rc"] == ILLEGAL_ADDRESS, "device 1 has no access to device 0's memory yet"
    assert app.ask("peer on")["rc"] == 0
    assert app.ask("peer-add 0")["rc"] == 0
    app.ask(f"alloc {4 * MiB}")   # buffer 4: made after peer access was enabled, so open to device 1 too
    assert app.ask("peer-add 4")["rc"] == 0
    app.ask("device 1 64K")   # small: left native, to the driver's checkpoint, and counted on its own GPU
    st = gpucr.status(app.pid)
    assert {d.ordinal: d.driver_bytes for d in st.gpus} == {0: 0, 1: 64 << 10}
    before = app.ask("digest")
    for cycle in range(2):
        cli("checkpoint", app.pid)
        st = gpucr.status(app.pid)
        assert sorted(d.ordinal for d in st.gpus) == [0, 1]
        assert {d.ordinal: d.vmm_bytes for d in st.gpus}[1] == 32 * MiB
        for d in (0, 1):
            assert dev_used(d) - idle[d] <= 16 * MiB, f"cycle {cycle}: device {d} not given back"
        cli("restore", app.pid)
        assert app.ask("digest") == before
        assert app.ask("peer-add 0")["rc"] == 0 and app.ask("peer-add 4")["rc"] == 0, "peer access lost by the restore"
    assert app.ask("peer off")["rc"] == 0
    assert app.ask("peer-add 0")["rc"] == ILLEGAL_ADDRESS
    cli("checkpoint", app.pid)
    cli("restore", app.pid)
    assert app.ask("peer-add 0")["rc"] == ILLEGAL_ADDRESS, "a restore must not give back access the application took away"
    assert app.ask("digest") == before


def on_two_gpus(sim_app):
    """A process with memory on both GPUs: it, each GPU's idle use, what it holds on each, their UUIDs, its digest."""
    idle = [used_but_server(0), used_but_server(1)]
    app = sim_app("--sizes", "16M,3M")
    app.ask("device 1 40M")
    held = [used_but_server(0) - idle[0], used_but_server(1) - idle[1]]
    return app, idle, held, app.ask("uuids")["uuids"], app.ask("digest")


def test_restore_onto_the_swapped_gpus(plane, sim_app, tmp_path):
    app, idle, held, (u0, u1), before = on_two_gpus(sim_app)
    assert gpucr_cli("checkpoint", "--image", str(tmp_path / "img"), str(app.pid)).returncode == 0
    taken = json.loads(gpucr_cli("inspect", "--json", str(tmp_path / "img")).stdout)
    assert [g["uuid"] for g in sorted(taken["gpus"], key=lambda g: g["ordinal"])] == [u0, u1]
    for bad, why in ((["--map", f"{u0}={u1}"], f"was checkpointed on {u1}"),
                     (["--map", f"{u0}={u1}", "--map", f"{u1}={u1}"], f"onto {u1}")):
        r = gpucr_cli("restore", "--image", str(tmp_path / "img"), *bad, str(app.pid))
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert gpucr.status(app.pid).state == "checkpointed"
    r = gpucr_cli("restore", "--json", "--image", str(tmp_path / "img"), "--map", f"{u0}={u1}", "--map", f"{u1}={u0}",
                  str(app.pid))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["processes"][0]["data_plane"] == plane
    assert app.ask("uuids")["uuids"] == [u1, u0], "the process's device 0 is now the other card"
    assert app.ask("digest") == before
    assert [used_but_server(0) - idle[0], used_but_server(1) - idle[1]] == held[::-1], "each card holds what the other held"
    assert {d.ordinal: d.uuid for d in gpucr.status(app.pid).gpus} == {0: u1, 1: u0}
    out = gpucr_cli("status", str(app.pid)).stdout
    assert f"gpu          device 0 {u1}: this process" in out and f"gpu          device 1 {u0}: this process" in out, out
    # and a plain cycle afterwards keeps it where it now is
    assert gpucr_cli("checkpoint", str(app.pid)).returncode == 0
    assert gpucr_cli("restore", str(app.pid)).returncode == 0
    assert app.ask("uuids")["uuids"] == [u1, u0] and app.ask("digest") == before


def test_restore_from_host_memory_onto_the_swapped_gpus(plane, sim_app):
    """--map of a checkpoint held in host memory: the new memory is made (by the server, when it runs) on the
    GPU each card moves to, every byte back at its address, and each card holds what the other held."""
    app, idle, held, (u0, u1), before = on_two_gpus(sim_app)
    ck = cli("checkpoint", app.pid)
    assert ck["data_plane"] == plane
    rs = cli("restore", app.pid, "--map", f"{u0}={u1}", "--map", f"{u1}={u0}")
    assert rs["data_plane"] == plane and rs["moved"] == {u0: u1, u1: u0} and rs["bytes_moved"] == ck["bytes_moved"], rs
    assert app.ask("uuids")["uuids"] == [u1, u0] and app.ask("digest") == before
    assert [used_but_server(0) - idle[0], used_but_server(1) - idle[1]] == held[::-1], "each card holds what the other held"
    assert {d.ordinal: d.uuid for d in gpucr.status(app.pid).gpus} == {0: u1, 1: u0}
    assert cli("checkpoint", app.pid)["data_plane"] == plane   # and the next cycle keeps it where it now is
    assert cli("restore", app.pid)["data_plane"] == plane
    assert app.ask("uuids")["uuids"] == [u1, u0] and app.ask("digest") == before


@given(raw=st.binary(min_size=16, max_size=16), upper=st.booleans(), prefix=st.booleans(), dashes=st.booleans())
def test_any_spelling_of_a_uuid_names_the_same_gpu(raw, upper, prefix, dashes):
    from gpucr.gpus import normalise, parse_map, to_bytes
    h = raw.hex()
    text = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if dashes else h
    text = ("GPU-" if prefix else "") + (text.upper() if upper else text)
    assert to_bytes(text) == raw
    assert parse_map([f"{text}={text}"]) == {normalise(text): normalise(text)}


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-0000-0000-000000000000"


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.permutations(range(n)), st.integers(1, n))))
def test_restore_pairs_are_a_permutation_of_every_gpu(case):
    """The driver wants a pair for every GPU of the machine (driver 580 on a two-GPU H200 host refused
    a pair for the used GPU alone): whatever a process's moves, the pairs name each GPU once on each
    side, the moves are kept, and GPUs nobody moves stay where they are when their place is free."""
    from gpucr.gpus import Gpu, restore_pairs
    n, perm, used = case
    machine = [Gpu(i, _uuid(i), "sim") for i in range(n)]
    moves = {_uuid(i): _uuid(perm[i]) for i in range(used)}
    pairs = restore_pairs(moves, machine)
    assert sorted(o for o, _ in pairs) == sorted(g.uuid for g in machine)
    assert sorted(t for _, t in pairs) == sorted(g.uuid for g in machine)
    assert all(dict(pairs)[o] == t for o, t in moves.items())
    for o, t in pairs:
        if o not in moves and o not in moves.values():
            assert t == o, "a GPU the process does not touch keeps its place"


def test_restore_pairs_refuse_a_gpu_not_on_the_machine():
    from gpucr.gpus import Gpu, restore_pairs
    with pytest.raises(gpucr.GpucrError, match="not a GPU of this machine"):
        restore_pairs({_uuid(0): _uuid(5)}, [Gpu(0, _uuid(0), "sim"), Gpu(1, _uuid(1), "sim")])
