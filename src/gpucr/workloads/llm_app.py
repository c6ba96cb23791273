"""An LLM serving process, shaped like a vLLM worker: a real architecture with random bf16 weights
on the GPU, and a KV cache preallocated up to --gpu-util of the card. Its contents (--kv, kv_cache.py): random
(the default: no copy can skip zeros), zeros (torch.zeros, never written: a fresh server), or served (zeros, then
--requests requests prefilled through the model, their keys and values written into the first blocks).

The architectures are the models' own config.json values, written out here (no hub access, no
download); the weights are random, so the tokens mean nothing, but the memory, the kernels and the
allocation pattern are those of the real model.

Commands: generate N | digest | info | serve-speed N | quit

torch and transformers are imported where they are used, so MODELS can be read without them.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable

from . import Place
from .kv_cache import KV_MODES, REQUEST_TOKENS, SERVED_REQUESTS, allocate, serve_requests

if TYPE_CHECKING:
    import torch

PROMPT_TOKENS = 32
PROMPT_SEED = 1234
KV_BLOCK = 16           # tokens per KV block, vLLM's default

# config.json of each model, the keys that shape the network (legacy key names, which every
# transformers version still reads, as it must to load the hub's files)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": ("llama", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001}),
    # microsoft/Phi-4-mini-instruct
    "phi4-mini": ("phi3", {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [
            1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
            2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
            4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
            8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
            16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884,
            32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97,
            33.28, 33.49, 33.5, 44.16, 47.77]},
        "hidden_act": "silu", "tie_word_embeddings": True, "sliding_window": 262144,
        "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999}),
    # EleutherAI/pythia-1b
    "pythia-1b": ("gpt_neox", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 8, "vocab_size": 50304, "max_position_embeddings": 2048,
        "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
        "layer_norm_eps": 1e-5, "hidden_act": "gelu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0}),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": ("qwen3", {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
        "attention_bias": False, "use_sliding_window": False, "max_window_layers": 28,
        "bos_token_id": 151643, "eos_token_id": 151645}),
}


def build_config(name: str):
    """The transformers config of one of MODELS (only the config classes; nothing is fetched)."""
    from transformers import GPTNeoXConfig, LlamaConfig, Phi3Config, Qwen3Config
    classes = {"llama": LlamaConfig, "phi3": Phi3Config, "gpt_neox": GPTNeoXConfig, "qwen3": Qwen3Config}
    kind, values = MODELS[name]
    return classes[kind](**values)


def kv_geometry(cfg) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the attention, whatever the architecture calls them."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def build_model(cfg, device: str | torch.device) -> torch.nn.Module:
    """The model with random bf16 weights created where it runs (no host copy, no fp32 detour)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16
    kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    return model.eval()


def greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    """N new tokens by argmax, through the model's own KV cache: deterministic, and no stopping
    rule (random weights may well emit EOS)."""
    import torch
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        tokens: list[torch.Tensor] = []
        for _ in range(n):
            nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens.append(nxt)
            if len(tokens) < n:
                out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)[0].tolist()


def fixed_prompt(vocab: int, device: str | torch.device) -> torch.Tensor:
    import torch
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=g).to(device)


def kv_cache(layers: int, kv_heads: int, head_dim: int, budget: int, device: str | torch.device,
             mode: str = "random") -> list[torch.Tensor]:
    """A vLLM-style KV cache filling `budget` bytes: one tensor per layer, [2, blocks, block, kv heads,
    head dim] in bf16, filled with random data so no copy can skip zeros (mode random), or zeros (kv_cache.py)."""
    return allocate(layers, KV_BLOCK, kv_heads, head_dim, budget, device, mode)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class App:
    def __init__(self, name: str, gpu_util: float, seed: int, place: Place = contextlib.nullcontext,
                 kv: str = "random", requests: int = SERVED_REQUESTS, request_tokens: int = REQUEST_TOKENS) -> None:
        """place: where the weights and the KV cache are allocated (tms_app: a torch_memory_saver
        region); the warm-up generation's activations and workspaces stay outside it. kv: the KV cache's
        contents (KV_MODES); served: `requests` of `request_tokens` each prefilled into it."""
        import torch

        from ..driver import _nvml_memory
        self.torch = torch
        before = _nvml_memory(0)       # the card before this process made its context
        torch.manual_seed(seed)
        self.name = name
        self.cfg = build_config(name)
        with place():
            self.model = build_model(self.cfg, "cuda")
        self.prompt = fixed_prompt(self.cfg.vocab_size, "cuda")
        # a short generation first: cuBLAS handles, workspaces and kernels come lazily and are
        # part of what a serving process holds before vLLM sizes its KV cache
        greedy(self.model, self.prompt, 2)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = _nvml_memory(0)
        total = torch.cuda.mem_get_info()[1]
        # what this process holds now: context, cuBLAS workspace, weights (as NVML counts it, when it answers)
        held = after.used - before.used if before and after else torch.cuda.memory_reserved()
        self.kv_mode = kv
        with place():
            self.kv = self._kv_cache(int(gpu_util * total) - held)
        self.served = {"requests": 0, "blocks": 0}
        if kv == "served":   # its activations come and go outside the share, as a serving engine's do
            self.served = serve_requests(self.model, self.kv, KV_BLOCK, requests, request_tokens,
                                         self.cfg.vocab_size, PROMPT_SEED + 1)
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        self.weights = list(self.model.parameters())
        # a few weights for the digest: first (embedding), one in the middle, last
        self.probe = [self.weights[0], self.weights[len(self.weights) // 2], self.weights[-1]]

    def _kv_cache(self, budget: int) -> list[torch.Tensor]:
        return kv_cache(*kv_geometry(self.cfg), budget, "cuda", "random" if self.kv_mode == "random" else "zeros")

    def info(self) -> dict:
        cuda = self.torch.cuda
        return {"model": self.name, "weights_bytes": sum(nbytes(p) for p in self.weights),
                "kv_cache_bytes": sum(nbytes(t) for t in self.kv), "kv_tensors": len(self.kv), "kv_mode": self.kv_mode,
                "kv_blocks": self.kv[0].shape[1], "served_requests": self.served["requests"],
                "served_blocks": self.served["blocks"],
                "reserved_bytes": cuda.memory_reserved(), "allocated_bytes": cuda.memory_allocated()}

    def digest(self) -> dict:
        from .torch_app import tensor_digest
        tensors = self.kv + self.probe
        d = [tensor_digest(t) for t in tensors]
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()   # the digest's temporaries are not part of the footprint
        return {"digest": d, "ptrs": [t.data_ptr() for t in tensors], "bytes": sum(nbytes(t) for t in self.kv)}

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "generate":
            tokens = greedy(self.model, self.prompt, int(words[1]))
            self.torch.cuda.empty_cache()
            return {"tokens": tokens}
        if cmd == "digest":
            return self.digest()
        if cmd == "serve-speed":   # tokens per second of one greedy generation, prompt included
            self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = len(greedy(self.model, self.prompt, int(words[1])))
            self.torch.cuda.synchronize()
            s = time.perf_counter() - t0
            return {"tokens_per_s": n / s, "seconds": s, "tokens": n}
        if cmd == "info":
            return self.info()
        raise ValueError(f"unknown command {cmd}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m gpucr.workloads.llm_app")
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--gpu-util", type=float, default=0.5, help="share of the card this server may hold (vLLM's meaning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv", choices=KV_MODES, default="random", help="the KV cache's contents: random (default), zeros "
                    "(never written, a fresh server), served (zeros, then --requests requests prefilled into it)")
    ap.add_argument("--requests", type=int, default=SERVED_REQUESTS, help=f"--kv served: requests (default {SERVED_REQUESTS})")
    ap.add_argument("--request-tokens", type=int, default=REQUEST_TOKENS,
                    help=f"--kv served: prompt tokens of each (default {REQUEST_TOKENS})")
    return ap


def build(a: argparse.Namespace, place: Place = contextlib.nullcontext) -> tuple[Callable[[list[str]], dict], dict]:
    """The server's protocol handler and its ready line; place as App takes it."""
    app = App(a.model, a.gpu_util, a.seed, place, a.kv, a.requests, a.request_tokens)
    import transformers
    return app.handle, {"framework": "torch", "torch": app.torch.__version__,
                        "transformers": transformers.__version__, **app.info()}


def main() -> None:
    from .protocol import serve
    serve(*build(parser().parse_args()))


if __name__ == "__main__":
    main()
