"""The LLM workloads' KV cache, vLLM's layout (one tensor per layer, [2, blocks, block, kv heads, head dim], bf16),
and what it holds (issue 26 measures the zero chunks a checkpoint need not move):

- random: filled with random data, so no copy can skip zeros (the bench's worst case, and its default);
- zeros: `torch.zeros`, never written, as vLLM and SGLang preallocate it: a fresh server;
- served: zeros, then requests prefilled through the model's own forward pass, each request's keys and values
  written into blocks of its own from the first on, as a paged cache's block table hands them out: a partly written
  cache, the rest never touched. The requests' tokens come from a seeded generator, so the contents are the same for
  the same seed (the bench compares the bytes and the next tokens after each restore).

torch is imported where it is used, so the modes can be read without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV_MODES = ("random", "zeros", "served")
SERVED_REQUESTS = 128   # at 512 tokens each: 4,096 blocks of 16 tokens, ~8 GiB of llama3-8b's cache (~15 % at 0.5 of an H200)
REQUEST_TOKENS = 512


def allocate(layers: int, block: int, kv_heads: int, head_dim: int, budget: int, device: Any,
             mode: str) -> list[torch.Tensor]:
    """One tensor per layer filling `budget` bytes: random data (mode random), else zeros."""
    import torch
    per_block = layers * 2 * block * kv_heads * head_dim * 2   # bf16
    blocks = budget // per_block
    if blocks < 1:
        raise RuntimeError(f"no room for a KV cache: {budget >> 20} MiB left under the --gpu-util share")
    kv = []
    for _ in range(layers):
        shape = (2, blocks, block, kv_heads, head_dim)
        if mode == "random":
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            t.normal_()
        else:
            t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        kv.append(t)
    return kv


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one layer of the model's own cache, [batch, kv heads, tokens, head dim], whatever the
    transformers version keeps them in: DynamicCache's layers (newer), its key_cache / value_cache lists (older),
    or the legacy tuple of tuples."""
    if hasattr(cache, "layers"):
        one = cache.layers[layer]
        return one.keys, one.values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def serve_requests(model: Any, kv: list[torch.Tensor], block: int, requests: int, tokens: int, vocab: int,
                   seed: int) -> dict[str, int]:
    """`requests` prompts of `tokens` each, prefilled through the model one after another; each request's keys and
    values written into the next free blocks of `kv`, in the paged layout (block b of a layer holds tokens
    b*block .. b*block+block-1 of its request). Stops where the cache is full. Returns what was written."""
    import torch
    blocks = kv[0].shape[1]
    g = torch.Generator().manual_seed(seed)
    at, served = 0, 0
    per_request = -(-tokens // block)
    with torch.no_grad():
        for _ in range(requests):
            if at + per_request > blocks:
                break
            ids = torch.randint(0, vocab, (1, tokens), generator=g).to(kv[0].device)
            cache = model(input_ids=ids, use_cache=True).past_key_values
            for layer, t in enumerate(kv):
                for half, x in enumerate(layer_kv(cache, layer)):
                    # [1, kv heads, tokens, head dim] -> [tokens, kv heads, head dim], the block's token-major order
                    dst = t[half, at:at + per_request].view(per_request * block, *t.shape[3:])   # a view: written in place
                    dst[:tokens].copy_(x[0].transpose(0, 1))
            del cache
            at, served = at + per_request, served + 1
    torch.cuda.synchronize()
    return {"requests": served, "blocks": at}
