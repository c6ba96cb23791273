"""A host-memory budget as gpucr takes it everywhere (GPUCR_HOST_BUDGET, `gpucr run --host-budget`, `gpucr serve
--host-budget`): bytes, a size with K, M, G or T (binary), or 1% to 100% of MemTotal. The agent reads the same forms
(native/agent/util.c gpucr_parse_budget; tests/test_settings.py holds the two alike)."""
from __future__ import annotations

import re
from pathlib import Path

_BUDGET = re.compile(r"(?:([1-9][0-9]*)%|([1-9][0-9]*)([KMGT]?))")
BUDGET_FORMS = "bytes, a size with K, M, G or T (e.g. 64G), or 1% to 100% of MemTotal (e.g. 50%)"


def budget_problem(v: str) -> str | None:
    """Why `v` is not a host-memory budget, or None."""
    m = _BUDGET.fullmatch(v)
    if m and (int(m[2]) << 10 * "_KMGT".index(m[3] or "_") < 1 << 64 if m[2] else 1 <= int(m[1]) <= 100):
        return None
    return f"'{v}' is not a host-memory budget: give {BUDGET_FORMS}"


def budget_bytes(v: str, mem_total: int | None = None) -> int:
    """The budget in bytes (a share of MemTotal, read from /proc/meminfo unless given); ValueError when malformed."""
    why = budget_problem(v)
    if why:
        raise ValueError(why)
    m = _BUDGET.fullmatch(v)
    assert m is not None
    if m[1]:
        return (mem_total if mem_total is not None else _mem_total()) // 100 * int(m[1])   # as the agent reckoned it
    return int(m[2]) << 10 * "_KMGT".index(m[3] or "_")


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) << 10
    raise ValueError("/proc/meminfo names no MemTotal: give the budget in bytes, not as a share")


PREPARE_AUTO, PREPARE_NONE = "auto", ("0", "off")   # `gpucr serve --prepare-staging`'s words besides a size


def pool_target(setting: str) -> tuple[bool, int | None]:
    """`gpucr serve --prepare-staging` as the pool takes it: whether to prepare, and how much (None: auto, what
    the server's --host-budget and the memory available allow, less the margin). None by default: a server runs
    for every user who runs `gpucr run` (it starts one unasked), and one with a --host-budget (the swap service's,
    80% in its benchmark) would otherwise pin most of the host ahead of apps that may never come; whoever wants
    the first park as fast as the others says how much."""
    if setting in ("", *PREPARE_NONE):
        return False, None
    return True, None if setting == PREPARE_AUTO else budget_bytes(setting)


def prepare_problem(setting: str) -> str | None:
    """What is wrong with a --prepare-staging value (None: nothing)."""
    if setting in (PREPARE_AUTO, *PREPARE_NONE) or not budget_problem(setting):
        return None
    return f"'{setting}' is not what to prepare: give {PREPARE_AUTO}, 0, or {BUDGET_FORMS}"
