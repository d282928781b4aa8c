"""One daemon per arena: the instance lock a daemon takes before it touches any path.

The lock is an exclusive `flock` on `<socket>.lock`, beside the socket. Every path a daemon
derives from its socket (the socket itself, the host arena, the shared index) is touched only
by the holder, so a second `tierd serve` on the same socket — a unit plus a manual start, two
units reading one config — refuses before it can unlink or replace anything of the first. The
disk directory has a lock of its own (`DiskTier`), taken before any file in it is opened.
The lock goes with the process (the kernel drops it on exit, kill -9 included), so a crashed
daemon never blocks its successor. This module must never remove a path it does not hold.
"""

from __future__ import annotations

import errno
import fcntl
import os

from .errors import InstanceLockedError


class InstanceLock:
    """An exclusive lock on `path` (created 0600), holding this process's pid as text."""

    def __init__(self, path: str, what: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            self.fd = -1
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise InstanceLockedError(
                f"another daemon is serving {what} (pid {holder}); stop it first "
                f"(systemctl stop tierd) or give this one another --socket and disk path") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        """Let go (the file stays: unlinking it would let a third daemon lock a new inode while
        a second one still holds the old)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def same_file(fd: int, path: str) -> bool:
    """True when `path` still names the file open as `fd` (not replaced or removed)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
