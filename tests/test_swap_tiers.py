"""The swap service's two pure choices beside the room policy (issue 27 items 5 and 6), as properties over any apps
and GPUs: which parked apps go to disk for one more park (gpucr.swap.budget), and where an app of --any-gpu comes
back (gpucr.swap.placement)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gpucr.swap.budget import InHost, to_disk
from gpucr.swap.placement import GpuRoom, place

MiB = 1 << 20


@st.composite
def in_host(draw):
    n = draw(st.integers(0, 6))
    apps = [InHost(f"app{i}", draw(st.integers(0, 8)) * MiB, draw(st.floats(0, 1000)), draw(st.booleans()))
            for i in range(n)]
    return apps, draw(st.integers(0, 16)) * MiB, draw(st.integers(1, 32)) * MiB


@settings(max_examples=400, deadline=None)
@given(in_host())
def test_to_disk_moves_only_movable_apps_least_recently_used_first_and_just_enough(case):
    apps, need, budget = case
    spills = to_disk(apps, need, budget)
    by_name = {a.name: a for a in apps}
    held = sum(a.host_bytes for a in apps)
    if not spills.suffices:
        assert spills.order == () and held + need > budget
        movable = sum(a.host_bytes for a in apps if a.movable)
        assert need > budget or movable < held + need - budget, spills.why_not
        return
    chosen = [by_name[n] for n in spills.order]
    freed = sum(a.host_bytes for a in chosen)
    assert held - freed + need <= budget, "after the moves the park fits"
    assert all(a.movable and a.host_bytes > 0 for a in chosen)
    if chosen:
        assert held - freed + chosen[-1].host_bytes + need > budget, "one fewer would not have done"
        left = [a for a in apps if a.movable and a.host_bytes > 0 and a.name not in spills.order]
        assert all(a.last_active >= max(c.last_active for c in chosen) for a in left), "least recently used first"
    else:
        assert held + need <= budget


def test_to_disk_says_when_one_app_alone_passes_the_budget():
    spills = to_disk([InHost("old", 4 * MiB, 1.0)], 40 * MiB, 32 * MiB)
    assert not spills.suffices and "it alone needs 41943040 bytes of host memory, more than --host-budget" in spills.why_not


@st.composite
def machines(draw):
    n = draw(st.integers(1, 4))
    chips = ["h200", "a100"]
    gpus = [GpuRoom(f"GPU-{i}", draw(st.sampled_from(chips)), draw(st.one_of(st.none(), st.integers(0, 8).map(
        lambda k: k * 64 * MiB)))) for i in range(n)]
    own = draw(st.lists(st.sampled_from([g.uuid for g in gpus]), min_size=1, max_size=n, unique=True))
    needs = {u: draw(st.integers(1, 6)) * 64 * MiB for u in own}
    return needs, gpus


@settings(max_examples=400, deadline=None)
@given(machines())
def test_place_moves_only_short_gpus_onto_free_ones_of_the_same_chip(case):
    needs, gpus = case
    moves = place(needs, gpus)
    by_uuid = {g.uuid: g for g in gpus}
    short = {u for u, n in needs.items() if by_uuid[u].free is not None and by_uuid[u].free < n}
    if not moves:
        return
    assert short, "an app with room on its own GPUs stays there"
    assert set(moves) == set(needs), "every GPU of the app is named, as the driver's restore wants"
    assert len(set(moves.values())) == len(moves), "two of its GPUs never land on one"
    for old, new in moves.items():
        if old not in short:
            assert new == old
            continue
        target = by_uuid[new]
        assert new not in needs and target.name == by_uuid[old].name
        assert target.free is not None and target.free >= needs[old]


def test_place_picks_the_gpu_with_the_most_room_and_stays_when_none_has_it():
    gpus = [GpuRoom("GPU-0", "h200", 10 * MiB), GpuRoom("GPU-1", "h200", 200 * MiB), GpuRoom("GPU-2", "h200", 900 * MiB),
            GpuRoom("GPU-3", "a100", 2000 * MiB)]
    assert place({"GPU-0": 100 * MiB}, gpus) == {"GPU-0": "GPU-2"}
    assert place({"GPU-0": 1000 * MiB}, gpus) == {}, "the a100 is another chip"
    assert place({"GPU-1": 100 * MiB}, gpus) == {}, "room where it was"
