"""One rank of a two-rank torch.distributed NCCL job (one GPU per rank), for checkpointing between
collectives. Commands: allreduce N (sum of a tensor filled with rank+1, N times; returns the value
every element should hold) | digest | quit."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from .protocol import serve
from .torch_app import tensor_digest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29511)
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args()
    torch.cuda.set_device(a.rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    x = torch.full(((a.mib << 20) // 4,), float(a.rank + 1), device="cuda")
    data = torch.randn((64 << 20) // 4, device="cuda", generator=torch.Generator("cuda").manual_seed(a.rank))

    def handle(words: list[str]) -> dict:
        if words[0] == "allreduce":
            for _ in range(int(words[1])):
                x.fill_(float(a.rank + 1))
                dist.all_reduce(x)
            torch.cuda.synchronize()
            want = float(sum(r + 1 for r in range(a.world)))
            return {"ok": bool(torch.all(x == want)), "value": float(x[0]), "expected": want}
        if words[0] == "digest":
            return {"digest": tensor_digest(data), "ptrs": [data.data_ptr(), x.data_ptr()]}
        raise ValueError(f"unknown command {words[0]}")
    serve(handle, {"rank": a.rank, "nccl_cumem": os.environ.get("NCCL_CUMEM_ENABLE")})


if __name__ == "__main__":
    main()
