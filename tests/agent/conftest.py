"""Fixtures for the agent's tests: a fleet PKI on disk, agents served in-process or as real
processes on loopback, mTLS clients, and a tiny checkpoint."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.app import make_app
from agent.config import AgentConfig
from agent.pki import FleetCA, NodeCredentials, cert_pem, utcnow
from agent.tls import server_context
from engine.harness.launch import free_port
from tests.waiting import wait_until_async

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fleet:
    """A fleet CA and credential directories for every kind of caller the tests need."""

    root: Path
    ca: FleetCA

    def creds(self, name: str) -> NodeCredentials:
        return NodeCredentials(self.root / name)

    def client_ssl(self, name: str | None) -> ssl.SSLContext:
        """A client context presenting `name`'s certificate (None: no certificate at all)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(self.creds("admin").ca_path))
        ctx.check_hostname = False
        if name is not None:
            creds = self.creds(name)
            ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
        return ctx


def _store(directory: Path, ca_pem: bytes, key: bytes, cert: bytes) -> None:
    NodeCredentials(directory).store(ca_pem, cert, key)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory) -> Fleet:
    root = tmp_path_factory.mktemp("pki")
    ca = FleetCA.create("test")
    ca.save(root / "ca")
    ca_pem = cert_pem(ca.cert)
    for name, role in (("node-a", "agent"), ("node-b", "agent"), ("super", "supervisor"),
                       ("admin", "admin")):
        key, cert = ca.issue_credentials(name, role, hosts=("127.0.0.1",))
        _store(root / name, ca_pem, key, cert)
    other = FleetCA.create("other")
    key, cert = other.issue_credentials("admin", "admin")
    _store(root / "stranger", cert_pem(other.cert), key, cert)
    past = utcnow() - dt.timedelta(days=10)
    key, cert = ca.issue_credentials("admin", "admin", not_before=past,
                                     not_after=past + dt.timedelta(days=1))
    _store(root / "expired", ca_pem, key, cert)
    return Fleet(root, ca)


def agent_config(fleet: Fleet, state_dir: Path, node: str = "node-a", **overrides) -> AgentConfig:
    """A config whose pki/ holds `node`'s credentials; small drains and calibrations."""
    creds = fleet.creds(node)
    pki = state_dir / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    for path in (creds.ca_path, creds.cert_path, creds.key_path):
        (pki / path.name).write_bytes(path.read_bytes())
    base = dict(node=node, state_dir=state_dir, listen_host="127.0.0.1",
                listen_port=free_port(), drain_s=20.0, term_grace_s=2.0, kill_grace_s=2.0,
                heartbeat_interval_s=0.3, stage_port_first=free_port(),
                probe_max_bytes=8 << 20, probe_max_s=10.0)
    base["stage_port_last"] = base["stage_port_first"] + 20
    base.update(overrides)
    return AgentConfig(**base)


@contextlib.asynccontextmanager
async def serving_app(config: AgentConfig) -> AsyncIterator[tuple[str, web.Application]]:
    """The agent's app served in this process with mutual TLS; yields its URL and the app,
    whose state a test may wait on."""
    app = make_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.listen_host, config.listen_port,
                       ssl_context=server_context(NodeCredentials(config.pki_dir)))
    await site.start()
    try:
        yield f"https://{config.listen_host}:{config.listen_port}", app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(config: AgentConfig) -> AsyncIterator[str]:
    """The agent's app served in this process with mutual TLS; yields its URL."""
    async with serving_app(config) as (url, _app):
        yield url


@contextlib.asynccontextmanager
async def client(fleet: Fleet, name: str | None = "admin",
                 timeout_s: float = 60.0) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(ssl=fleet.client_ssl(name))
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        yield session


async def wait_state(session: aiohttp.ClientSession, url: str, engine_id: str, states: set[str],
                     timeout_s: float = 90.0) -> dict:
    async def in_state() -> dict | None:
        async with session.get(f"{url}/v1/engines/{engine_id}") as r:
            view = await r.json()
        return view if view.get("state") in states else None

    return await wait_until_async(in_state, within_s=timeout_s, what=f"{engine_id} in {states}",
                                  poll_s=0.2)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny"), CheckpointSpec())


FAKE_ENGINE = REPO / "tests/agent/fake_engine.py"


def fake_engine_command(*flags: str) -> tuple[str, ...]:
    return (sys.executable, str(FAKE_ENGINE), *flags)


class AgentProcess:
    """`python -m agent.cli run` as a real process (killed, never left behind)."""

    def __init__(self, config: AgentConfig, log_path: Path) -> None:
        self.config = config
        config_path = config.state_dir / "agent.yaml"
        import yaml

        config_path.write_text(yaml.safe_dump(config.to_dict()))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        standalone = [] if config.supervisor_url else ["--standalone"]  # no heartbeats
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config",
                                      str(config_path), *standalone], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"https://{config.listen_host}:{config.listen_port}"

    async def wait_up(self, fleet: Fleet, timeout_s: float = 60.0) -> None:
        async with client(fleet, timeout_s=5) as session:
            async def healthy() -> bool:
                assert self.proc.poll() is None, f"agent exited {self.proc.returncode}"
                try:
                    async with session.get(self.url + "/v1/health") as r:
                        return r.status == 200
                except (aiohttp.ClientError, OSError):
                    return False

            await wait_until_async(healthy, within_s=timeout_s, what="the agent's /v1/health",
                                   poll_s=0.2)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def read_records(config: AgentConfig) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(config.run_dir.glob("*.json"))]


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
