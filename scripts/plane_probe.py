"""How fast the one data plane moves memory on this GPU, as the server runs it (staging pinned ahead) and as the
CLI runs it with no server (staging pinned nowhere, copies through the CLI's small pinned ring).

Run on a GPU host: `python3 scripts/plane_probe.py --gib 16 --slots 4,8 > out.json`. In this one process it makes
exportable GPU memory (as the agent does), a sealed memfd staging (touched, as the agent makes it), then times
`Mover.copy_out` and `Mover.fill` of it: 'server' with the staging pinned before the clock starts, 'cli' through
`cli_plane` with the ring of each --slots. The server's times are the link's bound here (straight pinned copies on
four streams: 1.08x the link on the H200, docs/server.md); the issue asks the CLI for 1.6x of it or better.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import statistics
import time

from gpucr.dataplane import mover as mv, ring
from gpucr.dataplane.cli_plane import cli_plane
from gpucr.memory import Managed
from gpucr.driver import driver_for

GiB = 1 << 30


def staging(size: int) -> int:
    """A memfd of `size` bytes, sealed against shrinking and touched, as the agent's staging is."""
    fd = os.memfd_create("gpucr-probe-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    with mmap.mmap(fd, size) as m:
        for k in range(0, size, 1 << 30):
            n = min(1 << 30, size - k)
            m[k:k + n] = b"\0" * n
    return fd


def memory(vmm, dev: int, uuid: str, sizes: list[int]) -> list[Managed]:
    """Exportable memory of `sizes` on GPU dev, each set to its own byte, held by our fd of it only."""
    out = []
    stream = vmm.stream()
    for i, size in enumerate(sizes):
        h = vmm.create(size, dev)
        va = vmm.map(h, size, dev)
        vmm.memset(va, size, stream, 0x40 + i)
        vmm.sync(stream)
        out.append(Managed(i, "converted", size, dev, True, False, [], vmm.export_fd(h), uuid, True, True))
        vmm.unmap(va, size)
        vmm.release(h)
    return out


def layout(sizes: list[int]) -> dict:
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    return {"segments": [{"index": 0, "bytes": sum(sizes)}],
            "allocations": [{"index": i, "bytes": n, "segment": 0, "offset": o} for i, (n, o) in enumerate(zip(sizes, offs))]}


def staged_right(seg_fd: int, sizes: list[int]) -> bool:
    """The first and last byte of each allocation in staging is its own byte."""
    with mmap.mmap(seg_fd, sum(sizes), prot=mmap.PROT_READ) as m:
        k = 0
        for i, n in enumerate(sizes):
            if m[k] != 0x40 + i or m[k + n - 1] != 0x40 + i:
                return False
            k += n
    return True


def cycle(mover, lay: dict, seg_fd: int, mem: list[Managed]) -> dict:
    t0 = time.perf_counter()
    st = mover.copy_out(os.getpid(), lay, [seg_fd], mem)
    out_s = time.perf_counter() - t0
    ring_out = dict(mover.ring.spent) if getattr(mover, "ring", None) else {}
    t0 = time.perf_counter()
    st_in, fds = mover.fill(os.getpid(), lay, [seg_fd], mem)
    in_s = time.perf_counter() - t0
    for _i, fd in fds:
        os.close(fd)
    ring_in = {k: v - ring_out[k] for k, v in mover.ring.spent.items()} if ring_out else {}
    # where the CLI ring's slot threads spent their time (thread-seconds, summed over the slots)
    steps = ("stage_s", "make_s", "queue_s", "drain_s", "scan_s", "export_s", "check_s")
    return {"out_s": out_s, "in_s": in_s, "out_pin_s": st.pin_s, "bytes": st.bytes,
            "out_steps": {k: round(getattr(st, k), 3) for k in steps}, "in_steps": {k: round(getattr(st_in, k), 3) for k in steps},
            "ring_out_s": {k: round(v, 3) for k, v in ring_out.items()}, "ring_in_s": {k: round(v, 3) for k, v in ring_in.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--piece-gib", type=float, default=2)
    ap.add_argument("--slots", default="4,8")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--simulate", action="store_true", help="on simcuda (a smoke test of this script)")
    a = ap.parse_args()
    total, piece = int(a.gib * GiB), int(a.piece_gib * GiB)
    sizes = [piece] * (total // piece) + ([total % piece] if total % piece else [])
    if a.simulate:
        from gpucr.paths import simcuda_dir
        drv = driver_for(str(simcuda_dir() / "libcuda.so.1"))
    else:
        drv = driver_for("libcuda.so.1")
    server = mv.Mover(drv, routes=False)
    uuid, dev = sorted(server.vmm.device_by_uuid().items(), key=lambda kv: kv[1])[0]
    ctx = server.vmm.retain_context(dev)
    server.vmm.use(ctx)
    t0 = time.perf_counter()
    seg_fd = staging(total)
    made_s = time.perf_counter() - t0
    mem = memory(server.vmm, dev, uuid, sizes)
    lay = layout(sizes)
    res: dict = {"gpu": uuid, "bytes": total, "staging_made_s": made_s, "runs": {}}
    first = cycle(server, lay, seg_fd, mem)   # pins the staging: the server pins ahead, before the clock
    res["server_first_pin_s"] = first["out_pin_s"]
    res["runs"]["server"] = [cycle(server, lay, seg_fd, mem) for _ in range(a.cycles)]
    res["staged_right_server"] = staged_right(seg_fd, sizes)
    server.close()
    os.pwrite(seg_fd, b"\0", 0)
    for slots in [int(s) for s in a.slots.split(",")]:
        ring.SLOTS = slots
        runs = []
        for _ in range(a.cycles):
            with cli_plane(drv) as cli:   # a fresh one each time, as each CLI request makes its own
                runs.append(cycle(cli._made(), lay, seg_fd, mem))
        res["runs"][f"cli-{slots}"] = runs
        with cli_plane(drv) as cli:   # the same CLI mover twice: its context and ring made already the second time
            cycle(cli._made(), lay, seg_fd, mem)
            res["runs"][f"cli-{slots}-warm"] = [cycle(cli._made(), lay, seg_fd, mem) for _ in range(a.cycles)]
        res[f"staged_right_cli-{slots}"] = staged_right(seg_fd, sizes)
    for name, runs in res["runs"].items():
        for way in ("out", "in"):
            s = statistics.median(r[f"{way}_s"] for r in runs)
            res.setdefault("median_gbps", {})[f"{name}-{way}"] = round(total / s / 1e9, 1)
    bound = {w: statistics.median(r[f"{w}_s"] for r in res["runs"]["server"]) for w in ("out", "in")}
    res["x_of_server"] = {f"{n}-{w}": round(statistics.median(r[f"{w}_s"] for r in runs) / bound[w], 2)
                          for n, runs in res["runs"].items() for w in ("out", "in")}
    for m in mem:
        os.close(m.fd)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
