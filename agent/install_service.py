"""`fleet-agent install-service` / `uninstall-service`: render this OS's service definition
(systemd unit or launchd property list) from the repo's template, install it, enable it,
(re)start it, and say what it runs with.

Planning is pure (`plan_install`, `plan_uninstall` return the files and commands);
`apply_plan` carries a plan out, or only prints it for `--dry-run`.
"""

from __future__ import annotations

import math
import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from agent.config import AgentConfig

UNIT_NAME = "fleet-agent.service"
LABEL = "org.ringfleet.agent"
SOURCE_ROOT = Path(__file__).resolve().parent.parent


class ServiceError(RuntimeError):
    """The service cannot be installed here: no template, an unsupported OS, a failed command."""


@dataclass(frozen=True)
class FileToWrite:
    path: Path
    content: bytes
    mode: int = 0o644
    keep_existing: bool = False  # never overwrite one that is there


@dataclass(frozen=True)
class ServicePlan:
    manager: str  # "systemd" or "launchd"
    files: tuple[FileToWrite, ...] = ()
    remove: tuple[Path, ...] = ()
    commands: tuple[tuple[str, ...], ...] = ()
    notes: tuple[str, ...] = ()
    printed_commands: tuple[tuple[str, ...], ...] = ()  # for the operator to run (--unit-dir)

    def describe(self) -> str:
        lines = [f"# service manager: {self.manager}"]
        for f in self.files:
            verb = "write (if missing)" if f.keep_existing else "write"
            lines.append(f"# {verb} {f.path} (mode {f.mode:o}):")
            lines.extend("    " + line for line in f.content.decode().splitlines())
        lines.extend(f"rm -f {p}" for p in self.remove)
        lines.extend(" ".join(_quote(a) for a in cmd)
                     for cmd in self.commands + self.printed_commands)
        lines.extend(f"# note: {n}" for n in self.notes)
        return "\n".join(lines)


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in " \t\"$") else arg


def agent_command() -> list[str]:
    """How the service starts the agent: the installed console script, else this Python."""
    script = Path(sys.executable).parent / "fleet-agent"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("fleet-agent")
    return [found] if found else [sys.executable, "-m", "agent.cli"]


def template(name: str) -> bytes:
    path = SOURCE_ROOT / name
    if not path.is_file():
        raise ServiceError(f"{path}: the service template is missing (install-service reads the "
                           "repository's systemd/ and launchd/ folders)")
    return path.read_bytes()


def render_systemd_unit(text: str, exec_start: list[str], stop_timeout_s: float, *,
                        user_unit: bool = False) -> str:
    """The unit with this machine's ExecStart and a stop timeout longer than the drain."""
    out = []
    for line in text.splitlines():
        key = line.split("=", 1)[0]
        if key == "ExecStart":
            line = "ExecStart=" + " ".join(_systemd_quote(a) for a in exec_start)
        elif key == "TimeoutStopSec":
            line = f"TimeoutStopSec={math.ceil(stop_timeout_s)}"
        elif key == "WantedBy" and user_unit:
            line = "WantedBy=default.target"
        elif key == "LimitMEMLOCK" and user_unit:
            continue  # a user manager may not raise it
        out.append(line)
    return "\n".join(out) + "\n"


def _systemd_quote(arg: str) -> str:
    if any(c in arg for c in " \t\"'\\"):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def render_launchd_plist(raw: bytes, program: list[str], exit_timeout_s: float,
                         log_path: Path, *, user_name: str | None = None) -> bytes:
    """The property list with this Mac's program, drain timeout, log and (a daemon) user."""
    plist = plistlib.loads(raw)
    plist["Label"] = LABEL
    plist["ProgramArguments"] = program
    plist["ExitTimeOut"] = math.ceil(exit_timeout_s)
    plist["StandardOutPath"] = plist["StandardErrorPath"] = str(log_path)
    if user_name:
        plist["UserName"] = user_name
    return plistlib.dumps(plist)


def plan_install(platform: str, config: AgentConfig, config_path: Path, *, system: bool,
                 uid: int, home: Path, command: list[str], config_yaml: bytes,
                 run_as: str | None = None, unit_dir: Path | None = None,
                 not_ready: str = "") -> ServicePlan:
    """Files and commands that install, enable and (re)start the agent's service. Pure.

    `config_yaml` is the config file as it will be (the settings install-service was given,
    merged into the file join wrote); `not_ready` is why the agent would not serve (it then
    exits at once with that reason and is not restarted). With `unit_dir` the definition
    goes there and the service manager's commands are only printed."""
    config_file = FileToWrite(config_path, config_yaml, 0o600)
    if platform.startswith("linux"):
        if run_as:
            raise ServiceError("--run-as: the systemd unit runs the agent as root (--system) "
                               "or as you (--user); --run-as names a macOS daemon's user")
        path = (unit_dir or (Path("/etc/systemd/system") if system
                             else home / ".config/systemd/user")) / UNIT_NAME
        program = command + ["run", "--config", str(config_path)]
        unit = render_systemd_unit(template("systemd/" + UNIT_NAME).decode(), program,
                                   config.stop_timeout_s, user_unit=not system)
        ctl = ("systemctl",) if system else ("systemctl", "--user")
        commands = (ctl + ("daemon-reload",), ctl + ("enable", UNIT_NAME),
                    ctl + ("restart", UNIT_NAME))  # restart: a changed config takes effect
        logs = ("journalctl " + ("" if system else "--user ") + f"-u {UNIT_NAME}")
        return _with_summary(ServicePlan("systemd", (config_file, FileToWrite(path, unit.encode())),
                                         (), commands), program, config, logs, not_ready,
                             unit_dir)
    if platform == "darwin":
        if system:
            plist_path = Path("/Library/LaunchDaemons") / f"{LABEL}.plist"
            domain, log_path = "system", Path("/Library/Logs/ringfleet/agent.log")
        else:
            plist_path = home / "Library/LaunchAgents" / f"{LABEL}.plist"
            domain, log_path = f"gui/{uid}", home / "Library/Logs/ringfleet/agent.log"
        if run_as and not system:
            raise ServiceError("--run-as: a LaunchAgent runs as the user who installs it; "
                               "add --system for a LaunchDaemon run as that user")
        plist_path = (unit_dir or plist_path.parent) / plist_path.name
        # launchd restarts on any failed exit: an agent that is not ready exits 0 instead.
        program = command + ["run", "--config", str(config_path), "--log-file", str(log_path),
                             "--not-joined-exit-code", "0"]
        plist = render_launchd_plist(template(f"launchd/{LABEL}.plist"), program,
                                     config.stop_timeout_s, log_path, user_name=run_as)
        commands: tuple[tuple[str, ...], ...] = (("mkdir", "-p", str(log_path.parent)),)
        if system and run_as:  # the daemon's user writes its state and its log
            commands += (("chown", "-R", run_as, str(config.state_dir), str(config_path),
                          str(log_path.parent)),)
        commands += (("launchctl", "bootout", f"{domain}/{LABEL}"),  # a loaded one: replace it
                     ("launchctl", "bootstrap", domain, str(plist_path)),
                     ("launchctl", "enable", f"{domain}/{LABEL}"))
        return _with_summary(ServicePlan("launchd", (config_file, FileToWrite(plist_path, plist)),
                                         (), commands), program, config, f"tail -f {log_path}",
                             not_ready, unit_dir)
    raise ServiceError(f"platform {platform!r}: install-service knows systemd (Linux) and "
                       "launchd (macOS)")


def _with_summary(plan: ServicePlan, program: list[str], config: AgentConfig, logs: str,
                  not_ready: str, unit_dir: Path | None) -> ServicePlan:
    """What the service will run with, said after it is installed (and before, in --dry-run)."""
    summary = (f"the service runs: {' '.join(_quote(a) for a in program)}",
               (f"as node {config.node}, API {config.url} (listening on "
               f"{config.listen_host}:{config.listen_port}), state in {config.state_dir}"),
               f"heartbeats to {config.supervisor_url}" if config.supervisor_url else
               "heartbeats to: none (no supervisor_url)",
               f"its log: {logs}",
               ("a running agent is restarted to take these settings: it drains this node's "
               "engines first"))
    notes = summary
    if not_ready:
        notes += ((f"warning: the agent will not serve: {not_ready}; it exits at once with "
                  "that reason and is not restarted until you fix it and install again"),)
    if unit_dir is not None:
        notes += ((f"the definition was written to {unit_dir}; the commands above were not "
                  "run (--unit-dir)"),)
        plan = replace(plan, commands=(), printed_commands=plan.commands)
    return replace(plan, notes=notes)


def plan_uninstall(platform: str, *, system: bool, uid: int, home: Path) -> ServicePlan:
    """Stop and disable the service and remove its definition (config and state stay)."""
    if platform.startswith("linux"):
        unit_dir = Path("/etc/systemd/system") if system else home / ".config/systemd/user"
        ctl = ("systemctl",) if system else ("systemctl", "--user")
        return ServicePlan("systemd", (), (unit_dir / UNIT_NAME,),
                           (ctl + ("disable", "--now", UNIT_NAME), ctl + ("daemon-reload",)))
    if platform == "darwin":
        plist_path = (Path("/Library/LaunchDaemons") if system
                      else home / "Library/LaunchAgents") / f"{LABEL}.plist"
        domain = "system" if system else f"gui/{uid}"
        return ServicePlan("launchd", (), (plist_path,),
                           (("launchctl", "bootout", f"{domain}/{LABEL}"),))
    raise ServiceError(f"platform {platform!r}: uninstall-service knows systemd and launchd")


def apply_plan(plan: ServicePlan, *, dry_run: bool, say: Callable[[str], None],
               run: Callable[[list[str]], int] | None = None) -> None:
    """Write, remove and run what `plan` says; with dry_run only describe it."""
    if dry_run:
        say(plan.describe())
        return
    run = run or (lambda cmd: subprocess.run(cmd, check=False).returncode)
    for f in plan.files:
        if f.keep_existing and f.path.exists():
            say(f"kept {f.path} (exists)")
            continue
        f.path.parent.mkdir(parents=True, exist_ok=True)
        f.path.write_bytes(f.content)
        os.chmod(f.path, f.mode)
        say(f"wrote {f.path}")
    for path in plan.remove:
        if path.exists():
            path.unlink()
            say(f"removed {path}")
    for cmd in plan.commands:
        say("$ " + " ".join(_quote(a) for a in cmd))
        code = run(list(cmd))
        if code != 0 and not {"bootout", "disable"} & set(cmd):  # already gone is fine
            raise ServiceError(f"`{' '.join(cmd)}` failed with exit code {code}")
    for cmd in plan.printed_commands:
        say("to run yourself: " + " ".join(_quote(a) for a in cmd))
    for note in plan.notes:
        say(f"note: {note}")
