"""The bench's workloads: what a name like 'raw:8', 'llama3-8b' or 'tp2-llama3-8b' means, how its
processes are started (under gpucr's agent or plain), and what must be the same after a restore."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import GpucrError
from ..workloads import runner
from ..workloads.job import Job
from ..workloads.llm_app import MODELS

if TYPE_CHECKING:
    from .methods import Method

GENERATE_TOKENS = 32


@dataclass(frozen=True)
class Spec:
    """One workload of the bench: 'llama3-8b' (an LLM server), 'raw:8' (8 GiB raw buffer), or a
    multi-GPU job: 'tp2-llama3-8b' (tensor parallel over two ranks, started by torchrun),
    'pp2-llama3-8b' (pipeline parallel, two ranks), '2gpu-llama3-8b' (one process on two GPUs)."""
    name: str
    module: str
    args: tuple[str, ...]
    llm: bool
    launch: str = "single"     # workloads.job.LAUNCHES
    world: int = 1

    @property
    def nccl(self) -> bool:
        return self.module in ("tp_app", "pp_app")

    @property
    def gpus(self) -> int:
        return 2 if self.module == "two_gpu_app" else self.world


# prefix -> (module, launch, ranks): the multi-GPU jobs, each of a Llama-architecture model of MODELS
JOBS = {"tp2": ("tp_app", "torchrun", 2), "pp2": ("pp_app", "torchrun", 2), "2gpu": ("two_gpu_app", "single", 1)}
# NCCL as docs/nccl.md says gpucr runs it; the driver's own path gets the same, so both see one job
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NO_FAST_TRANSPORTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def parse_workload(text: str, gpu_util: float) -> Spec:
    text = text.strip()
    if text in MODELS:
        return Spec(text, "llm_app", (text, "--gpu-util", str(gpu_util)), True)
    prefix, _, model = text.partition("-")
    if prefix in JOBS and model in MODELS:
        if MODELS[model][0] != "llama":
            raise GpucrError(f"workload '{text}': the multi-GPU jobs take a Llama-architecture model (llama3-8b)")
        module, launch, world = JOBS[prefix]
        return Spec(text, module, ("--model", model, "--gpu-util", str(gpu_util)), True, launch, world)
    if text.startswith("raw:"):
        try:
            gib = float(text[4:])
        except ValueError:
            gib = -1.0
        if gib > 0:
            return Spec(text, "raw_app", ("--gib", str(gib)), False)
    raise GpucrError(f"unknown workload '{text}': use raw:GIB, one of {', '.join(MODELS)}, "
                     f"or a multi-GPU job {'|'.join(JOBS)}-MODEL (e.g. tp2-llama3-8b)")


# ---- workload processes ----

def plain_env(simulate: bool) -> dict[str, str]:
    """run_env without the agent (the driver's own checkpoint must see the application as it is)."""
    return runner.plain_env(simulate)


def start(spec: Spec, method: Method, simulate: bool) -> Job:
    """The workload's process(es) for `method`, as one Job (one process for the single-GPU workloads)."""
    module, args, own_env = method.workload(spec)
    env = {**(NCCL_ENV if spec.nccl else {}), **os.environ, **method.agent_env, **method.job_env, **own_env}
    return Job(module, args, launch=spec.launch, world=spec.world, env=env, agent=method.under_agent,
               simulate=simulate)


def observe(w: Job, spec: Spec) -> dict[str, Any]:
    """What must be the same after a restore: every rank's bytes and addresses, and the next tokens."""
    d = w.ask("digest")
    seen = {"digest": [r["digest"] for r in d["ranks"]], "ptrs": [r["ptrs"] for r in d["ranks"]]}
    if spec.llm:
        seen["tokens"] = [r["tokens"] for r in w.ask(f"generate {GENERATE_TOKENS}")["ranks"]]
    return seen


def compare(ref: dict[str, Any], now: dict[str, Any]) -> dict[str, bool]:
    return {k: ref[k] == now.get(k) for k in ref}
