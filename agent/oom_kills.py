"""The kernel's count of out-of-memory kills in a process's memory cgroup, where one can be read.

A child ended by SIGKILL that the agent did not send was killed by someone; the OOM killer is
one candidate among several (an operator's `kill -9`, another supervisor). The cgroup's own
counter says which: cgroup v2 `memory.events` and v1 `memory.oom_control` both carry an
`oom_kill N` line. Read once at start and once at exit (two small files), so the exit record
names the OOM killer only when the count rose while the child ran. Where there is no such
file (macOS, no memory controller, a cgroup namespace that hides it) nothing is claimed.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def oom_counter_path(pid: int, proc: Path = Path("/proc"),
                     root: Path = CGROUP_ROOT) -> Path | None:
    """The file holding `pid`'s cgroup `oom_kill` count, or None where none can be read."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            candidates += [root / rel / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            candidates += [root / "memory" / rel / "memory.oom_control",
                           root / "memory" / "memory.oom_control"]  # namespaced: root is ours
    return next((c for c in candidates if read_oom_kills(c) is not None), None)


def read_oom_kills(path: Path | None) -> int | None:
    """The `oom_kill` count in `path`, or None if it cannot be read."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
