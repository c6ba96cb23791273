"""A JAX application holding --gib GiB of random data (XLA's own allocator; set
XLA_PYTHON_CLIENT_MEM_FRACTION to bound its preallocation). Commands: digest | info | compute | work |
grow BYTES | drop | meminfo | quit (grow, drop and meminfo: the swap service's room on demand, issue 27;
tests/gpu/test_gpu_swap.py). XLA's allocator never gives its pool back, so there is no `release`."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from .protocol import serve, sized_parser

PER = 1 << 27   # elements of int32 per array (512 MiB)


def main() -> None:
    a = sized_parser("jax_app", "gib", 1.0).parse_args()
    key = jax.random.PRNGKey(a.seed)
    n = int(a.gib * (1 << 30)) // 4
    per = PER
    data = []
    while n > 0:
        key, sub = jax.random.split(key)
        data.append(jax.random.randint(sub, (min(per, n),), -2**31, 2**31 - 1, dtype=jnp.int32))
        n -= per
    w = jax.random.normal(key, (1024, 1024), dtype=jnp.float32)
    weights = [jnp.arange(d.size, dtype=jnp.uint32) * jnp.uint32(2654435761) for d in data]
    grown: list = []   # arrays added by `grow`, in pieces of PER elements

    def memory() -> dict:
        """What XLA's allocator holds (its pool) and uses on device 0, as its memory_stats says."""
        stats = jax.devices()[0].memory_stats() or {}
        return {"stats": {k: int(v) for k, v in stats.items()}, "reserved_bytes": stats.get("pool_bytes"),
                "allocated_bytes": stats.get("bytes_in_use")}

    def grow(nbytes: int) -> dict:
        """nbytes more of random data, in pieces of 512 MiB (XLA's allocator grows its pool as they come)."""
        nonlocal key
        n = nbytes // 4
        while n > 0:
            key, sub = jax.random.split(key)
            piece = jax.random.randint(sub, (min(PER, n),), -2**31, 2**31 - 1, dtype=jnp.int32)
            grown.append(jax.block_until_ready(piece))
            n -= PER
        return {"grown_bytes": sum(p.size * 4 for p in grown), **memory()}

    @jax.jit
    def checksum(x, wt):
        u = x.astype(jnp.uint32)
        return jnp.sum(u), jnp.sum(u * (wt | 1))

    @jax.jit
    def checksum_in_place(x):
        """checksum's sums with the weights made inside (fused by XLA): no array of x's size beside it."""
        u = x.astype(jnp.uint32)
        return jnp.sum(u), jnp.sum(u * ((jnp.arange(x.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | 1))

    def handle(words: list[str]) -> dict:
        nonlocal data
        if words[0] == "digest":
            sums = [checksum(d, wt) for d, wt in zip(data, weights)] + [checksum_in_place(g) for g in grown]
            return {"digest": [[int(v) for v in s] for s in sums],
                    "ptrs": [d.unsafe_buffer_pointer() for d in data + grown]}
        if words[0] == "grow":
            return grow(int(words[1]))
        if words[0] == "drop":   # the grown arrays go back to XLA's pool, which keeps them
            grown.clear()
            return memory()
        if words[0] == "meminfo":
            return memory()
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
