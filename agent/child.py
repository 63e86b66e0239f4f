"""The one child-process wrapper: spawn (or adopt) a process group, tail its log, stop it
SIGTERM → SIGKILL with named grace periods, and explain its exit in a structured record.

A child writes stdout and stderr straight into its own log file (not a pipe), so it keeps
running, and keeps logging, when the agent restarts; the agent tails the file for the child's
JSON events and rotates it by copy-and-truncate (the child's descriptor is O_APPEND, so it
carries on at the new end). Exit is seen by polling: `waitpid` for our own children, the pid's
start time for adopted ones (whose exit code comes from their last `exiting` log line).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import structlog

from agent.oom_kills import oom_counter_path, read_oom_kills

log = structlog.get_logger()

EXIT_EVENT = "exiting"  # a child's last JSON log line: {"event": "exiting", "code": N, "reason": …}
POLL_INTERVAL_S = 0.1
LAST_LINES = 20


class SpawnError(RuntimeError):
    """The child could not be started at all (no such program, no permission, bad cwd)."""


@dataclass(frozen=True)
class GracePeriods:
    """How long each step of a stop waits before the next, harder one."""

    term_s: float = 10.0  # after SIGTERM to the process group
    kill_s: float = 5.0  # after SIGKILL, to see the process gone


@dataclass(frozen=True)
class ChildExit:
    """Why a child is gone, for the log, the API and the supervisor."""

    code: int | None  # exit status; None when unknown (an adopted child that left no word)
    signal: str | None  # the signal that ended it, if one did
    reason: str  # one sentence a person can act on
    stopped_by: str  # "itself", "SIGTERM" or "SIGKILL": how far the stop had to go
    last_lines: tuple[str, ...]
    at: float  # unix time it was seen gone

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["last_lines"] = list(self.last_lines)
        return out


def explain_exit(returncode: int | None, stopped_by: str, child_word: dict | None,
                 grace: GracePeriods | None, last_line: str = "",
                 oom_kills: int | None = None,
                 frozen: bool = False) -> tuple[int | None, str | None, str]:
    """(code, signal name, reason) from what is known about a child's end, and nothing
    more. Pure. `oom_kills`: how far its cgroup's OOM-kill count rose while it ran (None:
    unknown)."""
    said = (child_word or {}).get("reason")
    word_code = (child_word or {}).get("code")
    if returncode is None:  # adopted: not our child, so no exit status but its own word
        if said:
            return word_code, None, said
        if stopped_by != "itself":
            return word_code, None, (f"gone after the agent's {stopped_by} (an adopted "
                                     "process that left no exit reason)")
        return word_code, None, "an adopted process exited and left no exit reason"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        from_agent = stopped_by == name
        if said and word_code == 0:
            # It had logged its clean exit (a drain done) and the signal ended its teardown:
            # its work was over, so its own word is the truth about how it ended.
            return 0, None, said if from_agent else (
                f"{said}; then {name} from outside the agent ended its teardown")
        if name == "SIGKILL" and from_agent and frozen:
            return None, name, ("killed with SIGKILL: it was stopped (SIGSTOP) and could not "
                                "act on SIGTERM")
        if name == "SIGKILL" and from_agent:
            waited = f" within {grace.term_s:g} s" if grace else ""
            return None, name, f"killed with SIGKILL: it did not exit{waited} after SIGTERM"
        if name == "SIGTERM" and from_agent:
            return None, name, "ended by the agent's SIGTERM"
        if name == "SIGKILL" and oom_kills:
            return None, name, (f"killed by SIGKILL: the kernel's out-of-memory killer (its "
                                f"cgroup counted {oom_kills} OOM kill(s) while it ran)")
        return None, name, f"killed by {name} from outside the agent"
    if said:
        return returncode, None, said
    if returncode == 0:
        return 0, None, "exited normally" if stopped_by != "itself" else "exited by itself"
    if last_line:
        return returncode, None, f"exited with code {returncode}: {last_line[:300]}"
    return returncode, None, f"exited with code {returncode} (see its last log lines)"


class RotatingLog:
    """A child's stdout + stderr file, rotated by copy-and-truncate into `path.1` … `path.N`."""

    def __init__(self, path: Path, max_bytes: int = 16 << 20, backups: int = 3) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups

    def open_for_child(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def rotate(self) -> Path | None:
        """Copy the file to `path.1` (older copies move up) and truncate it; returns the copy."""
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        copy = None
        if self.backups > 0:
            copy = self.path.with_name(f"{self.path.name}.1")
            shutil.copyfile(self.path, copy)
        os.truncate(self.path, 0)
        return copy


class LogTail:
    """The lines appended to a file since the last read; copes with truncation (rotation)."""

    def __init__(self, path: Path, *, from_start: bool = True) -> None:
        self.path = Path(path)
        self.offset = 0 if from_start else self._size()
        self.partial = b""

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def after_rotation(self, rotated: Path) -> list[str]:
        """Lines that reached the file between the last read and its copy into `rotated`;
        then follow the truncated file from its start."""
        path, self.path = self.path, rotated
        try:
            lines = self.read_lines()
        finally:
            self.path = path
        if self.partial:
            lines.append(self.partial.decode("utf-8", "replace"))
        self.offset, self.partial = 0, b""
        return lines

    def read_lines(self, max_bytes: int = 1 << 20) -> list[str]:
        size = self._size()
        if size < self.offset:  # truncated by rotation: start again at the top
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(min(max_bytes, size - self.offset))
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if len(self.partial) > max_bytes:  # a runaway line without a newline: let it go
            lines.append(self.partial)
            self.partial = b""
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]


def parse_event(line: str) -> dict | None:
    """A child's JSON log line as a dict, or None for anything else."""
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ChildProcess:
    """A child process group the agent owns: its log, its events, its stop and its exit."""

    def __init__(self, name: str, pid: int, create_time: float, log_file: RotatingLog, *,
                 popen: subprocess.Popen | None = None, from_start: bool = True,
                 on_line: Callable[[str, dict | None], None] | None = None,
                 on_exit: Callable[[ChildExit], None] | None = None, **log_keys: Any) -> None:
        self.name = name
        self.pid = pid
        self.pgid = pid  # spawned with start_new_session: the leader's pid is the group id
        self.create_time = create_time
        self.log_file = log_file
        self.popen = popen
        self.adopted = popen is None
        self.tail = LogTail(log_file.path, from_start=from_start)
        self.on_line = on_line
        self.on_exit = on_exit
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.child_word: dict | None = None  # its `exiting` event, if it said one
        self.stopped_by = "itself"
        self.grace: GracePeriods | None = None
        self.killed_frozen = False  # the stop found it stopped (SIGSTOP) and killed it at once
        self.exit: ChildExit | None = None
        self.log = log.bind(child=name, pid=pid, **log_keys)
        # The cgroup's OOM-kill count now, to compare at exit (None where it cannot be read).
        self.oom_counter = oom_counter_path(pid)
        self.oom_kills_at_start = read_oom_kills(self.oom_counter)
        self._exited = asyncio.Event()
        self._monitor: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    # --- start ---------------------------------------------------------------------------

    @classmethod
    def spawn(cls, name: str, argv: Sequence[str], env: Mapping[str, str], log_file: RotatingLog,
              *, cwd: Path | None = None, **kwargs: Any) -> ChildProcess:
        """Start `argv` in a new session (its own process group), output into `log_file`."""
        fd = log_file.open_for_child()
        try:
            popen = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=fd, stderr=fd, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise SpawnError(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        child = cls(name, popen.pid, create_time, log_file, popen=popen, **kwargs)
        child.log.info("child started", argv=list(argv), log_path=str(log_file.path))
        return child

    @classmethod
    def adopt(cls, name: str, pid: int, create_time: float, log_file: RotatingLog,
              **kwargs: Any) -> ChildProcess | None:
        """Take over a child an earlier agent started; None if that process is gone."""
        if not same_process_alive(pid, create_time):
            return None
        child = cls(name, pid, create_time, log_file, from_start=True, **kwargs)
        child.log.info("child adopted")
        return child

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    # --- watch ---------------------------------------------------------------------------

    def _returncode(self) -> tuple[bool, int | None]:
        if self.popen is not None:
            code = self.popen.poll()
            return code is not None, code
        return not same_process_alive(self.pid, self.create_time), None

    def _read_log(self) -> None:
        lines = self.tail.read_lines()
        if self.log_file.size() > self.log_file.max_bytes:
            copy = self.log_file.rotate()
            if copy is not None:
                lines += self.tail.after_rotation(copy)
            else:
                self.tail.offset, self.tail.partial = 0, b""
        for line in lines:
            self.last_lines.append(line)
            event = parse_event(line)
            if event and event.get("event") == EXIT_EVENT:
                self.child_word = event
            if self.on_line:
                try:
                    self.on_line(line, event)
                except Exception:  # a bad callback must not stop the watch
                    self.log.exception("on_line callback failed")

    async def _watch(self) -> None:
        while True:
            self._read_log()
            gone, code = self._returncode()
            if gone:
                await asyncio.sleep(POLL_INTERVAL_S)  # let the last lines reach the file
                self._read_log()
                self._finish(code)
                return
            await asyncio.sleep(POLL_INTERVAL_S)

    def _finish(self, returncode: int | None) -> None:
        self._kill_stragglers()
        last = self.last_lines[-1] if self.last_lines else ""
        now_kills = read_oom_kills(self.oom_counter)
        oom_kills = (None if now_kills is None or self.oom_kills_at_start is None
                     else now_kills - self.oom_kills_at_start)
        code, sig, reason = explain_exit(returncode, self.stopped_by, self.child_word, self.grace,
                                         last, oom_kills, frozen=self.killed_frozen)
        self.exit = ChildExit(code, sig, reason, self.stopped_by, tuple(self.last_lines),
                              time.time())
        self.log.info("child exited", code=code, signal=sig, reason=reason,
                      stopped_by=self.stopped_by)
        self._exited.set()
        if self.on_exit:
            self.on_exit(self.exit)

    def _kill_stragglers(self) -> None:
        """Whatever else the child left in its process group goes with it: no orphans."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
            self.log.debug("SIGKILL sent to what is left of the process group", pgid=self.pgid)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def running(self) -> bool:
        return self.exit is None

    async def wait(self, timeout_s: float | None = None) -> ChildExit | None:
        self.start_monitor()
        try:
            await asyncio.wait_for(self._exited.wait(), timeout_s)
        except TimeoutError:
            return None
        return self.exit

    # --- stop ----------------------------------------------------------------------------

    def signal_group(self, sig: signal.Signals) -> bool:
        """Send `sig` to the whole process group; False if it is already gone."""
        if self.exit is not None or (self.adopted and not same_process_alive(
                self.pid, self.create_time)):
            return False
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        self.log.info("signal sent", signal=sig.name)
        return True

    async def stop(self, grace: GracePeriods, *,
                   termed_already: bool = False) -> ChildExit | None:
        """SIGTERM, then SIGKILL, each after its grace period. (An engine's polite ask is the
        SIGTERM itself: it drains on it.)

        `termed_already`: an earlier agent sent the SIGTERM; only wait, then SIGKILL (a second
        SIGTERM means "stop now" to an engine). Several callers share one stop; returns the
        exit, or None if even SIGKILL did not end the process within `grace.kill_s`.
        """
        self.start_monitor()
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(
                self._stop(grace, termed_already))
        return await asyncio.shield(self._stop_task)

    async def _stop(self, grace: GracePeriods, termed_already: bool) -> ChildExit | None:
        self.grace = grace
        if self.exit is not None:
            return self.exit
        self.stopped_by = "SIGTERM"
        if not termed_already:
            self.signal_group(signal.SIGTERM)
        # A stopped process (SIGSTOP: the frozen engine the supervisor failed) cannot act on
        # the SIGTERM until something continues it: waiting out the grace would only hold its
        # memory while its replacement may be loading beside it.
        frozen = self.killed_frozen = is_stopped(self.pid, self.create_time)
        if not frozen and await self.wait(grace.term_s):
            return self.exit
        self.stopped_by = "SIGKILL"
        if frozen:
            self.log.warning("stopped (SIGSTOP): it cannot act on SIGTERM; sending SIGKILL")
        else:
            self.log.warning("did not exit after SIGTERM; sending SIGKILL",
                             waited_s=grace.term_s)
        self.signal_group(signal.SIGKILL)
        if await self.wait(grace.kill_s):
            return self.exit
        self.log.error("still running after SIGKILL", waited_s=grace.kill_s)
        return None

    async def close(self) -> None:
        """Stop watching (the process itself is left alone)."""
        task = self._monitor
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


def _status(pid: int, create_time: float) -> str | None:
    """`pid`'s psutil status while it is still the process that started at `create_time`;
    None once it is gone, or its pid was reused by another process."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > 1.0:
            return None
        return proc.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def resident_bytes(pid: int, create_time: float) -> int | None:
    """`pid`'s resident set while it is still the process that started at `create_time`
    (psutil: Linux and macOS alike); None once it is gone or cannot be read."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > 1.0:
            return None
        return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def is_stopped(pid: int, create_time: float) -> bool:
    """Is `pid`, still the process that started at `create_time`, stopped (SIGSTOP, a
    debugger's stop), so that no signal but SIGKILL acts on it?"""
    return _status(pid, create_time) in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def same_process_alive(pid: int, create_time: float) -> bool:
    """Is `pid` still the process that started at `create_time` (and not a zombie)?"""
    return _status(pid, create_time) not in (None, psutil.STATUS_ZOMBIE)
