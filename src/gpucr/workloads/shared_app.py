"""A pair of processes on one GPU sharing --gib GiB of GPU memory, the way NCCL's ranks share theirs:
rank 0 makes it (cuMemCreate with a POSIX fd handle type), fills it and exports it as a file
descriptor, which it passes to rank 1 over a Unix socket (SCM_RIGHTS) and then closes; rank 1
imports it (cuMemImportFromShareableHandle) and maps it. Each rank is its own process with its own
pipe, started as a job of launch "ranks" (--rank R --world 2 --port P; the port names the socket).

Driver API through driver_app's bindings, so it runs on simcuda (the simulated driver, a test double)
and on a GPU alike. Commands: digest | info | quit
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Callable

from .driver_app import App
from .protocol import serve

CONNECT_TIMEOUT_S = 600.0   # rank 0 may still be filling many GiB when rank 1 asks for the fd


def socket_name(port: int) -> str:
    """The abstract Unix socket the pair meets on (no file to clean up), named by the job's port."""
    return f"\0gpucr-shared-app-{port}"


def send_fd(port: int, fd: int) -> None:
    """Rank 0: wait for rank 1 and hand it the exported fd."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(socket_name(port))
        srv.listen(1)
        srv.settimeout(CONNECT_TIMEOUT_S)
        conn, _ = srv.accept()
        with conn:
            socket.send_fds(conn, [b"fd"], [fd])
            conn.recv(1)   # rank 1 has imported it: the fd may go


def receive_fd(port: int) -> tuple[int, socket.socket]:
    """Rank 1: the exported fd from rank 0 (asked until rank 0 listens) and the connection, to say when
    the import is done."""
    end = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(socket_name(port))
            break
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            if time.monotonic() > end:
                raise RuntimeError(f"rank 0 of the shared pair did not listen within {CONNECT_TIMEOUT_S:.0f} s") from None
            time.sleep(0.05)
    _, fds, _, _ = socket.recv_fds(conn, 16, 1)
    if len(fds) != 1:
        conn.close()
        raise RuntimeError(f"rank 0 of the shared pair sent {len(fds)} file descriptors, not 1")
    return fds[0], conn


def build(a: argparse.Namespace) -> tuple[Callable[[list[str]], dict], dict]:
    if a.world != 2 or a.rank not in (0, 1):
        raise SystemExit("the shared pair is two processes: --world 2 and --rank 0 (exporter) or 1 (importer)")
    n = int(a.gib * (1 << 30)) // (2 << 20) * (2 << 20)   # whole 2 MiB granules, as cuMemCreate takes them
    if n <= 0:
        raise SystemExit("--gib: at least 2 MiB (0.002)")
    app = App([], pitch=False, vmm_mib=0, seed=a.seed)
    if a.rank == 0:
        va, fd = app.share(n, a.seed)
        send_fd(a.port, fd)
        os.close(fd)   # as NCCL does once the peer has its own
    else:
        fd, conn = receive_fd(a.port)
        with conn:
            try:
                va = app.import_fd(fd, n)
            finally:
                os.close(fd)
            conn.send(b"k")
    role = "exporter" if a.rank == 0 else "importer"

    def info() -> dict:
        return {"data_bytes": n if a.rank == 0 else 0, "shared_bytes": n, "role": role, "reserved_bytes": None,
                "framework": "driver-api"}

    def handle(words: list[str]) -> dict:
        if words[0] == "digest":
            return {"digest": app.digest(), "ptrs": [va], "bytes": n}
        if words[0] == "info":
            return info()
        raise ValueError(f"unknown command {words[0]}")
    return handle, {"rank": a.rank, **info()}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m gpucr.workloads.shared_app")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of GPU memory the pair shares")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--rank", type=int, required=True, help="0: makes and exports the memory; 1: imports it")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True, help="names the socket the pair meets on")
    return ap


def main() -> None:
    serve(*build(parser().parse_args()))


if __name__ == "__main__":
    main()
