"""Tensor parallel: a Llama-3-8B-shaped model sharded over the ranks of a torch.distributed job,
one GPU per rank (NCCL; run it with NCCL_CUMEM_ENABLE=1 under gpucr). Attention heads, MLP columns
and the vocabulary are split across ranks; an all-reduce follows each row-parallel product (two per
layer, one for the embedding) and the logits are all-gathered, so every rank picks the same token.

    torchrun --nproc-per-node 2 -m gpucr.workloads.tp_app [--gpu-util 0.5] [--graphs]
    python3 -m gpucr.workloads.tp_app --rank R --world 2 --port P       (one process per rank)

Under torchrun rank 0 answers for every rank (ranks.py). Commands: generate N | digest | info |
serve-speed N | graph start | graph stop (--graphs: decode steps replay a CUDA graph that holds the
step's NCCL all-reduces) | quit
"""
from __future__ import annotations

from . import parallel, protocol, ranks


def main() -> None:
    ap = parallel.arguments(__doc__.splitlines()[0])
    ranks.add_arguments(ap)
    ap.add_argument("--graphs", action="store_true", help="capture the decode step, collectives included, in a "
                    "CUDA graph and replay it")
    a = ap.parse_args()
    out = protocol.claim_stdout()
    import torch
    import torch.distributed as dist

    from .llama import Stage, nccl_tp, shape_of
    if a.graphs and a.device != "cuda":
        raise SystemExit("--graphs needs --device cuda")
    device = torch.device("cuda", ranks.local_rank_hint(a)) if a.device == "cuda" else torch.device("cpu")
    before = parallel.used_before([device])
    r = ranks.join(a)
    shape = shape_of(a.model, a.layers)
    stage = Stage(shape, range(shape.layers), r.device, seed=a.seed * 1000 + r.rank, tp=nccl_tp(r.rank, r.world))

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return stage.next_token(stage.run_layers(stage.embed(ids), pos))

    def agree(flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=r.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    server = parallel.build_server(step, [stage], shape, a.gpu_util, {r.device: before[device]},
                                   {"mode": "tp", "rank": r.rank, "world": r.world, "layers": [0, shape.layers]},
                                   agree=agree, graphs=a.graphs)
    ranks.serve(r, server.handle, server.info(), out)
    ranks.leave()


if __name__ == "__main__":
    main()
