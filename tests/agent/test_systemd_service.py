"""The agent's systemd unit under a real systemd (booted in a namespace where this machine
allows it): installed by `fleet-agent install-service --unit-dir`, an agent killed with
SIGKILL leaves its engine serving, systemd restarts the agent, which adopts the engine;
`systemctl stop` drains it; an agent that has not joined exits once and is not restarted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from agent.cli import EXIT_NOT_JOINED
from agent.install_service import UNIT_NAME
from tests.agent.conftest import REPO, agent_config, client, free_port, read_records, wait_state
from tests.agent.systemd_namespace import SystemdInNamespace, why_systemd_cannot_run
from tests.waiting import wait_until, wait_until_async

WHY_NOT = why_systemd_cannot_run()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"no systemd here: {WHY_NOT}")


@pytest.fixture
def systemd(tmp_path):
    # Where WHY_NOT found everything systemd needs, a boot that fails is a failure.
    manager = SystemdInNamespace(tmp_path / "systemd")
    try:
        manager.boot()
        yield manager
    finally:
        manager.shutdown()


def install(systemd: SystemdInNamespace, config_path: Path) -> str:
    """`fleet-agent install-service --system --unit-dir`, then the commands it printed."""
    done = subprocess.run([sys.executable, "-m", "agent.cli", "install-service", "--system",
                           "--config", str(config_path), "--unit-dir", str(systemd.units)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = [line.removeprefix("to run yourself: ").split()
               for line in done.stdout.splitlines() if line.startswith("to run yourself: ")]
    assert printed == [["systemctl", "daemon-reload"], ["systemctl", "enable", UNIT_NAME],
                       ["systemctl", "restart", UNIT_NAME]]
    for command in printed:
        systemd.systemctl(*command[1:])
    return done.stdout


async def wait_agent(url: str, session: aiohttp.ClientSession, within_s: float) -> None:
    async def answers() -> bool:
        try:
            async with session.get(url + "/v1/health") as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    await wait_until_async(answers, within_s=within_s, what=f"the agent at {url} to answer")


def test_engines_outlive_an_agent_crash_are_adopted_and_systemctl_stop_drains_them(
        fleet, tmp_path, tiny_model, systemd):
    # The supervisor is down (nothing listens at its URL): heartbeats fail, the agent serves.
    config = agent_config(fleet, tmp_path / "state", drain_s=30.0,
                          supervisor_url=f"https://127.0.0.1:{free_port()}",
                          log_file=str(tmp_path / "state" / "agent.log"))
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    said = install(systemd, config_path)
    assert "the service runs:" in said and "warning" not in said
    url = f"https://127.0.0.1:{config.listen_port}"
    http = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with client(fleet, timeout_s=120) as session:
            await wait_agent(url, session, 60)
            async with session.post(url + "/v1/engines", json={
                    "engine_id": "kept", "env": {"FLEET_MODEL": str(tiny_model),
                                                 "FLEET_HTTP": http,
                                                 "FLEET_MODEL_ID": "tiny"}}) as r:
                assert r.status == 201, await r.text()
            view = await wait_state(session, url, "kept", {"ready", "exited"}, 120)
            assert view["state"] == "ready", view
            engine_pid = view["pid"]  # a pid in systemd's namespace: the agent runs there
            cgroup = systemd.inside("cat", f"/proc/{engine_pid}/cgroup").stdout
            assert f"/system.slice/{UNIT_NAME}" in cgroup  # in the unit: KillMode decides

            crashed = int(systemd.show(UNIT_NAME, "MainPID"))
            systemd.inside("kill", "-KILL", str(crashed))  # a crash: no drain, no goodbye
            restarted = await wait_until_async(
                lambda: int(systemd.show(UNIT_NAME, "MainPID")) not in (0, crashed) and (
                    systemd.show(UNIT_NAME, "ActiveState") == "active"),
                within_s=60, what="systemd to restart the agent")
            assert restarted and systemd.show(UNIT_NAME, "NRestarts") == "1"
            assert systemd.alive(engine_pid), "the agent's crash took its engine with it"
            await wait_agent(url, session, 60)
            view = await wait_state(session, url, "kept", {"ready"}, 30)
            assert view["adopted"] and view["pid"] == engine_pid
            async with aiohttp.ClientSession() as plain, plain.post(
                    f"http://{http}/v1/completions", json={
                        "model": "tiny", "prompt": "still here", "max_tokens": 3,
                        "stop": []}) as r:
                assert r.status == 200, await r.text()  # served through crash and restart

        systemd.systemctl("stop", UNIT_NAME, timeout_s=120)  # returns once the agent exited
        assert systemd.show(UNIT_NAME, "ActiveState") == "inactive"
        assert not systemd.alive(engine_pid), "systemctl stop left the engine running"
        assert read_records(config) == []
        log = (tmp_path / "state" / "agent.log").read_text()
        assert '"reason": "drained"' in log  # drained by the agent, not killed with the unit

    asyncio.run(scenario())


def test_an_agent_that_has_not_joined_exits_once_with_its_reason_and_is_not_restarted(
        tmp_path, systemd):
    config_path = tmp_path / "agent.yaml"  # no certificate under state/pki: never joined
    config_path.write_text(yaml.safe_dump({
        "node": "lonely", "state_dir": str(tmp_path / "state"), "listen_port": free_port(),
        "supervisor_url": f"https://127.0.0.1:{free_port()}"}))
    said = install(systemd, config_path)
    assert "warning: the agent will not serve" in said and "has not joined" in said
    wait_until(lambda: systemd.show(UNIT_NAME, "ActiveState") in ("failed", "inactive"),
               within_s=30, what="the agent to exit")
    assert systemd.show(UNIT_NAME, "ExecMainStatus") == str(EXIT_NOT_JOINED)
    # RestartSec is 5 s: had systemd scheduled a restart, the unit would say so now.
    assert systemd.show(UNIT_NAME, "SubState") != "auto-restart"
    assert systemd.show(UNIT_NAME, "NRestarts") == "0"
