"""A small CUDA program to try gpucr on, with a GPU or without one (on simcuda, a test double):

    gpucr run --simulate -- python3 examples/cuda_counter.py &   # on a GPU, leave out every --simulate
    gpucr checkpoint --simulate $!    # its GPU memory saved and given back; its steps pause
    gpucr restore --simulate $!       # every byte back at the same address; the steps go on

It keeps a buffer on the GPU (32 MiB, or --mib N) and, once a second, adds one to a counter held in
that buffer and checks that the rest of it is unchanged. It prints one line a step until it is
stopped (Ctrl-C, kill), so a checkpoint shows as a pause and a restore as the count going on from
where it stopped. It uses only the CUDA driver API, through ctypes: no CUDA toolkit is needed.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
import zlib

cu = ctypes.CDLL("libcuda.so.1")
u64, sz = ctypes.c_uint64, ctypes.c_size_t


def check(rc: int, what: str) -> None:
    if rc != 0:
        sys.exit(f"cuda_counter: {what} failed with CUDA error {rc}")


def pattern(nbytes: int) -> bytes:
    """The buffer's first contents: a counter of 0 in the first 4 bytes, then bytes counting up."""
    return bytes(4) + (bytes(range(256)) * (nbytes // 256))[4:]


def setup(nbytes: int) -> int:
    """A buffer of nbytes on device 0, in its primary context, filled with the pattern."""
    check(cu.cuInit(0), "cuInit")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), u64()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cu.cuMemAlloc_v2(ctypes.byref(ptr), sz(nbytes)), "cuMemAlloc")
    check(cu.cuMemcpyHtoD_v2(ptr, pattern(nbytes), sz(nbytes)), "cuMemcpyHtoD")
    return ptr.value


def step(ptr: int, nbytes: int, expect_crc: int) -> int:
    """Add one to the counter in the buffer's first 4 bytes; the rest must still be the pattern."""
    host = ctypes.create_string_buffer(nbytes)
    check(cu.cuMemcpyDtoH_v2(host, u64(ptr), sz(nbytes)), "cuMemcpyDtoH")
    if zlib.crc32(host.raw[4:]) != expect_crc:
        sys.exit("cuda_counter: the buffer changed: GPU memory was not restored as it was")
    count = int.from_bytes(host.raw[:4], "little") + 1
    check(cu.cuMemcpyHtoD_v2(u64(ptr), count.to_bytes(4, "little"), sz(4)), "cuMemcpyHtoD")
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description="a small CUDA program that counts on the GPU, to try gpucr on")
    ap.add_argument("--mib", type=int, default=32, help="the buffer kept on the GPU, in MiB (default 32)")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (default: run until stopped)")
    a = ap.parse_args()
    nbytes = a.mib << 20
    ptr = setup(nbytes)
    expect = zlib.crc32(pattern(nbytes)[4:])   # everything after the counter
    print(f"cuda_counter: {a.mib} MiB on the GPU at {ptr:#x}, one step a second", flush=True)
    n = 0
    while a.steps == 0 or n < a.steps:
        count = step(ptr, nbytes, expect)
        n += 1
        print(f"step {n}: counter {count}, buffer intact", flush=True)
        time.sleep(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
