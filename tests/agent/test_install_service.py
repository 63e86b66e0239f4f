"""Service definitions: the systemd unit passes `systemd-analyze verify`, the launchd property
list has what launchd needs, and install-service plans (and dry-runs) both."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import AgentConfig
from agent.install_service import (
    LABEL,
    UNIT_NAME,
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
    assert service["KillMode"] == "mixed"  # SIGTERM to the agent only: it drains its engines
    assert int(service["TimeoutStopSec"]) > AgentConfig(node="n").drain_s
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install -y systemd)")
def test_the_rendered_unit_passes_systemd_analyze_verify(tmp_path):
    config = AgentConfig(node="n", drain_s=300)
    text = render_systemd_unit(template("systemd/" + UNIT_NAME).decode(),
                               [sys.executable, "-m", "agent.cli", "run", "--config",
                                str(tmp_path / "agent config.yaml")], config.stop_timeout_s)
    assert f"TimeoutStopSec={int(config.stop_timeout_s)}" in text
    path = tmp_path / UNIT_NAME
    path.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


def test_the_property_list_holds_what_launchd_needs(tmp_path):
    raw = (REPO / "launchd" / f"{LABEL}.plist").read_bytes()
    plist = plistlib.loads(raw)
    assert plist["Label"] == LABEL
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ExitTimeOut"] > AgentConfig(node="n").drain_s
    assert plist["ProgramArguments"][1:3] == ["run", "--config"]
    config = AgentConfig(node="mac", drain_s=60)
    plan = plan_install("darwin", config, Path("/Users/me/agent.yaml"), system=False, uid=501,
                        home=Path("/Users/me"), command=["/opt/fleet/bin/fleet-agent"])
    written = {f.path: f for f in plan.files}
    rendered = plistlib.loads(written[Path(f"/Users/me/Library/LaunchAgents/{LABEL}.plist")]
                              .content)
    assert rendered["ProgramArguments"] == ["/opt/fleet/bin/fleet-agent", "run", "--config",
                                            "/Users/me/agent.yaml"]
    assert rendered["ExitTimeOut"] == int(config.stop_timeout_s)
    assert ("launchctl", "bootstrap", "gui/501",
            f"/Users/me/Library/LaunchAgents/{LABEL}.plist") in plan.commands
    undo = plan_uninstall("darwin", system=False, uid=501, home=Path("/Users/me"))
    assert undo.commands == (("launchctl", "bootout", f"gui/501/{LABEL}"),)


def test_install_and_uninstall_on_linux_write_enable_and_reverse(tmp_path):
    config = AgentConfig(node="gb10", state_dir=tmp_path / "state")
    plan = plan_install("linux", config, tmp_path / "etc/agent.yaml", system=False, uid=1000,
                        home=tmp_path, command=["/usr/bin/fleet-agent"])
    ran = []
    apply_plan(plan, dry_run=False, say=lambda _: None, run=lambda cmd: ran.append(cmd) or 0)
    unit = tmp_path / ".config/systemd/user" / UNIT_NAME
    assert "ExecStart=/usr/bin/fleet-agent run --config" in unit.read_text()
    assert (tmp_path / "etc/agent.yaml").stat().st_mode & 0o777 == 0o600
    assert ran == [["systemctl", "--user", "daemon-reload"],
                   ["systemctl", "--user", "enable", "--now", UNIT_NAME]]
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
        assert f"systemctl enable --now {UNIT_NAME}" in out
    assert "KillMode=mixed" in out or "ExitTimeOut" in out
    assert not config_path.exists()
    assert main(["uninstall-service", "--dry-run", "--system", "--config", str(config_path),
                 "--node", "gb10"]) == 0
    assert "rm -f" in capsys.readouterr().out
