"""The state directory's lock, held by a real process: a second holder is refused with the
first one's pid, and a holder killed with SIGKILL leaves no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.state_lock import StateDirLock, StateDirLocked
from tests.waiting import wait_until

HOLD = ("import sys, time\nfrom pathlib import Path\n"
        "from supervisor.state_lock import StateDirLock\n"
        "StateDirLock(Path(sys.argv[1])).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")


def test_a_second_holder_is_refused_until_the_first_dies(tmp_path: Path):
    repo = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=repo,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirLocked, match=f"in use by another supervisor "
                                                 rf"\(pid {holder.pid}\)") as refused:
            StateDirLock(tmp_path).acquire()
        assert refused.value.holder_pid == holder.pid
        assert (tmp_path / "supervisor.lock").read_text().strip() == str(holder.pid)
        os.kill(holder.pid, signal.SIGKILL)  # no cleanup of its own: the kernel lets go
        holder.wait(10)

        def taken() -> StateDirLock | None:
            try:
                return StateDirLock(tmp_path).acquire()
            except StateDirLocked:
                return None

        lock = wait_until(taken, within_s=10, what="the lock free after SIGKILL")
        assert (tmp_path / "supervisor.lock").read_text().strip() == str(os.getpid())
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_no_state_directory_is_its_own_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        StateDirLock(tmp_path / "absent").acquire()
