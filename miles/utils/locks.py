"""One owner per save folder: an OS file lock (fcntl.flock) held for the run's lifetime, released when the process
ends however it ends, so a crashed run never blocks the next one."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)

LOCK_FILE = ".miles.lock"


class FolderLockedError(RuntimeError):
    """Another live process holds the folder; the message names the folder, the flag and the holder's pid."""


class FolderLock:
    """An exclusive, non-blocking flock on `folder/.miles.lock`, which records the holder's pid."""

    def __init__(self, folder: str, flag: str) -> None:
        self.folder, self.flag = os.path.abspath(folder), flag
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderLockedError(
                f"{flag} {self.folder} is in use by another run (pid {holder} holds {self.path}); give this run its "
                "own folder, or wait for that run to end"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a different inode)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class FolderLocks:
    """The locks of one run, taken in order and released together."""

    def __init__(self, folders: Iterable[tuple[str, str]]) -> None:
        self.locks: list[FolderLock] = []
        seen: set[str] = set()
        try:
            for flag, folder in folders:
                if os.path.abspath(folder) not in seen:
                    self.locks.append(FolderLock(folder, flag))
                    seen.add(os.path.abspath(folder))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []
