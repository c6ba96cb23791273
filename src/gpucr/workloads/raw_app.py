"""A raw buffer of --gib GiB of random bytes and nothing else: the plainest thing to checkpoint. With
--zero-fraction F its first F of whole 2 MiB chunks is zero, as a KV cache never written is (issue 26: those
chunks need not cross the link); on simcuda it stands in for the LLM servers' zeros and served caches.

On a GPU with PyTorch it is one torch tensor (digest computed on the GPU); on simcuda (the
simulated driver, a test double) or without PyTorch it is one cuMemAlloc buffer through
driver_app (digest over a host read-back).

Commands: digest | info | quit
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
from typing import Callable

from . import Place
from .protocol import serve, sized_parser

CHUNK = 2 << 20   # the data plane's zero chunks (gpucr.dataplane.chunks): a zero head of whole ones is skippable


def zero_head(nbytes: int, fraction: float) -> int:
    """Bytes at the buffer's start set to zero for --zero-fraction: `fraction` of it, in whole chunks."""
    return int(nbytes * fraction) // CHUNK * CHUNK


def simulated() -> bool:
    """Whether the libcuda.so.1 this process loads is simcuda (asked without cuInit)."""
    return hasattr(ctypes.CDLL("libcuda.so.1"), "simcudaIsSimulated")


class TorchRaw:
    def __init__(self, nbytes: int, seed: int) -> None:
        import torch
        self.torch = torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        self.buf.random_(generator=g)
        torch.cuda.synchronize()

    def zero(self, n: int) -> None:
        self.buf[:n // 4].zero_()
        self.torch.cuda.synchronize()

    def digest(self) -> dict:
        from .torch_app import tensor_digest
        d = tensor_digest(self.buf)
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()   # the digest's temporaries are not part of the footprint
        return {"digest": d, "ptrs": [self.buf.data_ptr()], "bytes": self.buf.numel() * 4}

    def info(self) -> dict:
        return {"data_bytes": self.buf.numel() * 4, "reserved_bytes": self.torch.cuda.memory_reserved(),
                "framework": "torch"}


class DriverRaw:
    def __init__(self, nbytes: int, seed: int) -> None:
        from .driver_app import App
        self.app = App([nbytes], pitch=False, vmm_mib=0, seed=seed)

    def zero(self, n: int) -> None:
        from .driver_app import check, cuCtxSynchronize, cuMemsetD32
        check(cuMemsetD32(self.app.bufs[0][0], 0, n // 4), "memset")
        check(cuCtxSynchronize(), "sync")

    def digest(self) -> dict:
        return self.app.handle(["digest"])

    def info(self) -> dict:
        return {"data_bytes": sum(n for _, n in self.app.bufs), "reserved_bytes": None, "framework": "driver-api"}


def parser() -> argparse.ArgumentParser:
    ap = sized_parser("raw_app", "gib", 8.0, seed=3)
    ap.add_argument("--zero-fraction", type=float, default=0.0, metavar="F",
                    help="the buffer's first F (0 to 1, in whole 2 MiB chunks) set to zero, never written again")
    return ap


def build(a: argparse.Namespace, place: Place | None = None) -> tuple[Callable[[list[str]], dict], dict]:
    """The app's protocol handler and its ready line. place: where its buffer is allocated (a
    torch_memory_saver region, by tms_app); that needs the torch buffer, whatever the driver."""
    nbytes = int(a.gib * (1 << 30)) // 4 * 4
    sim = simulated()
    if place is not None:
        with place():
            app: TorchRaw | DriverRaw = TorchRaw(nbytes, a.seed)
    elif not sim and importlib.util.find_spec("torch") is not None:
        app = TorchRaw(nbytes, a.seed)
    else:
        app = DriverRaw(nbytes, a.seed)

    if not 0 <= a.zero_fraction <= 1:
        raise ValueError("--zero-fraction is a share of the buffer, from 0 to 1")
    zeros = zero_head(nbytes, a.zero_fraction)
    if zeros:
        app.zero(zeros)

    def handle(words: list[str]) -> dict:
        if words[0] == "digest":
            return app.digest()
        if words[0] == "info":
            return {**app.info(), "zero_bytes": zeros}
        raise ValueError(f"unknown command {words[0]}")
    return handle, {"simulated": sim, **app.info(), "zero_bytes": zeros}


def main() -> None:
    serve(*build(parser().parse_args()))


if __name__ == "__main__":
    main()
