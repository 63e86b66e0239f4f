"""One wildcard rule for every listener (engine.addresses): the supervisor's API and front
door, an agent's API, rank 0's HTTP API, the stage link's listener and MASTER_ADDR all refuse
every spelling of "every interface", literal or resolved, with an error that names the
setting. Each CLI is also run as a real process once, to see the refusal as an operator does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError
from agent.spawn import SpawnRefused, SpawnRequest
from engine.addresses import wildcard_address
from engine.env import EngineEnv, EnvError
from engine.harness.launch import free_port
from engine.link import errors as link_errors
from engine.link.transport import listen
from supervisor.settings import SettingsError, split_address

REPO = Path(__file__).resolve().parents[2]
WILDCARD_HOSTS = ["0", "0.0.0.0", "::", "[::]", "[::0]", "[0:0:0:0:0:0:0:0]", "0x0", "00",
                  "0.0", "", "*"]
NAMED_HOSTS = ["127.0.0.1", "::1", "[::1]", "localhost", "no-such-host.invalid"]


def address(host: str, port: int = 8000) -> str:
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{host}:{port}"


@pytest.mark.parametrize("host", WILDCARD_HOSTS)
def test_every_spelling_of_every_interface_is_a_wildcard(host):
    assert wildcard_address(host) is not None


@pytest.mark.parametrize("host", NAMED_HOSTS)
def test_named_addresses_are_not(host):
    assert wildcard_address(host) is None


def test_a_host_name_that_resolves_to_a_wildcard_is_one(monkeypatch):
    real = socket.getaddrinfo

    def resolver(host, *args, **kwargs):  # a hosts-file entry "0.0.0.0 anywhere.lan"
        if host == "anywhere.lan":
            return real("0.0.0.0", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    assert wildcard_address("anywhere.lan") == "0.0.0.0"
    with pytest.raises(SettingsError, match="resolves to 0.0.0.0"):
        split_address("anywhere.lan:8000", "front_door")


@pytest.mark.parametrize("host", WILDCARD_HOSTS)
def test_each_listener_refuses_each_wildcard(host, tmp_path):
    where = address(host)
    for what in ("listen", "front_door"):
        with pytest.raises(SettingsError, match=f"{what}=.*(wildcard|expected host:port)"):
            split_address(where, what)
    with pytest.raises(ConfigError, match="listen_host=.*wildcard"):
        AgentConfig(node="n", state_dir=tmp_path, listen_host=host.strip("[]"))
    base = {"FLEET_MODEL": str(tmp_path)}
    with pytest.raises(EnvError, match="FLEET_HTTP=.*wildcard"):
        EngineEnv.from_environ(dict(base, FLEET_HTTP=where))
    ring = dict(base, WORLD_SIZE="2", RANK="1", FLEET_LAYERS="1:2", FLEET_LAYOUT="0:1,1:2",
                FLEET_KEY_FILE="k", MASTER_ADDR="127.0.0.1", FLEET_LISTEN="127.0.0.1:9")
    with pytest.raises(EnvError, match="FLEET_LISTEN=.*wildcard"):
        EngineEnv.from_environ(dict(ring, FLEET_LISTEN=where))
    if host:  # an empty MASTER_ADDR is the default's business
        with pytest.raises(EnvError, match="MASTER_ADDR:MASTER_PORT=.*wildcard"):
            EngineEnv.from_environ(dict(ring, MASTER_ADDR=host))
    with pytest.raises(link_errors.WildcardListen):
        listen(host, 0)


def test_named_addresses_still_serve(tmp_path):
    assert split_address("127.0.0.1:8000", "front_door") == ("127.0.0.1", 8000)
    assert split_address("[::1]:8000", "listen") == ("::1", 8000)
    assert AgentConfig(node="n", state_dir=tmp_path, listen_host="localhost").listen_host
    assert AgentConfig(node="n", state_dir=tmp_path, listen_host="::1").url == (
        "https://[::1]:7700")
    assert EngineEnv.from_environ({"FLEET_MODEL": "m", "FLEET_HTTP": "localhost:1"}).http == (
        "localhost", 1)


def test_an_agent_refuses_a_spawn_whose_api_would_bind_a_wildcard(make_model):
    model = make_model("qwen3")
    for host in ("0", "[::0]"):
        request = SpawnRequest("r0", {"FLEET_MODEL": str(model), "FLEET_HTTP": address(host)})
        with pytest.raises(SpawnRefused, match="wildcard") as refused:
            request.spec(10.0)
        assert refused.value.field == "FLEET_HTTP"


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_clis_refuse_a_wildcard_with_the_setting_named(tmp_path):
    port = free_port()
    done = run(["-m", "supervisor.main", "--state-dir", str(tmp_path / "s"),
                "--front-door", f"0:{port}"])
    assert done.returncode == 2 and f"front_door='0:{port}'" in done.stderr
    assert "resolves to 0.0.0.0" in done.stderr
    done = run(["-m", "supervisor.main", "--state-dir", str(tmp_path / "s"),
                "--listen", f"[0:0:0:0:0:0:0:0]:{port}"])
    assert done.returncode == 2 and "listen=" in done.stderr and "wildcard" in done.stderr
    done = run(["-m", "agent.cli", "run", "--node", "n", "--state-dir", str(tmp_path / "a"),
                "--listen", f"[::0]:{port}"])
    assert done.returncode == 2 and "listen_host=" in done.stderr and "wildcard" in done.stderr
    done = run(["-m", "engine.main"], {"FLEET_MODEL": str(tmp_path), "FLEET_HTTP": f"0:{port}"})
    assert done.returncode == 2 and f"FLEET_HTTP='0:{port}'" in done.stderr
