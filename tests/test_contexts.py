"""Contexts that end while the process lives (cuCtxDestroy; cuDevicePrimaryCtxReset, which is
cudaDeviceReset): what they held is given back and forgotten, and checkpoints go on working. On
simcuda (the simulated driver, a test double)."""
from __future__ import annotations



import gpucr
from gpucr.driver import gpu_memory

from conftest import sim_driver

MiB = 1 << 20


def used() -> int:
    return gpu_memory(sim_driver()).used


def test_destroyed_context_leaves_nothing_behind(sim_app):
    app = sim_app("--sizes", "16M,3M")
    held = used()
    tracked = gpucr.status(app.pid).allocations
    app.ask("ctx-temp 40M")   # 40 MiB made VMM by the agent, and a small native one, in a context then destroyed
    assert used() == held, "the converted allocation died with its context"
    assert gpucr.status(app.pid).allocations == tracked
    before = app.ask("digest")
    for _ in range(2):
        gpucr.checkpoint(app.pid)
        gpucr.restore(app.pid)
        assert app.ask("digest") == before


def test_device_reset_then_checkpoints_go_on(sim_app):
    # every allocation and the context the reset ends: the next checkpoints move what is made again
    idle = used()
    app = sim_app("--sizes", "16M,3M,64K")
    held = used() - idle
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    app.ask("reset")   # as cudaDeviceReset: every allocation gone, the context made again, buffers made again
    assert used() - idle == held
    assert app.ask("digest") == before, "same sizes and contents, made again"
    st = gpucr.status(app.pid)
    assert [d.ordinal for d in st.gpus] == [0]
    assert st.allocations.native == 1 and st.allocations.converted == 2
    for _ in range(2):
        gpucr.checkpoint(app.pid)
        assert used() - idle <= 16 * MiB
        gpucr.restore(app.pid)
        assert app.ask("digest") == before


def test_seventeen_contexts_each_with_memory_are_checkpointed(sim_app):
    """No fixed limit on contexts: each of 18 (the primary and 17 more) keeps its memory through a cycle
    (before: the agent recorded 16 and made copy streams for 16)."""
    app = sim_app("--sizes", "4M")
    assert app.ask("ctx-keep 17 4M")["buffers"] == 18
    before = app.ask("digest")
    st = gpucr.status(app.pid)
    assert st.allocations.converted == 18 and not st.refusal
    for _ in range(2):
        ck = gpucr.checkpoint(app.pid)
        assert ck.bytes_moved == 18 * 4 * MiB
        gpucr.restore(app.pid)
        assert app.ask("digest") == before
