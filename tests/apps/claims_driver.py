"""Test helper: a process that claims to run under gpucr's agent on the system's CUDA driver, without any
driver: it listens on its own agent socket (so the listener checks pass), says hello as an agent on the real
driver with CUDA loaded, refuses every other request, and prints the pid of each process that connects
(one line each), so a test can count the controllers that asked it."""
from __future__ import annotations

import json
import os
import socket
import sys

from gpucr import paths
from gpucr.agent import PROTOCOL
from gpucr.target import agent_socket_name

HELLO = {"ok": True, "agent": "gpucr", "protocol": PROTOCOL, "pid": os.getpid(), "cuda": True,
         "simulated": False, "group": ""}


def answer(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as f:
        for line in f:
            verb = line.split()[0].decode() if line.split() else ""
            reply = HELLO if verb == "hello" else {"ok": False, "error": f"'{verb}' is not answered here"}
            f.write(json.dumps(reply).encode() + b"\n")
            f.flush()


def main() -> None:
    path = paths.agent_dirs(os.getuid())[0] / agent_socket_name(os.getpid())
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(16)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    while True:
        conn, _ = srv.accept()
        peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        print(int.from_bytes(peer[:4], sys.byteorder), flush=True)
        answer(conn)


if __name__ == "__main__":
    main()
