"""A JAX application holding --gib GiB of random data (XLA's own allocator; set
XLA_PYTHON_CLIENT_MEM_FRACTION to bound its preallocation). Commands: digest | info | compute | work | quit."""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from .protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    key = jax.random.PRNGKey(a.seed)
    n = int(a.gib * (1 << 30)) // 4
    per = 1 << 27
    data = []
    while n > 0:
        key, sub = jax.random.split(key)
        data.append(jax.random.randint(sub, (min(per, n),), -2**31, 2**31 - 1, dtype=jnp.int32))
        n -= per
    w = jax.random.normal(key, (1024, 1024), dtype=jnp.float32)
    weights = [jnp.arange(d.size, dtype=jnp.uint32) * jnp.uint32(2654435761) for d in data]

    @jax.jit
    def checksum(x, wt):
        u = x.astype(jnp.uint32)
        return jnp.sum(u), jnp.sum(u * (wt | 1))

    def handle(words: list[str]) -> dict:
        nonlocal data
        if words[0] == "digest":
            return {"digest": [[int(v) for v in checksum(d, wt)] for d, wt in zip(data, weights)],
                    "ptrs": [d.unsafe_buffer_pointer() for d in data]}
        if words[0] == "info":
            return {"data_bytes": sum(d.size * d.dtype.itemsize for d in data), "reserved_bytes": None,
                    "framework": "jax"}
        if words[0] == "compute":
            y = (w @ w).sum(axis=0)
            return {"checksum": float(y.astype(jnp.float64).sum() if jax.config.jax_enable_x64 else y.sum())}
        if words[0] == "work":
            data = [d + 1 - 1 for d in data]   # new buffers from the allocator, same values
            jax.block_until_ready(data)
            return {"done": True}
        raise ValueError(f"unknown command {words[0]}")
    serve(handle, {"framework": "jax", "jax": jax.__version__, "devices": str(jax.devices())})


if __name__ == "__main__":
    main()
