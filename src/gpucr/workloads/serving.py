"""What every parallel LLM workload answers, whatever splits its model: generate N, digest, info,
serve-speed N, and (with CUDA graphs) graph start / graph stop.

A mode supplies `step(ids [T], pos [T]) -> next token [1]`, run by every rank together (it holds
the collectives), and the devices this process uses. Like llm_app, each device also holds a
vLLM-style KV cache filled with random data up to --gpu-util of the card; the digest covers it and
some weights, so a restore that loses or moves a byte shows.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from .llama import MAX_SEQ, Stage
from .llm_app import PROMPT_SEED, PROMPT_TOKENS, nbytes

if TYPE_CHECKING:
    import torch

Step = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
CPU_KV_BYTES = 16 << 20        # --device cpu: a token KV cache, the code path only
LOOP_CHUNK = 8                 # graph replays between two checks of whether every rank should stop


def device_uuid(ordinal: int) -> str:
    """The UUID of this process's CUDA device `ordinal`; cuInit first, as it may come before torch's."""
    import ctypes

    from .multi_gpu_app import device_uuid as read
    rc = ctypes.CDLL("libcuda.so.1").cuInit(0)
    if rc != 0:
        raise RuntimeError(f"cuInit failed (CUDA error {rc}): is there a GPU and its driver?")
    return read(ordinal)


def gpu_used(ordinal: int) -> int | None:
    """Bytes in use on this process's CUDA device `ordinal` (NVML, by UUID: no CUDA context needed)."""
    from ..driver import _nvml_memory
    m = _nvml_memory(ordinal, device_uuid(ordinal))
    return m.used if m else None


def kv_budget(device: "torch.device", gpu_util: float, used_before: int | None) -> int:
    """What --gpu-util leaves for the KV cache on `device`: the share of the card, less what this
    process holds there now (NVML's count since before its context, else torch's reserved bytes)."""
    import torch
    if device.type != "cuda":
        return CPU_KV_BYTES
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    now = gpu_used(device.index)
    held = now - used_before if now is not None and used_before is not None else torch.cuda.memory_reserved(device)
    return int(gpu_util * torch.cuda.mem_get_info(device)[1]) - held


def prompt(vocab: int, device: "torch.device") -> "torch.Tensor":
    import torch
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).to(device)


class DecodeGraph:
    """One decode step captured in a CUDA graph, collectives included: it reads the token and the
    position from static buffers and leaves the next token in `out`."""

    def __init__(self, step: Step, device: "torch.device", warmup: int = 3) -> None:
        import torch
        self.torch = torch
        self.tok = torch.zeros(1, dtype=torch.int64, device=device)
        self.pos = torch.full((1,), MAX_SEQ - 1, dtype=torch.int64, device=device)   # a scratch slot
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):      # warm-up off the default stream, as torch.cuda.graph asks
            for _ in range(warmup):
                self.out = step(self.tok, self.pos)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: PyTorch's NCCL watchdog thread queries events while we capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = step(self.tok, self.pos)
        torch.cuda.synchronize(device)

    def decode(self, tok: "torch.Tensor", pos: int) -> "torch.Tensor":
        self.tok.copy_(tok)
        self.pos.fill_(pos)
        self.graph.replay()
        return self.out.clone()


class Server:
    def __init__(self, step: Step, stages: list[Stage], kv: dict["torch.device", list["torch.Tensor"]],
                 vocab: int, describe: dict, agree: Callable[[bool], bool] = lambda flag: flag,
                 graphs: bool = False) -> None:
        import torch
        self.torch, self.step, self.stages, self.kv = torch, step, stages, kv
        self.describe, self.agree = describe, agree
        self.first = stages[0].device
        self.devices = list(kv)
        self.prompt = prompt(vocab, self.first)
        self.positions = torch.arange(MAX_SEQ, device=self.first)
        self.graph = DecodeGraph(step, self.first) if graphs else None
        weights = [t for s in stages for t in s.weights()]
        # a few weights for the digest: first (embedding or first layer), one in the middle, last
        self.probe = [weights[0], weights[len(weights) // 2], weights[-1]]
        self.loop_stop = threading.Event()
        self.loop: threading.Thread | None = None
        self.loop_result: dict = {}

    def sync(self) -> None:
        if self.first.type == "cuda":
            for d in self.devices:
                self.torch.cuda.synchronize(d)

    def generate(self, n: int) -> list[int]:
        """N tokens by argmax after the fixed prompt: deterministic, no stopping rule."""
        torch = self.torch
        if not 1 <= n <= MAX_SEQ - PROMPT_TOKENS:
            raise ValueError(f"generate takes 1 to {MAX_SEQ - PROMPT_TOKENS} tokens")
        with torch.no_grad():
            tok = self.step(self.prompt, self.positions[:PROMPT_TOKENS])
            out = [tok]
            for p in range(PROMPT_TOKENS, PROMPT_TOKENS + n - 1):
                tok = self.graph.decode(tok, p) if self.graph else self.step(tok, self.positions[p:p + 1])
                out.append(tok)
            return torch.cat(out).tolist()

    def info(self) -> dict:
        torch = self.torch
        per = []
        for d in self.devices:
            row = {"device": str(d), "weights_bytes": sum(s.weight_bytes() for s in self.stages if s.device == d),
                   "kv_cache_bytes": sum(nbytes(t) for t in self.kv[d])}
            if d.type == "cuda":
                row.update(uuid=device_uuid(d.index), reserved_bytes=torch.cuda.memory_reserved(d),
                           used_on_gpu_bytes=gpu_used(d.index))
            per.append(row)
        return {**self.describe, "graphs": self.graph is not None, "devices": per}

    def digest(self) -> dict:
        from .torch_app import tensor_digest
        tensors = [t for d in self.devices for t in self.kv[d]] + self.probe
        out = [tensor_digest(t) for t in tensors]
        self.sync()
        if self.first.type == "cuda":
            self.torch.cuda.empty_cache()   # the digest's temporaries are not part of the footprint
        return {"digest": out, "ptrs": [t.data_ptr() for t in tensors],
                "bytes": sum(nbytes(t) for d in self.devices for t in self.kv[d])}

    def serve_speed(self, n: int) -> dict:
        """Tokens per second of one greedy generation of N tokens (prompt included in the time)."""
        self.sync()
        t0 = time.perf_counter()
        tokens = self.generate(n)
        self.sync()
        s = time.perf_counter() - t0
        return {"tokens_per_s": n / s, "seconds": s, "tokens": len(tokens)}

    def _replay_loop(self) -> None:
        """Replay the decode graph until every rank was asked to stop; the ranks agree after each
        chunk, so all stop after the same replay (a lone replay would wait on a collective forever)."""
        g, n = self.graph, 0
        try:
            if self.first.type == "cuda":
                self.torch.cuda.set_device(self.first)   # the current device is per thread
            with self.torch.no_grad():
                while True:
                    for _ in range(LOOP_CHUNK):
                        g.tok.copy_(g.out)
                        g.pos.fill_(MAX_SEQ - 1)
                        g.graph.replay()
                    n += LOOP_CHUNK
                    if self.agree(self.loop_stop.is_set()):
                        break
            self.sync()
            self.loop_result = {"iterations": n, "last_token": int(g.out.item()), "error": None}
        except Exception as exc:
            self.loop_result = {"iterations": n, "error": f"{type(exc).__name__}: {exc}"}

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if self.loop is not None and words != ["graph", "stop"]:
            raise RuntimeError("the graph loop is running: send 'graph stop' first")
        if cmd == "generate":
            return {"tokens": self.generate(int(words[1]))}
        if cmd == "digest":
            return self.digest()
        if cmd == "info":
            return self.info()
        if cmd == "serve-speed":
            return self.serve_speed(int(words[1]))
        if cmd == "graph" and words[1:] in (["start"], ["stop"]):
            if self.graph is None:
                raise RuntimeError("started without --graphs")
            if words[1] == "start":
                self.loop_stop.clear()
                self.loop = threading.Thread(target=self._replay_loop, daemon=True)
                self.loop.start()
                return {"started": True}
            if self.loop is None:
                raise RuntimeError("no graph loop is running")
            self.loop_stop.set()
            self.loop.join()
            self.loop = None
            return self.loop_result
        raise ValueError(f"unknown command {' '.join(words)}")
