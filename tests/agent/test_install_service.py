"""Service definitions: the systemd unit passes `systemd-analyze verify` and neither kills
engines with a crashed agent nor restarts one that has not joined; the launchd property lists
(LaunchAgent and LaunchDaemon) round-trip through plistlib with what launchd needs; and
install-service plans (and dry-runs) both, with the settings it was given written into the
config it installs from. (The unit under a real systemd: test_systemd_service.py.)"""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.cli import EXIT_NOT_JOINED, main
from agent.config import AgentConfig
from agent.install_service import (
    LABEL,
    UNIT_NAME,
    ServiceError,
    apply_plan,
    plan_install,
    plan_uninstall,
    render_systemd_unit,
    template,
)

REPO = Path(__file__).resolve().parents[2]


def unit_sections(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(text)
    return parser


def test_the_repo_unit_restarts_on_failure_and_outlasts_the_drain():
    unit = unit_sections((REPO / "systemd" / UNIT_NAME).read_text())
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    # Signals reach the agent alone, on a stop and after a crash: engines outlive a crash.
    assert service["KillMode"] == "process"
    assert str(EXIT_NOT_JOINED) in service["RestartPreventExitStatus"].split()
    assert int(unit["Unit"]["StartLimitBurst"]) > 1 and int(unit["Unit"]["StartLimitIntervalSec"])
    assert int(service["TimeoutStopSec"]) > AgentConfig(node="n").drain_s
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install -y systemd)")
def test_the_rendered_unit_passes_systemd_analyze_verify(tmp_path):
    config = AgentConfig(node="n", drain_s=300)
    text = render_systemd_unit(template("systemd/" + UNIT_NAME).decode(),
                               [sys.executable, "-m", "agent.cli", "run", "--config",
                                str(tmp_path / "agent config.yaml")], config.stop_timeout_s)
    assert "KillMode=process" in text and f"RestartPreventExitStatus=2 {EXIT_NOT_JOINED}" in text
    assert f"TimeoutStopSec={int(config.stop_timeout_s)}" in text
    path = tmp_path / UNIT_NAME
    path.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


def plan_for(platform: str, config: AgentConfig, config_path: Path, **kwargs):
    kwargs.setdefault("system", False)
    kwargs.setdefault("uid", 501)
    kwargs.setdefault("home", Path("/Users/me"))
    kwargs.setdefault("command", ["/opt/fleet/bin/fleet-agent"])
    return plan_install(platform, config, config_path,
                        config_yaml=yaml.safe_dump(config.to_dict()).encode(), **kwargs)


def round_trip(raw: bytes) -> dict:
    """The property list as launchd reads it, checked to survive plistlib both ways."""
    plist = plistlib.loads(raw)
    assert plistlib.loads(plistlib.dumps(plist)) == plist
    assert plistlib.loads(plistlib.dumps(plist, fmt=plistlib.FMT_BINARY)) == plist
    return plist


def test_the_property_list_holds_what_launchd_needs(tmp_path):
    plist = round_trip((REPO / "launchd" / f"{LABEL}.plist").read_bytes())
    assert plist["Label"] == LABEL
    assert plist["RunAtLoad"] is True
    # Restarted only after a failed exit; a node that has not joined exits 0 under launchd.
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProgramArguments"][-2:] == ["--not-joined-exit-code", "0"]
    assert plist["AbandonProcessGroup"] is True  # engines outlive an agent crash
    assert plist["ExitTimeOut"] > AgentConfig(node="n").drain_s
    assert plist["ProgramArguments"][1:3] == ["run", "--config"]
    config = AgentConfig(node="mac", drain_s=60)
    plan = plan_for("darwin", config, Path("/Users/me/agent.yaml"))
    written = {f.path: f for f in plan.files}
    rendered = round_trip(written[Path(f"/Users/me/Library/LaunchAgents/{LABEL}.plist")].content)
    log = "/Users/me/Library/Logs/ringfleet/agent.log"
    assert rendered["ProgramArguments"] == ["/opt/fleet/bin/fleet-agent", "run", "--config",
                                            "/Users/me/agent.yaml", "--log-file", log,
                                            "--not-joined-exit-code", "0"]
    assert rendered["StandardErrorPath"] == log and "UserName" not in rendered
    assert rendered["ExitTimeOut"] == int(config.stop_timeout_s)
    assert plan.commands.index(("launchctl", "bootout", f"gui/501/{LABEL}")) < plan.commands.index(
        ("launchctl", "bootstrap", "gui/501", f"/Users/me/Library/LaunchAgents/{LABEL}.plist"))
    undo = plan_uninstall("darwin", system=False, uid=501, home=Path("/Users/me"))
    assert undo.commands == (("launchctl", "bootout", f"gui/501/{LABEL}"),)


def test_a_launch_daemon_starts_at_boot_as_its_user_in_the_system_domain():
    state = Path("/Library/Application Support/ringfleet")
    config = AgentConfig(node="studio", state_dir=state)
    config_path = state / "agent.yaml"
    plan = plan_for("darwin", config, config_path, system=True, run_as="ops")
    path = Path(f"/Library/LaunchDaemons/{LABEL}.plist")
    plist = round_trip({f.path: f for f in plan.files}[path].content)
    assert plist["UserName"] == "ops" and plist["RunAtLoad"] is True
    assert plist["StandardOutPath"] == "/Library/Logs/ringfleet/agent.log"
    assert plist["ProgramArguments"][plist["ProgramArguments"].index("--log-file") + 1] == (
        "/Library/Logs/ringfleet/agent.log")  # the agent rotates it: launchd would not
    assert ("chown", "-R", "ops", str(state), str(config_path), "/Library/Logs/ringfleet") in (
        plan.commands)
    assert ("launchctl", "bootstrap", "system", str(path)) in plan.commands
    assert ("launchctl", "enable", f"system/{LABEL}") in plan.commands
    with pytest.raises(ServiceError, match="--run-as"):  # a LaunchAgent is its user's own
        plan_for("darwin", config, config_path, system=False, run_as="ops")
    with pytest.raises(ServiceError, match="--run-as"):
        plan_for("linux", config, config_path, system=True, run_as="ops")


def test_install_and_uninstall_on_linux_write_enable_and_reverse(tmp_path):
    config = AgentConfig(node="gb10", state_dir=tmp_path / "state")
    plan = plan_for("linux", config, tmp_path / "etc/agent.yaml", uid=1000, home=tmp_path,
                    command=["/usr/bin/fleet-agent"])
    ran = []
    apply_plan(plan, dry_run=False, say=lambda _: None, run=lambda cmd: ran.append(cmd) or 0)
    unit = tmp_path / ".config/systemd/user" / UNIT_NAME
    assert "ExecStart=/usr/bin/fleet-agent run --config" in unit.read_text()
    assert (tmp_path / "etc/agent.yaml").stat().st_mode & 0o777 == 0o600
    assert ran == [["systemctl", "--user", "daemon-reload"],
                   ["systemctl", "--user", "enable", UNIT_NAME],
                   ["systemctl", "--user", "restart", UNIT_NAME]]
    ran.clear()
    apply_plan(plan_uninstall("linux", system=False, uid=1000, home=tmp_path), dry_run=False,
               say=lambda _: None, run=lambda cmd: ran.append(cmd) or 0)
    assert not unit.exists() and (tmp_path / "etc/agent.yaml").exists()
    assert ran[0] == ["systemctl", "--user", "disable", "--now", UNIT_NAME]


def test_install_service_dry_run_prints_and_changes_nothing(tmp_path, capsys):
    config_path = tmp_path / "agent.yaml"
    assert main(["install-service", "--dry-run", "--system", "--config", str(config_path),
                 "--node", "gb10", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    if sys.platform.startswith("linux"):
        assert f"/etc/systemd/system/{UNIT_NAME}" in out
        assert f"systemctl enable {UNIT_NAME}" in out
    assert "KillMode=process" in out or "ExitTimeOut" in out
    assert not config_path.exists()
    assert main(["uninstall-service", "--dry-run", "--system", "--config", str(config_path),
                 "--node", "gb10"]) == 0
    assert "rm -f" in capsys.readouterr().out


def test_install_service_writes_listen_and_supervisor_into_the_config_and_says_so(tmp_path,
                                                                                  capsys):
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump({"node": "gb10", "state_dir": str(tmp_path / "s"),
                                           "drain_s": 60}))  # as join left it, plus an edit
    unit_dir = tmp_path / "units"
    assert main(["install-service", "--system", "--config", str(config_path), "--unit-dir",
                 str(unit_dir), "--listen", "127.0.0.2:7711",
                 "--supervisor", "https://127.0.0.1:7400"]) == 0
    out = capsys.readouterr().out
    written = yaml.safe_load(config_path.read_text())
    assert written == {"node": "gb10", "state_dir": str(tmp_path / "s"), "drain_s": 60,
                       "listen_host": "127.0.0.2", "listen_port": 7711,
                       "supervisor_url": "https://127.0.0.1:7400"}
    assert config_path.stat().st_mode & 0o777 == 0o600
    if sys.platform.startswith("linux"):
        unit = (unit_dir / UNIT_NAME).read_text()
        assert f"run --config {config_path}" in unit and "TimeoutStopSec=105" in unit
        assert f"to run yourself: systemctl restart {UNIT_NAME}" in out  # printed, not run
    assert "listening on 127.0.0.2:7711" in out
    assert "heartbeats to https://127.0.0.1:7400" in out
    assert "has not joined" in out  # no certificate under s/pki: the warning says so
    assert main(["install-service", "--dry-run", "--config", str(config_path),
                 "--supervisor", "http://nowhere"]) == 2  # refused before anything is written
    assert yaml.safe_load(config_path.read_text())["supervisor_url"] == "https://127.0.0.1:7400"
