"""A PyTorch process on every visible GPU (two or more): --gib GiB of random data on each, and a
matrix on GPU 0 that GPU 1 reads directly through peer access (a transposed, so non-contiguous, copy
runs as a kernel on GPU 1 that loads GPU 0's memory, not as a copy-engine transfer).

Commands: digest | peer-copy | uuids | quit
"""
from __future__ import annotations

import ctypes

import torch

from ..driver import uuid_text
from .protocol import serve, sized_parser
from .torch_app import tensor_digest


def device_uuid(ordinal: int) -> str:
    cu = ctypes.CDLL("libcuda.so.1")
    dev, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
    if cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or cu.cuDeviceGetUuid_v2(raw, dev) != 0:
        raise RuntimeError(f"cannot read the UUID of device {ordinal}")
    return uuid_text(raw.raw)


class App:
    def __init__(self, gib: float, seed: int) -> None:
        self.n = torch.cuda.device_count()
        if self.n < 2:
            raise SystemExit("multi_gpu_app needs two or more GPUs")
        torch.manual_seed(seed)
        per = int(gib * (1 << 30)) // 4
        self.data = [torch.randint(-2**31, 2**31 - 1, (per,), dtype=torch.int32, device=f"cuda:{d}") for d in range(self.n)]
        self.m0 = torch.randn(4096, 4096, device="cuda:0")
        self.peer = torch.cuda.can_device_access_peer(1, 0)
        torch.cuda.synchronize()

    def digest(self) -> dict:
        ts = self.data + [self.m0]
        return {"digest": [tensor_digest(t) for t in ts], "ptrs": [t.data_ptr() for t in ts]}

    def peer_copy(self) -> dict:
        y = torch.empty(4096, 4096, device="cuda:1")
        y.copy_(self.m0.t())   # non-contiguous: a kernel on GPU 1 reads GPU 0's memory over peer access
        torch.cuda.synchronize(1)
        want = self.m0.t().contiguous().to("cuda:1")
        return {"peer_access": self.peer, "equal": bool(torch.equal(y, want))}

    def handle(self, words: list[str]) -> dict:
        if words[0] == "digest":
            return self.digest()
        if words[0] == "peer-copy":
            return self.peer_copy()
        if words[0] == "uuids":   # asked of the driver each time: torch caches device properties
            return {"uuids": [device_uuid(d) for d in range(self.n)]}
        raise ValueError(f"unknown command {words[0]}")


def main() -> None:
    a = sized_parser("multi_gpu_app", "gib", 2.0).parse_args()
    app = App(a.gib, a.seed)
    serve(app.handle, {"framework": "torch", "gpus": app.n})


if __name__ == "__main__":
    main()
