"""A CuPy application holding --gib GiB of random data (CuPy's memory pool over cudaMalloc, or with
--async-pool CuPy's MemoryAsyncPool over cudaMallocAsync, the stream-ordered allocator).

Commands: digest | compute | work | loop start | loop stop | quit
"""
from __future__ import annotations

import argparse
import threading

import cupy as cp

from .protocol import serve


def arr_digest(a: "cp.ndarray") -> list[int]:
    v = a.view(cp.int32).ravel().astype(cp.int64)
    idx = cp.arange(v.size, dtype=cp.int64)
    return [int(v.sum()), int((v * (idx * 2654435761 % 1000003 + 1)).sum())]


class App:
    def __init__(self, gib: float, seed: int) -> None:
        rs = cp.random.RandomState(seed)
        n_total = int(gib * (1 << 30)) // 4
        per = 1 << 27
        self.data = []
        while n_total > 0:
            n = min(per, n_total)
            self.data.append(rs.randint(-2**31, 2**31 - 1, size=n, dtype=cp.int32))
            n_total -= n
        self.w = rs.standard_normal((1024, 1024), dtype=cp.float32)
        cp.cuda.Device().synchronize()
        self.stop = threading.Event()
        self.thread = None
        self.iters = 0
        self.error = None

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "digest":
            d = [arr_digest(a) for a in self.data + [self.w]]
            return {"digest": d, "ptrs": [a.data.ptr for a in self.data + [self.w]],
                    "bytes": sum(a.nbytes for a in self.data)}
        if cmd == "compute":
            y = (self.w @ self.w).sum(axis=0)
            return {"result": [float(v) for v in y[:8].get()], "checksum": float(y.astype(cp.float64).sum())}
        if cmd == "work":
            for a in self.data:
                a += 5
                a -= 5
            cp.cuda.Device().synchronize()
            return {"done": True}
        if cmd == "loop" and words[1] == "start":
            self.stop.clear()
            self.iters = 0

            def run() -> None:
                try:
                    x = self.data[0][: 1 << 22]
                    while not self.stop.is_set():
                        x += 1
                        x -= 1
                        self.iters += 1
                    cp.cuda.Device().synchronize()
                except Exception as exc:
                    self.error = str(exc)
            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()
            return {"started": True}
        if cmd == "loop" and words[1] == "stop":
            self.stop.set()
            self.thread.join()
            return {"iterations": self.iters, "error": self.error}
        raise ValueError(f"unknown command {cmd}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-pool", action="store_true", help="allocate through cupy.cuda.MemoryAsyncPool")
    a = ap.parse_args()
    if a.async_pool:   # before the first allocation: every array then comes from cudaMallocAsync
        cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
    serve(App(a.gib, a.seed).handle, {"framework": "cupy", "cupy": cp.__version__, "async_pool": a.async_pool})


if __name__ == "__main__":
    main()
