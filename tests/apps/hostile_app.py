"""Test helper: an application under gpucr's agent that puts itself between its agent and whoever controls it.

It moves its agent's socket aside and listens under the agent's name itself (so every SO_PEERCRED check
passes: the listener is the target process), relays each request to the real agent, and rewrites the answer
to one verb as HOSTILE_MODE says:
  endless     a listing whose pages never end: HOSTILE_COPIES made-up entries a page, `next` HOSTILE_STEP
              entries on (default: the page's length, as an honest agent), `total` HOSTILE_TOTAL when set,
              each page after HOSTILE_DELAY_S seconds
  dup_fd      every entry names fd index 0
  half_line   the answer's fds go with half a line, then the connection is closed
  nondict     the answer is a JSON list, its fds sent with it
  stall       the answer's fds are sent with half a line, and the rest never comes
  late        the whole answer, after HOSTILE_DELAY_S seconds
HOSTILE_VERB names the verb (memory, shared, layout); HOSTILE_HONEST=N relays its first N answers as they are
(e.g. the layouts of a checkpoint and a restore that make the staging a later layout hands out). It allocates two buffers of HOSTILE_MIB MiB each, prints
one JSON line {"ready": true, "pid": PID}, then answers "digest" on stdin with a digest of both buffers.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import socket
import sys
import threading
import time

VERB = os.environ.get("HOSTILE_VERB", "memory")
MODE = os.environ.get("HOSTILE_MODE", "")
MIB = int(os.environ.get("HOSTILE_MIB", "4"))
_honest = [int(os.environ.get("HOSTILE_HONEST", "0"))]   # answers to VERB still relayed as they are
_honest_mu = threading.Lock()


def honest_now() -> bool:
    with _honest_mu:
        _honest[0] -= 1
        return _honest[0] >= 0
cu = ctypes.CDLL("libcuda.so.1")


def check(rc: int, what: str) -> None:
    if rc != 0:
        sys.exit(f"hostile_app: {what} failed: CUDA error {rc}")


def allocate(n: int, nbytes: int) -> list[int]:
    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    ptrs = []
    for k in range(n):
        ptr = ctypes.c_uint64()
        check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        pattern = bytes((k + i) % 251 for i in range(256)) * (nbytes // 256)
        check(cu.cuMemcpyHtoD_v2(ptr, pattern, ctypes.c_size_t(nbytes)), "cuMemcpyHtoD")
        ptrs.append(ptr.value)
    return ptrs


def digest(ptrs: list[int], nbytes: int) -> str:
    h = hashlib.sha256()
    host = ctypes.create_string_buffer(nbytes)
    for p in ptrs:
        check(cu.cuMemcpyDtoH_v2(host, ctypes.c_uint64(p), ctypes.c_size_t(nbytes)), "cuMemcpyDtoH")
        h.update(host.raw)
    return h.hexdigest()


def read_line(sock: socket.socket, buf: bytearray, fds: list[int]) -> bytes | None:
    while b"\n" not in buf:
        chunk, got, _, _ = socket.recv_fds(sock, 1 << 16, 253)
        fds.extend(got)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def endless_page(start: int, real: dict) -> bytes:
    time.sleep(float(os.environ.get("HOSTILE_DELAY_S", "0")))
    copies = int(os.environ.get("HOSTILE_COPIES", "1000"))
    entries = [{"sid": 1, "role": "exporter", "key": 7, "bytes": 1 << 20, "fd_index": -1}] * copies
    page = {"ok": True, "shared": entries, "memory": entries, "next": start + int(os.environ.get("HOSTILE_STEP", copies))}
    page["total"] = int(os.environ["HOSTILE_TOTAL"]) if "HOSTILE_TOTAL" in os.environ else real.get("total")
    return json.dumps(page).encode()


def answer(client: socket.socket, request: bytes, line: bytes, fds: list[int]) -> bool:
    """Send the (rewritten) answer; False: the connection is to end here."""
    if MODE == "endless":
        start = int(dict(w.split(b"=", 1) for w in request.split()[1:]).get(b"from", b"0"))
        client.sendall(endless_page(start, json.loads(line)) + b"\n")
        return True
    reply = json.loads(line)
    if MODE == "dup_fd":
        for e in reply.get(VERB, []):
            e["fd_index"] = 0
        line = json.dumps(reply).encode()
    elif MODE in ("half_line", "stall"):
        socket.send_fds(client, [line[:len(line) // 2]], fds)
        if MODE == "stall":
            time.sleep(3600)
        return False
    elif MODE == "nondict":
        line = json.dumps([reply]).encode()
    elif MODE == "late":
        time.sleep(float(os.environ.get("HOSTILE_DELAY_S", "0")))
    socket.send_fds(client, [line + b"\n"], fds) if fds else client.sendall(line + b"\n")
    return True


def relay(client: socket.socket, real: str) -> None:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.connect(real)
    cbuf, abuf = bytearray(), bytearray()
    with client, agent:
        while True:
            sent: list[int] = []
            request = read_line(client, cbuf, sent)
            if request is None:
                return
            ours = request.split(b" ", 1)[0].decode() == VERB and not honest_now()
            forwarded = request.split(b" ", 1)[0] + b" from=0" if ours and MODE == "endless" else request
            socket.send_fds(agent, [forwarded + b"\n"], sent) if sent else agent.sendall(forwarded + b"\n")
            for fd in sent:
                os.close(fd)
            fds: list[int] = []
            line = read_line(agent, abuf, fds)
            if line is None:
                return
            try:
                if not ours:
                    socket.send_fds(client, [line + b"\n"], fds) if fds else client.sendall(line + b"\n")
                elif not answer(client, request, line, fds):
                    return
            finally:
                for fd in fds:
                    os.close(fd)


def sit_between() -> None:
    """Listen under the agent's socket name, the agent's own socket moved aside."""
    ino = os.stat("/proc/self/ns/pid").st_ino
    path = f"{os.environ['GPUCR_RUNTIME_DIR']}/{os.getpid()}-{ino}.sock"
    while not os.path.exists(path):
        time.sleep(0.01)
    real = path + ".real"
    os.rename(path, real)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    listener.bind(path)
    os.umask(old)
    listener.listen(16)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=relay, args=(conn, real), daemon=True).start()


def main() -> None:
    nbytes = MIB << 20
    ptrs = allocate(2, nbytes)
    threading.Thread(target=sit_between, daemon=True).start()
    time.sleep(0.2)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(json.dumps({"digest": digest(ptrs, nbytes)}), flush=True)


if __name__ == "__main__":
    main()
