"""A Llama decoder written out with plain torch ops, so it can be split across GPUs and processes:
heads and MLP columns across tensor-parallel ranks (an all-reduce after each row-parallel product),
layers across pipeline stages. The shape is the model's transformers config (llm_app.MODELS); the
weights are random bf16, drawn on the device from a seeded generator, so every run of a rank holds
the same bytes.

Generation keeps its own small KV cache of MAX_SEQ positions per layer (static, so a decode step can
be captured in a CUDA graph); attention always spans all MAX_SEQ positions under a causal mask, so
eager steps and graph replays run the same kernels on the same shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

MAX_SEQ = 576          # prompt (32) + up to 544 new tokens
INIT_STD = 0.02        # transformers' initializer_range for Llama


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float


def shape_of(name: str, layers: int | None = None) -> Shape:
    """The decoder's shape from the model's transformers config; `layers` cuts it short (CPU checks)."""
    from .llm_app import MODELS, build_config
    cfg = build_config(name)
    values = MODELS[name][1]   # rope_theta: transformers 5 keeps it under rope_parameters, 4 as an attribute
    if cfg.model_type != "llama":
        raise SystemExit(f"{name} is not a Llama-architecture model: the parallel workloads take llama3-8b")
    heads = cfg.num_attention_heads
    return Shape(hidden=cfg.hidden_size, inter=cfg.intermediate_size, layers=layers or cfg.num_hidden_layers,
                 heads=heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // heads,
                 vocab=cfg.vocab_size, rope_theta=float(values["rope_theta"]), eps=float(cfg.rms_norm_eps))


@dataclass(frozen=True)
class Tp:
    """This rank's place in a tensor-parallel group and how it sums partial results."""
    rank: int
    size: int
    all_reduce: Callable[["torch.Tensor"], None]
    all_gather: Callable[["torch.Tensor"], "torch.Tensor"]   # [n] -> [size * n], rank order


SOLO = Tp(0, 1, lambda t: None, lambda t: t)


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise SystemExit(f"{what} ({n}) does not split evenly over {parts} tensor-parallel ranks")
    return n // parts


class Stage:
    """Layers [first, last) of the model on one device, this rank's tensor-parallel shard of each,
    plus the embedding (if `embeds`) and the final norm and LM head (if `heads`)."""

    def __init__(self, shape: Shape, layers: range, device: "torch.device", seed: int, tp: Tp = SOLO,
                 embeds: bool = True, heads: bool = True) -> None:
        import torch
        self.torch, self.shape, self.device, self.tp = torch, shape, device, tp
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(*size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.bfloat16, device=device).normal_(0.0, INIT_STD, generator=g)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=torch.bfloat16, device=device)
        s = shape
        self.q_heads = _split(s.heads, tp.size, "attention heads")
        self.kv_heads = _split(s.kv_heads, tp.size, "key/value heads")
        inter = _split(s.inter, tp.size, "MLP width")
        self.vocab_part = _split(s.vocab, tp.size, "vocabulary")
        qkv = (self.q_heads + 2 * self.kv_heads) * s.head_dim
        self.layers = []
        for _ in layers:
            self.layers.append({
                "ln1": ones(s.hidden), "ln2": ones(s.hidden),
                "wqkv": rand(qkv, s.hidden),                              # column-parallel: this rank's heads
                "wo": rand(s.hidden, self.q_heads * s.head_dim),          # row-parallel: all-reduce after
                "w13": rand(2 * inter, s.hidden),                         # gate and up, column-parallel
                "w2": rand(s.hidden, inter),                              # row-parallel: all-reduce after
                "cache": torch.zeros((2, MAX_SEQ, self.kv_heads, s.head_dim), dtype=torch.bfloat16, device=device),
            })
        # vocabulary-parallel embedding and LM head: this rank's rows of the vocabulary
        self.embedding = rand(self.vocab_part, s.hidden) if embeds else None
        self.norm = ones(s.hidden) if heads else None
        self.lm_head = rand(self.vocab_part, s.hidden) if heads else None
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32, device=device) / s.head_dim))
        freqs = torch.outer(torch.arange(MAX_SEQ, dtype=torch.float32, device=device), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.positions = torch.arange(MAX_SEQ, device=device)

    def weights(self) -> list["torch.Tensor"]:
        out = [t for layer in self.layers for k, t in layer.items() if k != "cache"]
        return out + [t for t in (self.embedding, self.norm, self.lm_head) if t is not None]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights())

    def _rms(self, x: "torch.Tensor", w: "torch.Tensor") -> "torch.Tensor":
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.eps)).to(x.dtype) * w

    def _rope(self, x: "torch.Tensor", pos: "torch.Tensor") -> "torch.Tensor":
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]     # [T, 1, D]
        half = x.shape[-1] // 2
        rot = self.torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)

    def embed(self, ids: "torch.Tensor") -> "torch.Tensor":
        """[T] token ids -> [T, hidden]; each rank looks up its rows, the all-reduce sums them."""
        local = ids - self.tp.rank * self.vocab_part
        valid = (local >= 0) & (local < self.vocab_part)
        x = self.embedding[local.clamp(0, self.vocab_part - 1)] * valid[:, None].to(self.embedding.dtype)
        self.tp.all_reduce(x)
        return x

    def run_layers(self, x: "torch.Tensor", pos: "torch.Tensor") -> "torch.Tensor":
        """x [T, hidden] at positions pos [T]: every layer of this stage, writing the generation cache."""
        F = self.torch.nn.functional
        s, T = self.shape, x.shape[0]
        q_dim, kv_dim = self.q_heads * s.head_dim, self.kv_heads * s.head_dim
        group = self.q_heads // self.kv_heads
        mask = self.positions[None, :] <= pos[:, None]                       # [T, MAX_SEQ] causal
        for L in self.layers:
            h = self._rms(x, L["ln1"])
            q, k, v = (h @ L["wqkv"].T).split((q_dim, kv_dim, kv_dim), dim=-1)
            q = self._rope(q.view(T, self.q_heads, s.head_dim), pos)
            k = self._rope(k.view(T, self.kv_heads, s.head_dim), pos)
            cache = L["cache"]
            cache[0].index_copy_(0, pos, k)
            cache[1].index_copy_(0, pos, v.view(T, self.kv_heads, s.head_dim))
            keys = cache[0].repeat_interleave(group, dim=1).transpose(0, 1)      # [heads, MAX_SEQ, D]
            vals = cache[1].repeat_interleave(group, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], vals[None], attn_mask=mask)
            out = o[0].transpose(0, 1).reshape(T, q_dim) @ L["wo"].T
            self.tp.all_reduce(out)
            x = x + out
            h = self._rms(x, L["ln2"])
            gate, up = (h @ L["w13"].T).chunk(2, dim=-1)
            out = (F.silu(gate) * up) @ L["w2"].T
            self.tp.all_reduce(out)
            x = x + out
        return x

    def next_token(self, x: "torch.Tensor") -> "torch.Tensor":
        """[T, hidden] -> the greedy next token after the last position, [1] int64, the same on every rank."""
        h = self._rms(x[-1:], self.norm)
        logits = self.tp.all_gather((h @ self.lm_head.T)[0])                 # [vocab], rank order
        return logits.argmax(dim=-1, keepdim=True)


def nccl_tp(rank: int, size: int, group=None) -> Tp:
    """A Tp over torch.distributed (NCCL on GPUs, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(size * t.numel(), dtype=t.dtype, device=t.device)   # one flat buffer: no copies after
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out
    return Tp(rank, size, all_reduce, all_gather)

