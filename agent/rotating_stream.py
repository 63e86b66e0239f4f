"""The agent's own log file, rotated by the agent: where a service manager keeps no journal
(launchd; Linux without journald) nothing else would keep the file from growing forever.

`send_output_to(path)` points standard output and error — Python's and the file descriptors
1 and 2 below them, so a traceback or a C library's message lands there too — at `path`,
and moves `path` to `path.1` (older copies up to `path.N`) once it would pass `max_bytes`.
Rotation renames and reopens, so a service manager that opened the first file for the
process (launchd's StandardErrorPath) keeps only what was written before it was rotated.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from pathlib import Path


class RotatingStream(io.TextIOBase):
    """A text stream to `path` that rotates the file itself; safe across threads."""

    def __init__(self, path: Path, max_bytes: int, backups: int, *,
                 follow_fds: tuple[int, ...] = ()) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.follow_fds = follow_fds  # descriptors re-pointed at the new file on rotation
        self._lock = threading.Lock()
        self._pending = b""  # the start of a line not yet ended: a line never spans two files
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._open()

    def _open(self) -> io.BufferedWriter:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        for target in self.follow_fds:
            os.dup2(fd, target)
        return os.fdopen(fd, "ab", buffering=0)

    def _size(self) -> int:
        return os.fstat(self._file.fileno()).st_size

    def rotate(self) -> None:
        """`path` → `path.1` → … → `path.N` (the oldest dropped); then a new empty `path`."""
        self._file.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            os.truncate(self.path, 0)
        self._file = self._open()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, text: str) -> int:
        with self._lock:
            data = self._pending + text.encode("utf-8", "replace")
            end = data.rfind(b"\n") + 1
            self._pending = data[end:]
            if end:
                self._write(data[:end])
        return len(text)

    def _write(self, data: bytes) -> None:
        size = self._size()
        if size and size + len(data) > self.max_bytes:
            self.rotate()
        self._file.write(data)

    def flush(self) -> None:
        """Write out a line not yet ended (whole lines are written as they come)."""
        with self._lock:
            if self._pending:
                self._write(self._pending)
                self._pending = b""

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._file.close()
        super().close()


def send_output_to(path: Path, max_bytes: int, backups: int) -> RotatingStream:
    """From now on this process writes its standard output and error to `path`, rotated."""
    sys.stdout.flush()
    sys.stderr.flush()
    stream = RotatingStream(path, max_bytes, backups, follow_fds=(1, 2))
    sys.stdout = sys.stderr = stream
    return stream
