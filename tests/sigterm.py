"""A process told to stop by SIGTERM, and the processes it started: what the harness tests
check of each holder (the launcher, a program holding a LocalFleet)."""

from __future__ import annotations

import signal
import subprocess

import psutil


def assert_sigterm_stops_all(holder: subprocess.Popen, started: list[psutil.Process], *,
                             within_s: float) -> None:
    """SIGTERM to `holder`: it exits as a SIGTERM'd program does, and `started` after it."""
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(within_s) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def kill_all(holder: subprocess.Popen, started: list[psutil.Process]) -> None:
    """Whatever a failed test left running."""
    if holder.poll() is None:
        holder.kill()
    for process in started:
        if process.is_running():
            process.kill()
