"""Pipeline parallel: a Llama-3-8B-shaped model's layers split across the ranks of a
torch.distributed job, one GPU per rank; the first rank also embeds, the last also holds the final
norm and LM head. Each step's activations go rank to rank with dist.send/recv (NCCL), and the last
rank broadcasts the chosen token, so every rank holds the same tokens.

    torchrun --nproc-per-node 2 -m gpucr.workloads.pp_app [--gpu-util 0.5]
    python3 -m gpucr.workloads.pp_app --rank R --world 2 --port P       (one process per rank)

Commands: generate N | digest | info | serve-speed N | quit (under torchrun rank 0 answers for all).
"""
from __future__ import annotations

from . import parallel, protocol, ranks


def main() -> None:
    ap = parallel.arguments(__doc__.splitlines()[0])
    ranks.add_arguments(ap)
    a = ap.parse_args()
    out = protocol.claim_stdout()
    import torch
    import torch.distributed as dist

    from .llama import Stage, shape_of
    device = torch.device("cuda", ranks.local_rank_hint(a)) if a.device == "cuda" else torch.device("cpu")
    before = parallel.used_before([device])
    r = ranks.join(a)
    shape = shape_of(a.model, a.layers)
    mine = parallel.layer_split(shape.layers, r.world)[r.rank]
    first, last = r.rank == 0, r.rank == r.world - 1
    stage = Stage(shape, mine, r.device, seed=a.seed * 1000 + r.rank, embeds=first, heads=last)

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if first:
            x = stage.embed(ids)
        else:
            x = torch.empty((ids.shape[0], shape.hidden), dtype=torch.bfloat16, device=r.device)
            dist.recv(x, r.rank - 1)
        x = stage.run_layers(x, pos)
        tok = torch.empty(1, dtype=torch.int64, device=r.device)
        if last:
            tok = stage.next_token(x)
        else:
            dist.send(x.contiguous(), r.rank + 1)
        dist.broadcast(tok, src=r.world - 1)
        return tok

    server = parallel.build_server(step, [stage], shape, a.gpu_util, {r.device: before[device]},
                                   {"mode": "pp", "rank": r.rank, "world": r.world, "layers": [mine.start, mine.stop]})
    ranks.serve(r, server.handle, server.info(), out)
    ranks.leave()


if __name__ == "__main__":
    main()
