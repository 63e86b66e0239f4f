"""`fleet-front-door`'s service definitions: the systemd unit passes `systemd-analyze verify`
(rendered with this machine's command) and restarts the front door on failure; the launchd
property list survives plistlib both ways and keeps the job alive; both start the program
with flags it accepts. (Serving through a supervisor's crash:
test_front_door_outlives_supervisor.py.)"""

from __future__ import annotations

import configparser
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.install_service import render_systemd_unit
from supervisor.front_door_main import parse_args

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "fleet-front-door.service"
PLIST = REPO / "launchd" / "org.ringfleet.front-door.plist"


def unit_sections(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(text)
    return parser


def test_the_unit_restarts_the_front_door_and_starts_it_with_flags_it_takes():
    unit = unit_sections(UNIT.read_text())
    service = unit["Service"]
    assert service["Restart"] == "on-failure" and int(service["RestartSec"]) > 0
    assert int(unit["Unit"]["StartLimitBurst"]) > 1 and int(unit["Unit"]["StartLimitIntervalSec"])
    assert int(service["TimeoutStopSec"]) > 5  # the listener's own shutdown timeout
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    program, *args = shlex.split(service["ExecStart"])
    assert Path(program).name == "fleet-front-door"
    parsed = parse_args(args)
    assert parsed.credentials == Path("/var/lib/ringfleet/pki/front-door")
    assert parsed.listen


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install -y systemd)")
def test_the_rendered_unit_passes_systemd_analyze_verify(tmp_path):
    text = render_systemd_unit(UNIT.read_text(), [
        sys.executable, "-m", "supervisor.front_door_main", "--credentials",
        str(tmp_path / "front door"), "--listen", "127.0.0.1:8000"], 30)
    path = tmp_path / UNIT.name
    path.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


def test_the_launchd_job_keeps_the_front_door_alive_with_flags_it_takes():
    raw = PLIST.read_bytes()
    job = plistlib.loads(raw)
    assert plistlib.loads(plistlib.dumps(job)) == job
    assert plistlib.loads(plistlib.dumps(job, fmt=plistlib.FMT_BINARY)) == job
    assert job["Label"] == "org.ringfleet.front-door"
    assert job["RunAtLoad"] is True and job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ExitTimeOut"] > 5 and job["ThrottleInterval"] > 0
    program, *args = job["ProgramArguments"]
    assert Path(program).name == "fleet-front-door"
    assert parse_args(args).credentials.name == "front-door"
