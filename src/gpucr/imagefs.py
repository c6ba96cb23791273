"""The files of a checkpoint image, opened so that no one else's link or file is ever written or read.

An image directory is opened once (O_NOFOLLOW) and every file in it is reached through that directory's
fd: created with O_EXCL | O_NOFOLLOW under a random temporary name, checked with fstat (a regular file,
one link, the expected owner), and renamed into place without replacing anything; a failed write
removes its temporary file. When root acts for another user's process, the I/O runs with that user's
file-system identity (setfsuid / setfsgid, per thread), so root reads and writes only what that user
could. docs/security.md says what each check stops.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import GpucrError

Owner = tuple[int, int]    # (uid, gid) whose file-system identity the image I/O uses
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def owner_for(uid: int, pid: int) -> Owner | None:
    """The identity for the image I/O of process `pid` of `uid`: its own when root acts for another user,
    None (this controller's own) otherwise."""
    if os.geteuid() != 0 or uid == 0:
        return None
    gid = uid
    try:   # the process's file-system gid (the fourth of the Gid line)
        line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("Gid:"))
        gid = int(line.split()[4])
    except (OSError, StopIteration, IndexError, ValueError):
        pass
    return uid, gid


@contextmanager
def fs_identity(owner: Owner | None) -> Iterator[None]:
    """Run this thread's file-system calls as `owner` (setfsuid is per thread: each I/O thread sets its own)."""
    if owner is None:
        yield
        return
    uid, gid = owner
    old_gid = _libc.setfsgid(gid)     # the gid first, while still root
    old_uid = _libc.setfsuid(uid)
    try:
        if _libc.setfsuid(uid) != uid or _libc.setfsgid(gid) != gid:   # each returns the identity now in force
            raise GpucrError(f"cannot take the file-system identity of uid {uid} for the image")
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


def _renameat_noreplace(dir_fd: int, src: str, dst: str) -> None:
    if _libc.renameat2(dir_fd, src.encode(), dir_fd, dst.encode(), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL):   # no renameat2 here: link is no-replace too
            os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            os.unlink(src, dir_fd=dir_fd)
            return
        raise OSError(err, os.strerror(err), dst)


class ImageDir:
    """One image directory, used only through its fd."""

    def __init__(self, path: Path, owner: Owner | None = None, create: bool = False) -> None:
        self.path, self.owner = Path(path), owner
        self.uid = owner[0] if owner else os.geteuid()
        with fs_identity(owner):
            try:
                if create:
                    self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                what = "is a symbolic link: give the directory itself" if exc.errno == errno.ELOOP else exc.strerror
                raise GpucrError(f"cannot use the image directory {self.path}: {what}") from None

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "ImageDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        with fs_identity(self.owner):
            return os.listdir(self.fd)

    def _check(self, fd: int, name: str) -> None:
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"it has {st.st_nlink} links (a hard link to another file?)" if st.st_nlink != 1 else
               f"it belongs to uid {st.st_uid}, not {self.uid}" if st.st_uid != self.uid else None)
        if why:
            os.close(fd)
            raise GpucrError(f"refused: {self.path / name}: {why}")

    def create(self, name: str) -> tuple[int, str]:
        """A new file (mode 0600) for `name`, under a temporary name: (fd, temporary name)."""
        with fs_identity(self.owner):
            for _ in range(8):
                tmp = f".{name}.{secrets.token_hex(6)}.tmp"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=self.fd)
                except FileExistsError:
                    continue
                self._check(fd, tmp)
                return fd, tmp
        raise GpucrError(f"cannot create a file in {self.path}: every temporary name is taken")

    def publish(self, tmp: str, name: str) -> None:
        """Give the finished temporary file its name; never over anything already there."""
        with fs_identity(self.owner):
            try:
                _renameat_noreplace(self.fd, tmp, name)
            except FileExistsError:
                raise GpucrError(f"{self.path / name} appeared while the image was written (someone else writes in "
                                 "that directory); refused") from None

    def discard(self, tmp: str) -> None:
        with fs_identity(self.owner):
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass

    def open_read(self, name: str) -> int:
        """An image file for reading, refused unless it is a regular file of one link and of the expected owner."""
        with fs_identity(self.owner):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise GpucrError(f"refused: {self.path / name} is a symbolic link") from None
                raise
        self._check(fd, name)
        return fd


def try_direct(fd: int) -> bool:
    """Large direct I/O where the filesystem allows it (tmpfs and some others refuse O_DIRECT)."""
    import fcntl
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:
        return False
