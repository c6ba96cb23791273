"""A raw-memory "server" for the swap benchmark where the LLM servers cannot run (simcuda, the simulated driver, a
test double): one device buffer of --mib MiB, and `generate K` answers K "tokens" that are a function of every byte
of it, read back through the driver's copies, so a byte lost by a park, a resume or a restart changes them.

Its "weights" can be written once to a safetensors file (--save-weights) and a later start loads them from it
(--weights), as a restarted model server loads its checkpoint. The file is safetensors' own layout (an 8-byte
header length, a JSON header, the raw bytes), written here without the package, which simcuda's machines lack.

Commands: generate K | digest | info | quit. `generate` answers its tokens and, on CLOCK_MONOTONIC (which the bench
shares), when its first and its last token were ready (first_at, last_at).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import time
from pathlib import Path
from typing import Callable

from .protocol import serve, sized_parser, weights_arguments

VOCAB = 128256   # llama3's, so the tokens look like the LLM servers'
TENSOR = "weights"


def tokens_of(digest: bytes, k: int) -> list[int]:
    """K tokens, each a function of the digest of the device bytes and its position."""
    return [int.from_bytes(hashlib.shake_256(digest + i.to_bytes(4, "little")).digest(4), "little") % VOCAB
            for i in range(k)]


def write_safetensors(path: Path, data: bytes) -> None:
    """One uint8 tensor named `weights` in safetensors' layout."""
    header = json.dumps({TENSOR: {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)   # the format pads its header to 8 bytes
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(data)
    tmp.replace(path)


def read_safetensors(path: Path) -> bytes:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + n])[TENSOR]["data_offsets"]
    return raw[8 + n + start:8 + n + end]


class TokenServer:
    def __init__(self, nbytes: int, seed: int, weights: Path | None, save: Path | None) -> None:
        from . import driver_app as d
        self.d = d
        self.app = d.App([nbytes], pitch=False, vmm_mib=0, seed=seed)
        self.ptr, self.n = self.app.bufs[0]
        if weights is not None:   # a restart: its bytes come from the file, not from its seed
            data = read_safetensors(weights)
            if len(data) != self.n:
                raise RuntimeError(f"{weights} holds {len(data)} bytes, not the {self.n} of --mib")
            d.check(d.cuMemcpyHtoD(self.ptr, data, self.n), "load weights")
        if save is not None:
            write_safetensors(save, b"".join(self.app._read(self.ptr, self.n)))

    def generate(self, k: int) -> dict:
        h = hashlib.sha256()
        for part in self.app._read(self.ptr, self.n):   # copies: a parked app's first one is its demand
            h.update(part)
        tokens = tokens_of(h.digest(), 1)   # the first token, then the others
        first_at = time.monotonic()
        tokens = tokens_of(h.digest(), k)
        return {"tokens": tokens, "first_at": first_at, "last_at": time.monotonic()}

    def handle(self, words: list[str]) -> dict:
        if words[0] == "generate":
            return self.generate(int(words[1]))
        if words[0] == "digest":
            return self.app.handle(["digest"])
        if words[0] == "info":
            return {"data_bytes": self.n, "framework": "driver-api"}
        raise ValueError(f"unknown command {words[0]}")


def parser() -> argparse.ArgumentParser:
    ap = sized_parser("token_app", "mib", 32.0)
    weights_arguments(ap, "the buffer", "file")
    return ap


def build(a: argparse.Namespace) -> tuple[Callable[[list[str]], dict], dict]:
    s = TokenServer(int(a.mib * (1 << 20)) // 4 * 4, a.seed, a.weights, a.save_weights)
    return s.handle, {"simulated": s.d.SIM, "data_bytes": s.n}


def main() -> None:
    serve(*build(parser().parse_args()))


if __name__ == "__main__":
    main()
