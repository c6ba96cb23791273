"""The swap policy's rules (issue 27, "Room on demand"), as properties over any set of apps."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gpucr.swap.policy import Candidate, choose, ready_at

NOW = 1000.0
STATES = ("resident", "parking", "parked", "resuming", "on disk")


@st.composite
def apps(draw):
    n = draw(st.integers(1, 7))
    names = [f"app{i}" for i in range(n)]
    out = []
    for name in names:
        out.append(Candidate(
            name=name, priority=draw(st.integers(0, 3)), state=draw(st.sampled_from(STATES + ("resident",) * 3)),
            held_bytes=draw(st.integers(0, 10)) << 20, last_active=draw(st.floats(0, NOW)),
            resident_since=draw(st.floats(0, NOW)), min_resident_s=draw(st.sampled_from([0.0, 5.0, 500.0])),
            waits_on=frozenset(draw(st.lists(st.sampled_from(names), max_size=2)))))
    asker = draw(st.sampled_from(out))
    need = draw(st.integers(0, 40)) << 20
    return out, asker, need


def _may_park(c: Candidate, asker: Candidate) -> bool:
    return (c.name != asker.name and c.state == "resident" and c.held_bytes > 0 and c.priority <= asker.priority
            and NOW - c.resident_since >= c.min_resident_s and asker.name not in c.waits_on)


@settings(max_examples=400, deadline=None)
@given(apps())
def test_only_apps_the_rules_allow_are_parked(case):
    all_apps, asker, need = case
    choice = choose(all_apps, asker, need, NOW)
    by_name = {c.name: c for c in all_apps}
    for name in choice.park:
        c = by_name[name]
        assert c.name != asker.name, "the asker is never parked"
        assert c.priority <= asker.priority, "never one of higher priority than the asker"
        assert NOW - c.resident_since >= c.min_resident_s, "never one inside its --min-resident"
        assert asker.name not in c.waits_on, "never one waiting on the asker"
        assert c.state == "resident"


@settings(max_examples=400, deadline=None)
@given(apps())
def test_enough_is_freed_or_nobody_is_parked_with_why(case):
    all_apps, asker, need = case
    choice = choose(all_apps, asker, need, NOW)
    parkable = sum(c.held_bytes for c in all_apps if _may_park(c, asker))
    if need <= 0:
        assert choice.park == () and choice.suffices
    elif parkable >= need:
        assert choice.suffices and choice.freed_bytes >= need
        assert choice.freed_bytes == sum(c.held_bytes for c in all_apps if c.name in choice.park)
    else:
        assert not choice.suffices and choice.park == () and str(need) in choice.why_not


@settings(max_examples=400, deadline=None)
@given(apps())
def test_lower_priority_first_then_the_fewest_and_none_parked_that_is_not_needed(case):
    all_apps, asker, need = case
    choice = choose(all_apps, asker, need, NOW)
    if not choice.park:
        return
    allowed = sorted((c for c in all_apps if _may_park(c, asker)), key=lambda c: (c.priority, c.last_active, c.name))
    by = {c.name: c for c in allowed}
    parked = [by[n] for n in choice.park]
    assert choice.freed_bytes == sum(c.held_bytes for c in parked) >= need
    # none parked that is not needed: keeping any one of them would still leave enough
    assert all(choice.freed_bytes - c.held_bytes < need for c in parked)
    # a priority is touched only when every app below it together would not free enough
    top = max(c.priority for c in parked)
    assert sum(c.held_bytes for c in allowed if c.priority < top) < need
    # no more apps than the old rule (the first of that order until enough): the fewest, not the oldest, decide
    prefix, freed = 0, 0
    while freed < need:
        freed += allowed[prefix].held_bytes
        prefix += 1
    assert len(parked) <= prefix
    # of one priority, no fewer apps of it would have done beside the others parked
    mine = sorted((c.held_bytes for c in allowed if c.priority == top), reverse=True)
    others = choice.freed_bytes - sum(c.held_bytes for c in parked if c.priority == top)
    fewer = len([c for c in parked if c.priority == top]) - 1
    assert others + sum(mine[:fewer]) < need


def test_one_app_that_makes_room_is_parked_rather_than_two_older_ones():
    old, older, big = (Candidate(n, 0, "resident", b << 20, t, 0.0) for n, b, t in
                       (("old", 3, 2.0), ("older", 3, 1.0), ("big", 8, 5.0)))
    asker = Candidate("asker", 0, "resident", 1 << 20, 9.0, 0.0)
    assert choose([old, older, big, asker], asker, 5 << 20, NOW).park == ("big",)
    assert choose([old, older, big, asker], asker, 3 << 20, NOW).park == ("older",)   # a tie: the oldest


def test_a_refusal_names_each_app_kept_and_why():
    asker = Candidate("web", 1, "resident", 1 << 20, NOW, 0.0)
    boss = Candidate("boss", 5, "resident", 8 << 20, 0.0, 0.0)
    fresh = Candidate("fresh", 0, "resident", 8 << 20, 0.0, NOW - 1, min_resident_s=60)
    waiter = Candidate("waiter", 0, "resident", 8 << 20, 0.0, 0.0, waits_on=frozenset({"web"}))
    choice = choose([asker, boss, fresh, waiter], asker, 4 << 20, NOW)
    assert choice.park == () and not choice.suffices
    assert "boss (its priority 5 is above the asker's 1)" in choice.why_not
    assert "fresh (it is inside its --min-resident of 60 s)" in choice.why_not
    assert "waiter (it waits on the asker)" in choice.why_not


@settings(max_examples=300, deadline=None)
@given(apps())
def test_ready_at_is_the_first_moment_the_min_resident_rule_lets_enough_go(case):
    """Waiting helps only where --min-resident is all that keeps enough: the answer is the first end of one at which
    the policy finds enough, and no earlier moment does."""
    all_apps, asker, need = case
    at = ready_at(all_apps, asker, need, NOW)
    ends = sorted({NOW} | {c.resident_since + c.min_resident_s for c in all_apps})
    later = [t for t in ends if t >= NOW]
    if at is None:
        assert not any(choose(all_apps, asker, need, t).suffices for t in later + [NOW + 1e9])
        return
    assert at >= NOW and choose(all_apps, asker, need, at).suffices
    assert not any(choose(all_apps, asker, need, t).suffices for t in later if t < at)
    if choose(all_apps, asker, need, NOW).suffices:
        assert at == NOW


def test_ready_at_waits_for_a_min_resident_and_not_for_a_higher_priority():
    asker = Candidate("web", 1, "resident", 1 << 20, NOW, 0.0)
    fresh = Candidate("fresh", 0, "resident", 8 << 20, 0.0, NOW - 1, min_resident_s=60)
    boss = Candidate("boss", 5, "resident", 8 << 20, 0.0, 0.0)
    assert ready_at([asker, fresh], asker, 4 << 20, NOW) == NOW + 59
    assert ready_at([asker, boss], asker, 4 << 20, NOW) is None
