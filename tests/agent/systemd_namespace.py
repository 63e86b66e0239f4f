"""A real systemd, booted as PID 1 of its own PID, mount and cgroup namespaces, that sees only
the units a test gives it: where the machine allows it (root, a systemd binary, cgroup v2),
the agent's unit runs under the service manager it was written for.

The namespace keeps the host's network (the test reaches the agent on loopback) and files,
with private /run and /etc/systemd/system (so `systemctl enable` links stay inside), and a
cgroup of its own below the host's, removed when it shuts down. SYSTEMD_UNIT_PATH holds the
unit folder plus empty stand-ins for the targets a service depends on by default, so
nothing else of the host's distribution starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.waiting import wait_until

SYSTEMD = Path("/lib/systemd/systemd")
STAND_IN_TARGETS = ("sysinit", "basic", "shutdown", "network-online", "network", "multi-user",
                    "default", "ringfleet-test")


def cgroup2_mount() -> Path | None:
    """Where the unified (v2) cgroup hierarchy is mounted here, if it is."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def why_systemd_cannot_run() -> str:
    """'' when this machine can boot systemd in a namespace; else the reason, for a skip."""
    if not sys.platform.startswith("linux"):
        return f"systemd runs on Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "booting systemd in a namespace needs root (unshare --pid --mount --cgroup)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux)"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} is not there (apt-get install -y systemd)"
    cgroups = cgroup2_mount()
    if cgroups is None:
        return "no cgroup v2 hierarchy is mounted (systemd needs one to track a unit's processes)"
    if not os.access(cgroups, os.W_OK):
        return f"{cgroups} is read-only here (a container without its own cgroups?)"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--cgroup", "true"],
                           capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        return ("new PID, mount and cgroup namespaces are not allowed here: "
                f"{probe.stderr.strip()}")
    return ""


class SystemdInNamespace:
    """Boot with `boot()`, talk to it with `systemctl()`, end it with `shutdown()`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.units = root / "units"
        self.boot_log = root / "systemd.log"
        self.cgroup = cgroup2_mount() / f"ringfleet-test-{os.getpid()}-{id(self) & 0xffff}"
        self.unshare: subprocess.Popen | None = None
        self.init_pid = 0  # systemd's pid as the host sees it

    def boot(self, timeout_s: float = 60.0) -> None:
        self.units.mkdir(parents=True, exist_ok=True)
        for name in STAND_IN_TARGETS:
            (self.units / f"{name}.target").write_text(
                "[Unit]\nDescription=stand-in for a test\nDefaultDependencies=no\n")
        self.cgroup.mkdir()
        inside = ("mount -t tmpfs tmpfs /run && "
                  "(umount -l /sys/fs/cgroup 2>/dev/null || true) && "
                  "mount -t cgroup2 cgroup2 /sys/fs/cgroup && "
                  "mkdir -p /etc/systemd/system && mount -t tmpfs tmpfs /etc/systemd/system && "
                  f"exec {SYSTEMD} --system --unit=ringfleet-test.target --log-target=console")
        script = (f"echo $$ > {self.cgroup}/cgroup.procs && exec unshare --pid --fork --mount "
                  f"--cgroup --mount-proc --uts --propagation private sh -c '{inside}'")
        env = dict(os.environ, container="ringfleet-test", SYSTEMD_UNIT_PATH=str(self.units))
        with open(self.boot_log, "ab") as log:
            self.unshare = subprocess.Popen(["sh", "-c", script], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        def running() -> bool:
            if self.unshare.poll() is not None:
                raise RuntimeError(f"systemd exited {self.unshare.returncode}: {self.log_tail()}")
            self.init_pid = self.init_pid or self._child_of(self.unshare.pid)
            return bool(self.init_pid) and self.systemctl(
                "is-system-running", check=False).stdout.strip() in ("running", "degraded")

        try:
            wait_until(running, within_s=timeout_s, what="systemd running", poll_s=0.2)
        except AssertionError as exc:
            raise RuntimeError(f"{exc}: {self.log_tail()}") from exc

    @staticmethod
    def _child_of(pid: int) -> int:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return 0
        return int(children[0]) if children else 0

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.boot_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def inside(self, *argv: str, check: bool = True,
               timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """Run `argv` in systemd's PID and mount namespaces (pids there are its pids)."""
        done = subprocess.run(["nsenter", "-t", str(self.init_pid), "-m", "-p", "env",
                               f"SYSTEMD_UNIT_PATH={self.units}", *argv], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}"
                               f"{done.stderr}")
        return done

    def systemctl(self, *args: str, check: bool = True,
                  timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        return self.inside("systemctl", "--no-pager", *args, check=check, timeout_s=timeout_s)

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.strip()

    def alive(self, pid: int) -> bool:
        """Whether `pid` (a pid inside the namespace) is a live process there."""
        state = self.inside("sh", "-c", f"cat /proc/{pid}/stat 2>/dev/null", check=False).stdout
        return bool(state) and state.split(")")[-1].split()[0] != "Z"

    def shutdown(self) -> None:
        """SIGKILL to PID 1 ends every process of the namespace; then remove its cgroups."""
        if self.init_pid:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.unshare is not None:
            try:
                self.unshare.wait(30)
            except subprocess.TimeoutExpired:
                self.unshare.kill()
                self.unshare.wait(10)
        def removed() -> bool:
            """Each cgroup below ours, deepest first, then ours: empty once its processes left."""
            for directory in sorted(self.cgroup.rglob("*"), key=lambda p: -len(p.parts)):
                if directory.is_dir():
                    with contextlib.suppress(OSError):
                        directory.rmdir()
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
            return not self.cgroup.exists()

        wait_until(removed, within_s=30, what=f"the test's cgroup {self.cgroup} removed",
                   poll_s=0.1)
