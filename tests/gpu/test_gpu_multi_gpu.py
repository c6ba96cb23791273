"""A restore's --map on the real driver, and processes that use several GPUs (issue 5).

One GPU allows the identity map (the driver gets a pair for the process's GPU, old = new); the
rest needs two GPUs and skips below that: a process on two GPUs with peer access checkpointed and
restored (each card back to idle, the peer reads still working), and one restored onto the swapped
GPUs (`--map A=B --map B=A`)."""
from __future__ import annotations

import pytest

import gpucr
from gpucr import restore_many
from gpucr.driver import driver_for, gpu_memory
from gpucr.gpus import machine_gpus
from gpucr.workloads.runner import Workload

from conftest import gpu, two_gpus

pytestmark = [gpu, pytest.mark.gpu]
MiB = 1 << 20
SLACK = 16 * MiB


def used(uuid: str) -> int:
    drv = driver_for("libcuda.so.1")
    g = next(g for g in machine_gpus(drv) if g.uuid == uuid)
    return gpu_memory(drv, g.ordinal, uuid).used


def test_identity_map_restores_in_place(tmp_path):
    with Workload("torch_app", "--gib", "4") as app:
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=60)
        devices = gpucr.status(app.pid).gpus
        assert len(devices) == 1 and devices[0].vmm_bytes >= 4 << 30
        here = devices[0].uuid
        assert here in {g.uuid for g in machine_gpus(driver_for("libcuda.so.1"))}
        restore_many([app.pid], timeout=60, gpu_map={here: here})
        assert app.ask("digest") == before
        # an image records the GPU by UUID and name, and goes back through the same map
        gpucr.checkpoint(app.pid, timeout=60, image=tmp_path / "img")
        restore_many([app.pid], timeout=60, images={app.pid: tmp_path / "img"}, gpu_map={here: here})
        assert app.ask("digest") == before


def all_used() -> dict[str, int]:
    return {g.uuid: used(g.uuid) for g in machine_gpus(driver_for("libcuda.so.1"))}


@two_gpus
def test_process_on_two_gpus_with_peer_access():
    idle = all_used()
    with Workload("multi_gpu_app", "--gib", "4") as app:
        uuids = app.ask("uuids")["uuids"]
        assert app.ask("peer-copy") == {"peer_access": True, "equal": True}
        before = app.ask("digest")
        for _ in range(2):
            gpucr.checkpoint(app.pid, timeout=60)
            st = gpucr.status(app.pid)
            assert sorted(d.uuid for d in st.gpus) == sorted(uuids[:len(st.gpus)])
            assert len(st.gpus) == len(uuids)
            during = all_used()
            for u in uuids:
                assert during[u] - idle[u] <= SLACK, f"{u}: {(during[u] - idle[u]) / MiB:.0f} MiB above idle"
            gpucr.restore(app.pid, timeout=60)
            assert app.ask("digest") == before
            assert app.ask("peer-copy") == {"peer_access": True, "equal": True}


@two_gpus
def test_process_restored_onto_swapped_gpus():
    with Workload("multi_gpu_app", "--gib", "2") as app:
        a, b, *others = app.ask("uuids")["uuids"]
        before = app.ask("digest")
        gpucr.checkpoint(app.pid, timeout=60)
        # every GPU of the process needs a pair: a map naming only the first is refused, nothing touched
        with pytest.raises(gpucr.GpucrError, match="which --map does not name"):
            restore_many([app.pid], timeout=60, gpu_map={a: b})
        assert gpucr.status(app.pid).state == "checkpointed"
        restore_many([app.pid], timeout=60, gpu_map={a: b, b: a, **{u: u for u in others}})
        assert app.ask("uuids")["uuids"][:2] == [b, a], "device 0 is now the other card"
        assert app.ask("digest") == before
        assert app.ask("peer-copy")["equal"]
        st = gpucr.status(app.pid)
        assert {d.ordinal: d.uuid for d in st.gpus}[0] == b

