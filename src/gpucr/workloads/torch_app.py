"""A PyTorch application holding --gib GiB of random data in several tensors (default caching
allocator, or expandable segments through PYTORCH_CUDA_ALLOC_CONF), with a small model to compute on.

Commands: digest | info | compute | work | loop start | loop stop | graph start | graph stop | poll start [MS] |
poll counts | poll stop | grow BYTES | drop | release | meminfo | quit
(grow, drop, release and meminfo: the swap service's room on demand, issue 27; tests/gpu/test_gpu_swap.py)
"""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from .polling import Pollers
from .protocol import serve, sized_parser

CHUNK = 1 << 26  # int32 elements per digest step (256 MiB): its int64 temporaries, about 8x a step, must fit beside
                 # an app sized to the card (a 1 GiB step ran out of memory on an H100); the sums do not depend on it


def tensor_digest(t: torch.Tensor) -> list[int]:
    """A position-sensitive checksum of every byte, computed on the GPU in steps of CHUNK."""
    flat = t.view(-1).view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for off in range(0, flat.numel(), CHUNK):
        part = flat[off:off + CHUNK].to(torch.int64)
        s1 += part.sum()
        idx = torch.arange(off, off + part.numel(), device=t.device, dtype=torch.int64)
        s2 += (part * (idx * 2654435761 % 1000003 + 1)).sum()
        del part, idx
    return [int(s1), int(s2)]


class TorchPollers(Pollers):
    """Event.query, Stream.query, torch.cuda.synchronize, the driver's cuCtxSynchronize (through ctypes)
    and Event.record."""

    FAMILIES = ("event-query", "stream-query", "synchronize", "ctx-synchronize", "event-record")

    def __init__(self) -> None:
        super().__init__()
        self.libcuda = ctypes.CDLL("libcuda.so.1")

    def enter(self) -> torch.cuda.Event:
        torch.cuda.set_device(0)   # the thread enters the context, then calls into it
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def call(self, family: str, ev: torch.cuda.Event) -> None:
        if family == "event-query":
            ev.query()
        elif family == "stream-query":
            torch.cuda.current_stream().query()
        elif family == "synchronize":
            torch.cuda.synchronize()
        elif family == "ctx-synchronize":
            rc = self.libcuda.cuCtxSynchronize()
            if rc != 0:
                raise RuntimeError(f"cuCtxSynchronize: CUDA error {rc}")
        else:
            ev.record()


class App:
    def __init__(self, gib: float, seed: int) -> None:
        torch.manual_seed(seed)
        n_total = int(gib * (1 << 30)) // 4
        per = 1 << 28
        self.data: list[torch.Tensor] = []
        while n_total > 0:
            n = min(per, n_total)
            self.data.append(torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda"))
            n_total -= n
        self.w = torch.randn(2048, 2048, device="cuda")
        self.small = [torch.full((k,), k, dtype=torch.float32, device="cuda") for k in (1, 17, 1000, 70000)]
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.iters = 0
        self.error: str | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pollers = TorchPollers()
        self.grown: list[torch.Tensor] = []   # tensors added by `grow`, each one allocation of its size

    def digest(self) -> dict:
        held = self.data + self.grown + self.small + [self.counter, self.w]
        d = [tensor_digest(t) for t in held]
        torch.cuda.synchronize()
        ptrs = [t.data_ptr() for t in held]
        return {"digest": d, "ptrs": ptrs, "bytes": sum(t.numel() * t.element_size() for t in self.data + self.grown)}

    def memory(self) -> dict:
        """The card's free and total memory as the driver says (cuMemGetInfo), and what torch holds and caches."""
        free, total = torch.cuda.mem_get_info()
        return {"free_bytes": free, "total_bytes": total, "reserved_bytes": torch.cuda.memory_reserved(),
                "allocated_bytes": torch.cuda.memory_allocated()}

    def grow(self, nbytes: int) -> dict:
        """One tensor of nbytes more (one cudaMalloc when torch's cache has no block for it), filled in place with
        random data: no temporary of its size, so the allocation is the only one past free memory."""
        t = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        t.random_(-2**31, 2**31 - 1)
        torch.cuda.synchronize()
        self.grown.append(t)
        return {"grown_bytes": t.numel() * 4, "ptr": t.data_ptr(), **self.memory()}

    def info(self) -> dict:
        return {"data_bytes": sum(t.numel() * t.element_size() for t in self.data),
                "reserved_bytes": torch.cuda.memory_reserved(), "framework": "torch",
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}

    def compute(self) -> dict:
        y = (self.w @ self.w).relu().sum(dim=0)
        return {"result": [float(v) for v in y[:8].tolist()], "checksum": float(y.double().sum())}

    def work(self) -> dict:
        for t in self.data:
            t.add_(3)
            t.sub_(3)
        self.counter += 1
        torch.cuda.synchronize()
        return {"counter": int(self.counter)}

    def _loop(self, use_graph: bool) -> None:
        try:
            x = self.data[0][: 1 << 24]
            if use_graph:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    g = torch.cuda.CUDAGraph()
                    x.add_(1); x.sub_(1)   # warm-up outside capture
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g, stream=s):
                        x.add_(1)
                        x.sub_(1)
                    self.graph = g
                    while not self.stop.is_set():
                        g.replay()
                        self.iters += 1
                        if self.iters % 64 == 0:
                            s.synchronize()
                    s.synchronize()
            else:
                while not self.stop.is_set():
                    x.add_(1)
                    x.sub_(1)
                    self.iters += 1
                    if self.iters % 256 == 0:
                        torch.cuda.synchronize()
                torch.cuda.synchronize()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "digest":
            return self.digest()
        if cmd == "info":
            return self.info()
        if cmd == "compute":
            return self.compute()
        if cmd == "work":
            return self.work()
        if cmd == "sleep":   # one kernel that spins on the GPU for about SECONDS (a stuck-kernel stand-in)
            cycles = int(float(words[1]) * torch.cuda.get_device_properties(0).clock_rate * 1000)
            torch.cuda._sleep(cycles)
            return {"launched": True}
        if cmd == "poll":
            return self.pollers.command(words[1:])
        if cmd == "grow":
            return self.grow(int(words[1]))
        if cmd == "drop":   # the grown tensors go back to torch's cache, which keeps them reserved
            self.grown.clear()
            torch.cuda.synchronize()
            return self.memory()
        if cmd == "release":   # torch's cache given back to the driver
            torch.cuda.empty_cache()
            return self.memory()
        if cmd == "meminfo":
            return self.memory()
        if cmd in ("loop", "graph") and words[1] == "start":
            self.stop.clear()
            self.iters = 0
            self.error = None
            self.thread = threading.Thread(target=self._loop, args=(cmd == "graph",), daemon=True)
            self.thread.start()
            return {"started": True}
        if cmd in ("loop", "graph") and words[1] == "stop":
            self.stop.set()
            if self.thread:
                self.thread.join()
            torch.cuda.synchronize()
            return {"iterations": self.iters, "error": self.error}
        raise ValueError(f"unknown command {cmd}")


def main() -> None:
    a = sized_parser("torch_app", "gib", 1.0).parse_args()
    app = App(a.gib, a.seed)
    serve(app.handle, {"framework": "torch", "torch": torch.__version__,
                       "reserved_bytes": torch.cuda.memory_reserved()})


if __name__ == "__main__":
    main()
