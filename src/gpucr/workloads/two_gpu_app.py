"""One process driving two GPUs: a Llama-3-8B-shaped model's first half of the layers (and the
embedding) on GPU 0, the second half (and the LM head) on GPU 1; each step's activations cross with
a peer copy (.to("cuda:1")) and the token comes back the same way. Each GPU holds a KV cache for its
layers up to --gpu-util of the card.

    python3 -m gpucr.workloads.two_gpu_app [--gpu-util 0.5]

Commands: generate N | digest | info | serve-speed N | quit
"""
from __future__ import annotations

import argparse

from . import parallel, protocol


def main() -> None:
    ap = parallel.arguments(__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: both halves on the CPU "
                    "(checks the code path only)")
    a: argparse.Namespace = ap.parse_args()
    out = protocol.claim_stdout()
    import torch

    from .llama import Stage, shape_of
    if a.device == "cuda":
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"two_gpu_app needs two GPUs; {torch.cuda.device_count()} visible")
        devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    else:
        devices = [torch.device("cpu")] * 2
    before = parallel.used_before(list(dict.fromkeys(devices)))
    shape = shape_of(a.model, a.layers)
    halves = parallel.layer_split(shape.layers, 2)
    stages = [Stage(shape, halves[0], devices[0], seed=a.seed * 1000, embeds=True, heads=False),
              Stage(shape, halves[1], devices[1], seed=a.seed * 1000 + 1, embeds=False, heads=True)]

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = stages[0].run_layers(stages[0].embed(ids), pos)
        x = stages[1].run_layers(x.to(devices[1]), pos.to(devices[1]))   # peer copies over NVLink
        return stages[1].next_token(x).to(devices[0])

    server = parallel.build_server(step, stages, shape, a.gpu_util, before,
                                   {"mode": "2gpu", "layers": [[h.start, h.stop] for h in halves],
                                    "peer_access": a.device == "cuda" and torch.cuda.can_device_access_peer(0, 1)})
    protocol.serve(server.handle, server.info(), out)


if __name__ == "__main__":
    main()
