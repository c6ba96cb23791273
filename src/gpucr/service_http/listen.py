"""Where the HTTP API listens, and its token: a Unix socket beside the server's own, always; loopback TCP only when
asked (`gpucr serve --http 127.0.0.1:PORT`), with a token in a 0600 file in the server's private runtime dir.

Standard library only: the CLI checks `--http` with it before anything of the extra (aiohttp) is imported."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

LISTEN_BACKLOG = 64


@dataclass(frozen=True)
class Loopback:
    """A loopback address to listen on: an IP literal and a port (0: any free one, said once bound)."""
    host: str
    port: int

    @property
    def family(self) -> int:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def url(self, port: int) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{port}"

    def hosts(self, port: int) -> frozenset[str]:
        """The Host headers a request to this listener may carry: its own address, or localhost, with its port.
        Anything else is a name that resolved here by someone else's doing (DNS rebinding), and is refused."""
        return frozenset({self.url(port).split("//", 1)[1], f"localhost:{port}"})


def parse_loopback(value: str) -> Loopback:
    """`--http`'s HOST:PORT ([::1]:PORT for IPv6, localhost for 127.0.0.1); ValueError with the one line to say."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT; give a loopback address and a port, e.g. 127.0.0.1:8321")
    host = "127.0.0.1" if host == "localhost" else host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{host!r} is not a loopback address: the HTTP API listens on this host only "
                         "(127.0.0.1 or ::1); put a proxy of your own in front of it to reach it from elsewhere")
    return Loopback(host, int(port))


def bind_unix(path: Path) -> tuple[socket.socket, int]:
    """The HTTP API's Unix socket, 0600, and its inode (at the end only that socket is removed). A socket already
    under the name is a dead server's: the server's own socket, bound first, says none other runs here."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        remove_quietly(path)
        s.bind(str(path))
        s.listen(LISTEN_BACKLOG)
    except OSError:
        s.close()
        raise
    finally:
        os.umask(old)
    return s, os.lstat(path).st_ino


def bind_tcp(where: Loopback) -> socket.socket:
    s = socket.socket(where.family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restart does not wait out TIME_WAIT
        s.bind((where.host, where.port))
        s.listen(LISTEN_BACKLOG)
    except OSError:
        s.close()
        raise
    return s


def write_token(path: Path) -> str:
    """A new token, written to a new 0600 file of the server's user (O_EXCL, no link followed); any old one goes."""
    token = secrets.token_urlsafe(32)
    remove_quietly(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return token


def remove_quietly(path: Path, ino: int | None = None) -> None:
    """Remove path (only when it is still inode `ino`, when given)."""
    try:
        if ino is None or os.lstat(path).st_ino == ino:
            path.unlink()
    except FileNotFoundError:
        pass
