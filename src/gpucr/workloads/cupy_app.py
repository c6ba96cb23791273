"""A CuPy application holding --gib GiB of random data (CuPy's memory pool over cudaMalloc, or with
--async-pool CuPy's MemoryAsyncPool over cudaMallocAsync, the stream-ordered allocator).

Commands: digest | compute | work | loop start | loop stop | grow BYTES | drop | release | meminfo | quit
(grow, drop, release and meminfo: the swap service's room on demand, issue 27; tests/gpu/test_gpu_swap.py)
"""
from __future__ import annotations

import threading

import cupy as cp

from .protocol import serve, sized_parser

FILL = 1 << 27   # elements per piece of a grown array's fill and of a digest (512 MiB of int32): small temporaries


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
        self.rs = rs
        self.grown: list = []   # arrays added by `grow`, each one allocation of its size
        cp.cuda.Device().synchronize()
        self.stop = threading.Event()
        self.thread = None
        self.iters = 0
        self.error = None

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "digest":
            held = self.data + self.grown + [self.w]
            d = [arr_digest(a[o:o + FILL]) for a in held for o in range(0, a.size, FILL)]
            return {"digest": d, "ptrs": [a.data.ptr for a in held], "bytes": sum(a.nbytes for a in self.data + self.grown)}
        if cmd == "grow":
            return self.grow(int(words[1]))
        if cmd == "drop":   # the grown arrays go back to CuPy's pool, which keeps them
            self.grown.clear()
            cp.cuda.Device().synchronize()
            return self.memory()
        if cmd == "release":   # the pool's free blocks given back to the driver
            cp.get_default_memory_pool().free_all_blocks()
            return self.memory()
        if cmd == "meminfo":
            return self.memory()
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

    def memory(self) -> dict:
        """The card's free and total memory as the driver says, and what CuPy's pool holds and uses."""
        free, total = cp.cuda.runtime.memGetInfo()
        pool = cp.get_default_memory_pool()
        return {"free_bytes": free, "total_bytes": total, "reserved_bytes": pool.total_bytes(),
                "allocated_bytes": pool.used_bytes()}

    def grow(self, nbytes: int) -> dict:
        """One array of nbytes more (one cudaMalloc when the pool has no block for it), filled with random data in
        pieces, so no temporary near its size is made beside it."""
        a = cp.empty(nbytes // 4, dtype=cp.int32)
        for o in range(0, a.size, FILL):
            a[o:o + FILL] = self.rs.randint(-2**31, 2**31 - 1, size=min(FILL, a.size - o), dtype=cp.int32)
        cp.cuda.Device().synchronize()
        self.grown.append(a)
        return {"grown_bytes": a.nbytes, "ptr": a.data.ptr, **self.memory()}


def main() -> None:
    ap = sized_parser("cupy_app", "gib", 1.0)
    ap.add_argument("--async-pool", action="store_true", help="allocate through cupy.cuda.MemoryAsyncPool")
    a = ap.parse_args()
    if a.async_pool:   # before the first allocation: every array then comes from cudaMallocAsync
        cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
    serve(App(a.gib, a.seed).handle, {"framework": "cupy", "cupy": cp.__version__, "async_pool": a.async_pool})


if __name__ == "__main__":
    main()
