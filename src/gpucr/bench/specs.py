"""The bench's workloads: what a name like 'raw:8', 'llama3-8b' or 'tp2-llama3-8b' means, how its
processes are started (under gpucr's agent or plain), and what must be the same after a restore."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import GpucrError
from ..workloads import runner
from ..workloads.job import Job
from ..workloads.kv_cache import KV_MODES
from ..workloads.llm_app import MODELS

if TYPE_CHECKING:
    from .methods import Method

GENERATE_TOKENS = 32


@dataclass(frozen=True)
class Spec:
    """One workload of the bench (see WORKLOADS for the names it is written as)."""
    name: str
    module: str
    args: tuple[str, ...]
    llm: bool
    launch: str = "single"     # workloads.job.LAUNCHES
    world: int = 1             # processes of the job
    gpus: int = 1              # GPUs it spans
    env: tuple[tuple[str, str], ...] = ()   # settings of the application itself (its allocator's)
    needs_gpu: str | None = None            # why it cannot run on simcuda, said when it is skipped there

    @property
    def nccl(self) -> bool:
        return self.module in ("tp_app", "pp_app")

    @property
    def group(self) -> str | None:
        """The gpucr group (GPUCR_GROUP) of a job of several processes that gpucr's agent starts itself."""
        return f"bench-{self.name}" if self.launch in ("ranks", "copies") else None

    @property
    def gib(self) -> float | None:
        """GiB of data the job holds, where its name says (None for the LLM servers)."""
        if self.llm:
            return None
        return float(self.args[self.args.index("--gib") + 1]) * (self.world if self.launch == "copies" else 1)


# prefix -> (module, launch, ranks): the multi-GPU jobs, each of a Llama-architecture model of MODELS
JOBS = {"tp2": ("tp_app", "torchrun", 2), "pp2": ("pp_app", "torchrun", 2), "2gpu": ("two_gpu_app", "single", 1)}
# NCCL as docs/nccl.md says gpucr runs it; the driver's own path gets the same, so both see one job
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NO_FAST_TRANSPORTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
LLM_NEEDS = "LLM workloads need a GPU"
# KIND:GIB -> (module, launch, processes, the application's settings, why it needs a GPU)
SIZED = {
    "raw": ("raw_app", "single", 1, (), None),
    "shared": ("shared_app", "ranks", 2, (), None),
    "torch": ("torch_app", "single", 1, (), "torch runs on a GPU only"),
    "torch-expandable": ("torch_app", "single", 1, (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),),
                         "torch runs on a GPU only"),
    # XLA's allocator without its preallocation (75 % of the card by default): it holds what the data needs
    "jax": ("jax_app", "single", 1, (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),), "JAX runs on a GPU only"),
}
MAX_GROUP = 8
WORKLOADS = (f"{', '.join(k + ':GIB' for k in SIZED)} (raw: one buffer; shared: a pair of processes sharing it, "
             f"exported and imported as NCCL does; torch / torch-expandable: PyTorch's default allocator or its "
             f"expandable segments; jax: XLA's allocator), an LLM server ({', '.join(MODELS)}), a group of N "
             f"independent ones checkpointed as one (groupN-W, e.g. group2-llama3-8b or group2-raw:8), or a "
             f"multi-GPU job {'|'.join(JOBS)}-MODEL (e.g. tp2-llama3-8b); an LLM server's KV cache contents after "
             f"@ ({'|'.join(KV_MODES)}, e.g. llama3-8b@served; random by default), a raw buffer's zero share after "
             f"@zero= (e.g. raw:8@zero=0.75: its first 75 % all zero)")
ZERO_PREFIX = "zero="


def parse_workload(text: str, gpu_util: float) -> Spec:
    text = text.strip()
    prefix, _, rest = text.partition("-")
    if prefix.startswith("group") and rest:
        return _group(text, prefix[5:], parse_workload(rest, gpu_util))
    base, at, contents = text.partition("@")
    if at:
        return _with_contents(text, parse_workload(base, gpu_util), contents)
    if text in MODELS:
        return Spec(text, "llm_app", (text, "--gpu-util", str(gpu_util)), True, needs_gpu=LLM_NEEDS)
    prefix, _, rest = text.partition("-")
    if prefix in JOBS and rest in MODELS:
        if MODELS[rest][0] != "llama":
            raise GpucrError(f"workload '{text}': the multi-GPU jobs take a Llama-architecture model (llama3-8b)")
        module, launch, world = JOBS[prefix]
        return Spec(text, module, ("--model", rest, "--gpu-util", str(gpu_util)), True, launch, world,
                    gpus=2 if module == "two_gpu_app" else world, needs_gpu=LLM_NEEDS)
    kind, _, size = text.rpartition(":")
    if kind in SIZED and _positive(size):
        module, launch, world, env, needs = SIZED[kind]
        return Spec(text, module, ("--gib", str(float(size))), False, launch, world, env=env, needs_gpu=needs)
    raise GpucrError(f"unknown workload '{text}': use {WORKLOADS}")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _share(text: str) -> float | None:
    """A share from 0 to 1, or None."""
    try:
        f = float(text)
    except ValueError:
        return None
    return f if 0 <= f <= 1 else None


def _with_contents(text: str, one: Spec, contents: str) -> Spec:
    """W@C: workload W with the memory contents C (issue 26's bench): an LLM server's KV cache (llm_app --kv), or
    the share of a raw buffer that is all zero (raw_app --zero-fraction)."""
    if one.module == "llm_app" and one.launch == "single" and contents in KV_MODES:
        return replace(one, name=text, args=(*one.args, "--kv", contents))
    if one.module == "raw_app" and contents.startswith(ZERO_PREFIX):
        share = _share(contents[len(ZERO_PREFIX):])
        if share is not None:
            return replace(one, name=text, args=(*one.args, "--zero-fraction", str(share)))
    raise GpucrError(f"workload '{text}': contents are given as MODEL@{'|'.join(KV_MODES)} (an LLM server's KV "
                     f"cache) or raw:GIB@zero=F (F from 0 to 1)")


def _group(text: str, count: str, one: Spec) -> Spec:
    """groupN-W: N processes of the single-process workload W on one GPU, started apart, checkpointed as one."""
    if not count.isdigit() or not 2 <= int(count) <= MAX_GROUP:
        raise GpucrError(f"workload '{text}': a group is group2-W to group{MAX_GROUP}-W (N processes of workload W)")
    if one.launch != "single" or one.gpus != 1:
        raise GpucrError(f"workload '{text}': a group is of a single-process workload (raw:GIB, an LLM server, ...), "
                         f"not of '{one.name}'")
    return Spec(text, one.module, one.args, one.llm, "copies", int(count), env=one.env, needs_gpu=one.needs_gpu)


# ---- workload processes ----

def plain_env(simulate: bool) -> dict[str, str]:
    """run_env without the agent (the driver's own checkpoint must see the application as it is)."""
    return runner.plain_env(simulate)


def start(spec: Spec, method: Method, simulate: bool) -> Job:
    """The workload's process(es) for `method`, as one Job (one process for the single-GPU workloads)."""
    module, args, own_env = method.workload(spec)
    env = {**(NCCL_ENV if spec.nccl else {}), **os.environ, **dict(spec.env), **method.agent_env, **method.job_env,
           **own_env}
    return Job(module, args, launch=spec.launch, world=spec.world, env=env, agent=method.under_agent,
               group=spec.group, simulate=simulate)


def observe(w: Job, spec: Spec) -> dict[str, Any]:
    """What must be the same after a restore: every rank's bytes and addresses, and the next tokens."""
    d = w.ask("digest")
    seen = {"digest": [r["digest"] for r in d["ranks"]], "ptrs": [r["ptrs"] for r in d["ranks"]]}
    if spec.llm:
        seen["tokens"] = [r["tokens"] for r in w.ask(f"generate {GENERATE_TOKENS}")["ranks"]]
    return seen


def compare(ref: dict[str, Any], now: dict[str, Any]) -> dict[str, bool]:
    return {k: ref[k] == now.get(k) for k in ref}
