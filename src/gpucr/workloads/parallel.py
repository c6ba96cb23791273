"""What the three parallel workloads share: their options, and building a Server from the stages
a mode put on its devices (KV cache sized after the weights, NCCL buffers and workspaces exist)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .llama import Shape, Stage
from .serving import Server, Step, gpu_used, kv_budget

if TYPE_CHECKING:
    import torch


def arguments(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="llama3-8b", help="a Llama-architecture shape of llm_app.MODELS (default llama3-8b)")
    ap.add_argument("--gpu-util", type=float, default=0.5, help="share of each GPU this job may hold, weights and KV "
                    "cache (vLLM's meaning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (quick checks only)")
    return ap


def used_before(devices: list["torch.device"]) -> dict["torch.device", int | None]:
    """Each GPU's memory in use before this process makes its context there (call it first)."""
    return {d: gpu_used(d.index) if d.type == "cuda" else None for d in devices}


def layer_split(layers: int, parts: int) -> list[range]:
    """Contiguous layer ranges, as even as they go; the last part takes the remainder."""
    per = layers // parts
    if per < 1:
        raise SystemExit(f"{layers} layers cannot be split over {parts} stages")
    return [range(i * per, layers if i == parts - 1 else (i + 1) * per) for i in range(parts)]


def build_server(step: Step, stages: list[Stage], shape: Shape, gpu_util: float,
                 before: dict["torch.device", int | None], describe: dict, **kw) -> Server:
    """Warm up (cuBLAS handles, NCCL communicators and buffers come lazily, before a server sizes its
    KV cache, as in vLLM), then fill each device's --gpu-util share with a KV cache for its layers."""
    import torch
    from .llm_app import kv_cache
    first = stages[0].device
    with torch.no_grad():
        step(torch.zeros(4, dtype=torch.int64, device=first), torch.arange(4, device=first))
    kv = {}
    for d in before:
        layers = sum(len(s.layers) for s in stages if s.device == d)
        kv_heads = next(s.kv_heads for s in stages if s.device == d)
        kv[d] = kv_cache(layers, kv_heads, shape.head_dim, kv_budget(d, gpu_util, before[d]), d)
    return Server(step, stages, kv, shape.vocab, describe, **kw)
