"""NCCL jobs (NCCL_CUMEM_ENABLE=1) checkpointed between collectives and resumed: two ranks need two
GPUs (NCCL allows one rank per GPU); one rank runs NCCL's VMM buffers and proxy thread on one GPU."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpucr import checkpoint_many, restore_many   # through the server when one runs, else the CLI's own mover
from gpucr.workloads.runner import Workload

from conftest import gpu, two_gpus


pytestmark = [gpu, pytest.mark.gpu]
ENV = dict(os.environ, NCCL_CUMEM_ENABLE="1", NCCL_NVLS_ENABLE="0", NCCL_GRAPH_REGISTER="0",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def test_one_rank_nccl_job_checkpointed_between_collectives():
    # what one GPU allows: NCCL's cuMem buffers, its communicator and proxy thread under the agent
    with Workload("nccl_app", "--rank", "0", "--world", "1", "--port", "29517", env=ENV) as w:
        assert w.info["nccl_cumem"] == "1"
        assert w.ask("allreduce 3")["ok"]
        before = w.ask("digest")
        for _ in range(3):
            checkpoint_many([w.pid], timeout=60)
            restore_many([w.pid], timeout=60)
            assert w.ask("digest") == before
            r = w.ask("allreduce 5")
            assert r["ok"], r


@two_gpus
def test_two_rank_nccl_job_checkpointed_between_collectives():
    env = ENV
    with ThreadPoolExecutor(2) as pool:   # both ranks must start together: init waits for the other
        ranks = list(pool.map(lambda r: Workload("nccl_app", "--rank", str(r), env=env), range(2)))
    try:
        with ThreadPoolExecutor(2) as pool:
            assert all(r["ok"] for r in pool.map(lambda w: w.ask("allreduce 3"), ranks))
        before = [w.ask("digest") for w in ranks]
        checkpoint_many([w.pid for w in ranks], timeout=120)
        restore_many([w.pid for w in ranks], timeout=120)
        assert [w.ask("digest") for w in ranks] == before
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda w: w.ask("allreduce 5"), ranks))
        assert all(r["ok"] for r in results), results
    finally:
        for w in ranks:
            w.close()
