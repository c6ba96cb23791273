"""The swap benchmark's LLM server (`gpucr bench --scenario swap`): llm_app's server (a model shape with random bf16
weights and a KV cache up to --gpu-util of the card), which answers `generate K` with when its first and its last
token were ready, and which can write its weights once to safetensors (--save-weights DIR) and load them from there
at a later start (--weights DIR), as a model server restarted without gpucr does.

Its KV cache is sized from what this process holds (NVML's count of it), not from the card's used memory before and
after it started: the other servers of the scenario start, park and resume meanwhile.

Commands: generate K | digest | info | quit. generate's first_at and last_at are CLOCK_MONOTONIC, which the bench
shares; the first token is read back (a sync) before the second is computed, as a streaming server sends it.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Callable

from . import llm_app as L
from .protocol import serve, weights_arguments

CONTEXT_GUESS = 600 << 20   # what a context and cuBLAS hold beside torch's cache, when NVML cannot say


def _dtype_kw() -> dict:
    import torch
    import transformers
    return {"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.bfloat16}


class Server:
    def __init__(self, model: str, gpu_util: float, seed: int, weights: Path | None, save: Path | None) -> None:
        import torch

        from ..driver import nvml_process_memory
        self.torch = torch
        torch.manual_seed(seed)
        self.name = model
        self.cfg = L.build_config(model)
        if weights is not None:   # what users do: the model server's own load from its safetensors files
            from transformers import AutoModelForCausalLM
            self.model = AutoModelForCausalLM.from_pretrained(str(weights), device_map="cuda", **_dtype_kw()).eval()
        else:
            self.model = L.build_model(self.cfg, "cuda")
        if save is not None:
            self.model.save_pretrained(str(save))   # safetensors, transformers' default format
        self.prompt = L.fixed_prompt(self.cfg.vocab_size, "cuda")
        L.greedy(self.model, self.prompt, 2)   # cuBLAS handles and kernels before the KV cache is sized
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = nvml_process_memory(os.getpid(), 0, None) or torch.cuda.memory_reserved() + CONTEXT_GUESS
        self.kv = L.kv_cache(*L.kv_geometry(self.cfg), int(gpu_util * torch.cuda.mem_get_info()[1]) - held, "cuda")
        torch.cuda.synchronize()

    def generate(self, k: int) -> dict:
        torch = self.torch
        with torch.no_grad():
            out = self.model(input_ids=self.prompt, use_cache=True)
            nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens = [int(nxt.item())]
            first_at = time.monotonic()
            while len(tokens) < k:
                out = self.model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
                nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
                tokens.append(int(nxt.item()))
            last_at = time.monotonic()
        del out
        torch.cuda.empty_cache()   # as llm_app: a request's activations are not kept
        return {"tokens": tokens, "first_at": first_at, "last_at": last_at}

    def info(self) -> dict:
        return {"model": self.name, "weights_bytes": sum(L.nbytes(p) for p in self.model.parameters()),
                "kv_cache_bytes": sum(L.nbytes(t) for t in self.kv),
                "reserved_bytes": self.torch.cuda.memory_reserved(), "framework": "torch"}

    def handle(self, words: list[str]) -> dict:
        if words[0] == "generate":
            return self.generate(int(words[1]))
        if words[0] == "info":
            return self.info()
        if words[0] == "digest":
            from .torch_app import tensor_digest
            return {"digest": [tensor_digest(t) for t in self.kv]}
        raise ValueError(f"unknown command {words[0]}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m gpucr.workloads.swap_llm_app")
    ap.add_argument("model", choices=sorted(L.MODELS))
    ap.add_argument("--gpu-util", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    weights_arguments(ap, "the model", "directory")
    return ap


def build(a: argparse.Namespace) -> tuple[Callable[[list[str]], dict], dict]:
    s = Server(a.model, a.gpu_util, a.seed, a.weights, a.save_weights)
    return s.handle, {"framework": "torch", **s.info()}


def main() -> None:
    serve(*build(parser().parse_args()))


if __name__ == "__main__":
    main()
