"""On the H200: the two-way switch (issue 28 item 1, docs/swap.md) through a real `gpucr serve` on the real driver,
with torch apps under `gpucr run --swap` as users start them. A higher-priority app (never parked for the others)
holds most of the card, so two apps of the same size take turns: each resume needs the room the other's park gives,
and the service switches both at once. Each app's tensors are one allocation of tens of GiB, made in pieces
(GPUCR_PIECE_BYTES, 256 MiB by default): the one coming in is made while the other's pieces are still going out.

1. rounds of demands, each a two-way switch, data intact, with each switch's seconds, bytes each way and overlap;
2. the server SIGKILLed in a two-way switch after the first give-back: each app resident, or parked and restored
   by hand with its data.

Written in a session without a GPU: the CPU suite covers the same on simcuda (tests/test_swap_two_way.py)."""
from __future__ import annotations

import re
import time

import pytest

import gpucr
from gpucr.agent_tables import SETTINGS
from conftest import gpu
from test_gpu_cycles import record
import test_gpu_swap
from test_gpu_swap import HOST_SPARE, _mib, _watched, card, mem_available, within
from test_swap import _apps, _state, _until
from test_swap_two_way import _killed_in_a_switch

pytestmark = [gpu, pytest.mark.gpu]
serve, swap_apps = test_gpu_swap.serve, test_gpu_swap.swap_apps   # its fixtures: the server, apps under --swap
GiB = 1 << 30
ROUNDS = 4
SWITCH = re.compile(r"two-way switch: parked swap app (\S+) \(pid \d+\) while (\S+) \(pid \d+\) came in: (\d+) MiB out, "
                    r"(\d+) MiB in, ([\d.]+) s \(([\d.]+) s of it waiting for room, (\d+) pieces made while")


def _pair(serve, swap_apps, share: float):
    """The server, a ballast of higher priority holding the card but for 1.5 apps, and apps a (resident) and b
    (parked for a's room), each of `share` of the card's free memory (bounded by the host: two stagings at once);
    their digests."""
    free, _total = card()
    each = _mib(min(int(share * free), (mem_available() - HOST_SPARE) // 2))
    srv = serve()
    ballast = swap_apps("torch_app", "ballast", "--priority", "5")
    a = swap_apps("torch_app", "a", args=("--gib", "0", "--seed", "1"))
    b = swap_apps("torch_app", "b", args=("--gib", "0", "--seed", "2"))
    _watched(srv, "ballast", "a", "b")
    ballast.ask(f"grow {_mib(free - int(1.5 * each) - 4 * GiB)}", timeout=240)
    digests = {}
    for name, w in (("a", a), ("b", b)):   # b's allocation past free memory: a is parked for it (one way)
        w.ask(f"grow {each}", timeout=300)
        digests[w.pid] = w.ask("digest", timeout=120)["digest"]
        w.ask("release")
        time.sleep(1.2)
    _until("a parked for b", lambda: _state(srv, "a") == "parked", timeout=120)
    return srv, a, b, each, digests


@within(140)
def test_torch_apps_taking_turns_switch_both_ways_at_once_with_their_data_intact(serve, swap_apps):
    srv, a, b, each, digests = _pair(serve, swap_apps, 0.2)
    st = gpucr.status(b.pid)   # resident: its pieces and their fds
    row = {"test": "two_way_switch", "app_bytes": each, "pieces": st.allocations.pieces,
           "own_fds": st.allocations.own_fds, "fd_limit": st.allocations.fd_limit, "rounds": []}
    for i in range(ROUNDS):
        w, name = (a, "a") if i % 2 == 0 else (b, "b")
        t0 = time.perf_counter()
        assert w.ask("digest", timeout=240)["digest"] == digests[w.pid], f"round {i}: {name}'s bytes differ"
        took = time.perf_counter() - t0
        w.ask("release")
        _until(f"round {i}: {name} resident", lambda: _state(srv, name) == "resident", timeout=60)
        row["rounds"].append({"app": name, "request_s": round(took, 3)})
        time.sleep(1.2)
    found = SWITCH.findall(srv.log.read_text())
    row["switches"] = [{"out": o, "in": n, "mib_out": int(mo), "mib_in": int(mi), "seconds": float(s),
                        "waited_s": float(w), "made_while_out": int(k)} for o, n, mo, mi, s, w, k in found]
    row["apps"] = {n: {k: r[k] for k in ("parks", "resumes")} for n, r in _apps(srv).items()}
    record(**row)
    assert st.allocations.pieces >= each // int(SETTINGS["GPUCR_PIECE_BYTES"].default), st.allocations
    assert len(found) >= ROUNDS - 1, srv.log.read_text()[-4000:]
    assert all(int(k) > 0 for *_r, k in found), row["switches"]   # each overlapped: pieces made while others went out


@within(100)
def test_a_server_killed_in_a_two_way_switch_on_the_gpu_loses_no_app(serve, swap_apps, monkeypatch):
    monkeypatch.setenv("GPUCR_TEST_KILL_AT", "switch-after-give-back")   # read by the server at its start only
    srv, a, b, each, digests = _pair(serve, swap_apps, 0.1)
    monkeypatch.delenv("GPUCR_TEST_KILL_AT")
    # a's demand: a two-way switch (b out), and the server dies after b's first allocation was given back
    _killed_in_a_switch(srv, "switch-after-give-back", b, a, digests)
    record(test="two_way_switch_killed", app_bytes=each, survived=True)
