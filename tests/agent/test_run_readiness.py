"""`fleet-agent run` as a real process: a node that has not joined, or whose config names no
supervisor, exits at once with one line saying what to do and a status of its own (78, which
the systemd unit does not restart on; launchd's job asks for 0 instead)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from agent.cli import EXIT_NOT_JOINED
from agent.config import AgentConfig, ConfigError, write_settings
from tests.agent.conftest import REPO, agent_config, free_port


def run_agent(config_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config",
                           str(config_path), *flags], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_node_that_has_not_joined_exits_with_its_own_status_and_one_line(tmp_path):
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump({
        "node": "gb10", "state_dir": str(tmp_path / "state"), "listen_port": free_port(),
        "supervisor_url": "https://127.0.0.1:7400"}))
    done = run_agent(config_path)
    assert done.returncode == EXIT_NOT_JOINED
    line = one_line(done)
    assert "has not joined" in line and "fleet-agent join" in line and "pki/ca.pem" in line
    # launchd cannot exempt a status from KeepAlive: its job asks for a successful exit.
    assert run_agent(config_path, "--not-joined-exit-code", "0").returncode == 0


def test_a_joined_node_without_a_supervisor_url_says_so_and_standalone_serves(fleet,
                                                                              tmp_path):
    config = agent_config(fleet, tmp_path / "state")  # the node's certificate, no supervisor
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    done = run_agent(config_path)
    assert done.returncode == EXIT_NOT_JOINED
    line = one_line(done)
    assert f"no supervisor_url in {config_path}" in line and "--standalone" in line
    # With one, it gets past the check to serving: a taken port is the next thing it meets.
    with __import__("socket").create_server(("127.0.0.1", config.listen_port)):
        done = run_agent(config_path, "--supervisor", f"https://127.0.0.1:{free_port()}")
    assert done.returncode == 1 and "cannot serve on" in done.stderr, done.stderr


def test_write_settings_keeps_other_keys_and_refuses_a_bad_value_untouched(tmp_path):
    path = tmp_path / "etc" / "agent.yaml"
    config = write_settings(path, node="mac", listen_port=7701, supervisor_url=None)
    assert config == AgentConfig(node="mac", listen_port=7701)
    assert yaml.safe_load(path.read_text()) == {"node": "mac", "listen_port": 7701}
    assert path.stat().st_mode & 0o777 == 0o600
    config = write_settings(path, supervisor_url="https://10.0.0.1:7400", state_dir=tmp_path)
    assert (config.node, config.listen_port, config.state_dir) == ("mac", 7701, tmp_path)
    before = path.read_text()
    try:
        write_settings(path, supervisor_url="10.0.0.1:7400")
    except ConfigError as exc:
        assert "supervisor_url='10.0.0.1:7400'" in str(exc) and "https://" in str(exc)
    else:
        raise AssertionError("a supervisor URL without https:// was written")
    assert path.read_text() == before
