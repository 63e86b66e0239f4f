"""One supervisor per state directory: an exclusive lock held for the process's life.

Two supervisors on one SQLite file each believe they own the fleet: the second marks every
node dead (it has heard no heartbeat yet), places a new generation, and the first one's
engines are left running beside it. `flock` on a file in the state directory is released by
the kernel when the holder exits however it exits (SIGKILL included), so a crashed
supervisor never leaves a stale lock; the file also names the holder's pid for the refusal.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "supervisor.lock"


class StateDirLocked(RuntimeError):
    """Another supervisor runs on this state directory; the message names its pid."""

    def __init__(self, state_dir: Path, holder_pid: int | None) -> None:
        who = f"pid {holder_pid}" if holder_pid else "a process that left no pid"
        super().__init__(f"state directory {state_dir} is in use by another supervisor "
                         f"({who}); stop it first, or give this one another --state-dir")
        self.state_dir, self.holder_pid = state_dir, holder_pid


class StateDirLock:
    """`acquire()` or raise StateDirLocked (FileNotFoundError: no such directory, so
    `fleetctl init` has not made it); the lock lives until `release()` or exit."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> StateDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise StateDirLocked(self.state_dir, holder) from None
        # Written only once the lock is ours: a refused process never touches the pid.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None
