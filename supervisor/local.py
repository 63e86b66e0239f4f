"""A whole fleet on one machine, on loopback: a supervisor and N agents as real processes.

What the one-machine demo (`scripts/fleet_demo.py`) and the end-to-end tests run: `fleetctl
init`, `fleet-supervisor`, and per node a join token, `fleet-agent join` and `fleet-agent
run`, each with its own state directory under one root and its log in `root/logs/`. The
front door runs in the supervisor's process, or with `front_door_process=True` as
`fleet-front-door` of its own (the supervisor then runs with `--no-front-door`), as an
installed fleet runs it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import yaml

from engine.harness.launch import free_port, sigterm_unwinds

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


class LocalFleetError(RuntimeError):
    """A process of the local fleet failed to start or to answer; the message has its log."""


class LocalFleet:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("node-a", "node-b"), *,
                 supervisor_flags: tuple[str, ...] = (), agent_settings: dict | None = None,
                 engine_ports: int = 200, front_door_process: bool = False,
                 node_cpus: dict[str, set[int]] | None = None) -> None:
        self.root = root
        # node -> the CPUs its agent, and so every engine it spawns, may run on: nodes of
        # one machine kept off each other's cores, as separate machines are (a bench's
        # choice; None: every process may run anywhere).
        self.node_cpus = node_cpus or {}
        self.nodes = nodes
        self.supervisor_flags = supervisor_flags
        self.agent_settings = dict(heartbeat_interval_s=1.0, os_floor_bytes=256 << 20,
                                   drain_s=30.0, term_grace_s=3.0, kill_grace_s=2.0)
        self.agent_settings.update(agent_settings or {})
        self.address = f"{LOOPBACK}:{free_port()}"
        self.front_door = f"{LOOPBACK}:{free_port()}"
        first = 20000 + free_port() % 10000  # below the ephemeral range (32768 and up)
        self.engine_ports = f"{first}:{first + engine_ports}"
        self.state_dir = root / "supervisor"
        self.credentials = root / "fleetctl"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.front_door_process = front_door_process
        self._client = None  # supervisor.fleetctl.Client, once the credentials exist
        self.supervisor: subprocess.Popen | None = None
        self.front_door_proc: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.agent_ports: dict[str, int] = {}
        self._unwind = contextlib.ExitStack()  # inside `with`, SIGTERM unwinds to __exit__
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            PYTHONUNBUFFERED="1")

    @property
    def front_door_url(self) -> str:
        return f"http://{self.front_door}/v1"

    def _popen(self, args: list[str], log_name: str) -> subprocess.Popen:
        with open(self.logs / log_name, "ab") as log:
            return subprocess.Popen([sys.executable, *args], env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def fleetctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "supervisor.fleetctl", "--credentials",
                               str(self.credentials), *args], env=self.env, capture_output=True,
                              text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise LocalFleetError(f"fleetctl {' '.join(args)}: exit {done.returncode}\n"
                                  f"{done.stdout}{done.stderr}")
        return done

    def status(self) -> dict[str, Any]:
        """`fleetctl status`'s data, asked over the same authenticated API from this process:
        waits poll it every few tenths of a second, and a fleetctl process per poll cost
        about a core, which the fleet's own calibrations and rounds then timed as theirs."""
        from supervisor.fleetctl import Client, CtlError

        try:
            if self._client is None:
                self._client = Client(self.credentials, None)
            return self._client.call("GET", "/v1/status")
        except CtlError as exc:
            raise LocalFleetError(f"fleetctl status: {exc}") from exc

    # --- processes ------------------------------------------------------------------------
    def init(self) -> None:
        self.fleetctl("init", "--state-dir", str(self.state_dir), "--address", self.address)

    def start_supervisor(self, timeout_s: float = 30.0) -> None:
        front_door = (["--no-front-door"] if self.front_door_process
                      else ["--front-door", self.front_door])
        self.supervisor = self._popen(
            ["-m", "supervisor.main", "--state-dir", str(self.state_dir), "--listen",
             self.address, *front_door, "--engine-ports", self.engine_ports,
             *self.supervisor_flags], "supervisor.log")
        self.wait(lambda: self.fleetctl("status", check=False).returncode == 0, timeout_s,
                  "the supervisor to answer", "supervisor.log")

    def start_front_door(self, timeout_s: float = 30.0) -> None:
        """`fleet-front-door` with the credentials the supervisor made at its start."""
        self.front_door_proc = self._popen(
            ["-m", "supervisor.front_door_main", "--credentials",
             str(self.state_dir / "pki" / "front-door"), "--listen", self.front_door],
            "front-door.log")
        host, port = self.front_door.rsplit(":", 1)

        def listening() -> bool:
            if self.front_door_proc.poll() is not None:
                raise LocalFleetError(f"fleet-front-door exited {self.front_door_proc.returncode}"
                                      ":\n" + self.tail("front-door.log"))
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return True
            except OSError:
                return False
        self.wait(listening, timeout_s, "the front door to listen", "front-door.log")

    def agent_state_dir(self, node: str) -> Path:
        return self.root / "agents" / node

    def join(self, node: str) -> None:
        token = self.fleetctl("token", "--node", node).stdout.strip()
        port = self.agent_ports.setdefault(node, free_port())
        done = subprocess.run(  # the token on stdin: argv is readable by every local user
            [sys.executable, "-m", "agent.cli", "join", f"https://{self.address}", "--token",
             "-", "--node", node, "--state-dir", str(self.agent_state_dir(node)),
             "--listen", f"{LOOPBACK}:{port}"], input=token, env=self.env, capture_output=True,
            text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise LocalFleetError(f"fleet-agent join {node}: {done.stdout}{done.stderr}")

    def start_agent(self, node: str) -> None:
        state_dir = self.agent_state_dir(node)
        first = free_port(count=11)
        config = dict(self.agent_settings, node=node, state_dir=str(state_dir),
                      listen_host=LOOPBACK, listen_port=self.agent_ports[node],
                      supervisor_url=f"https://{self.address}",
                      stage_port_first=first, stage_port_last=first + 10)
        path = state_dir / "agent.yaml"
        path.write_text(yaml.safe_dump(config))
        self.agents[node] = self._popen(["-m", "agent.cli", "run", "--config", str(path)],
                                        f"agent-{node}.log")
        if node in self.node_cpus:  # before it spawns anything: its children inherit it
            os.sched_setaffinity(self.agents[node].pid, self.node_cpus[node])

    def start(self) -> None:
        """init, the supervisor, and every node joined and running; wait until all are alive."""
        self.init()
        self.start_supervisor()
        if self.front_door_process:
            self.start_front_door()
        for node in self.nodes:
            self.join(node)
            self.start_agent(node)
        self.wait_members(self.nodes)

    def wait_members(self, nodes: tuple[str, ...], timeout_s: float = 90.0) -> None:
        def alive() -> bool:
            members = {m["node"]: m for m in self.status()["members"]}
            return all(n in members and members[n]["state"] == "alive"
                       and members[n]["backends"] for n in nodes)
        self.wait(alive, timeout_s, f"{', '.join(nodes)} to be alive with facts")

    def wait_replica(self, model: str, state: str = "serving", timeout_s: float = 120.0,
                     where: Callable[[dict], bool] = lambda r: True) -> dict:
        found: dict = {}

        def ready() -> bool:
            nonlocal found
            for r in self.status()["replicas"]:
                if r["model_id"] == model and r["state"] == state and where(r):
                    found = r
                    return True
            return False
        self.wait(ready, timeout_s, f"a {state} replica of {model}")
        return found

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str,
             log_name: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.supervisor is not None and self.supervisor.poll() is not None:
                raise LocalFleetError(f"the supervisor exited {self.supervisor.returncode}:\n"
                                      + self.tail("supervisor.log"))
            try:
                if predicate():
                    return
            except LocalFleetError:
                pass
            time.sleep(0.3)
        raise LocalFleetError(f"timed out after {timeout_s} s waiting for {what}\n"
                              + self.tail(log_name or "supervisor.log"))

    def tail(self, log_name: str, lines: int = 30) -> str:
        path = self.logs / log_name
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop_supervisor(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        return _stop(self.supervisor, sig, timeout_s)

    def stop_front_door(self, timeout_s: float = 20.0) -> int | None:
        return _stop(self.front_door_proc, signal.SIGTERM, timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Agents first (they drain their engines and say goodbye), then the supervisor."""
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.agents.values():
            _stop(proc, signal.SIGTERM, timeout_s)
        self.stop_supervisor()
        self.stop_front_door(timeout_s)

    def __enter__(self) -> Self:
        """Started, and stopped again whatever happens after (a half-started fleet too, and
        on SIGTERM: its processes run in sessions of their own, which no signal to this
        one's reaches)."""
        self._unwind.enter_context(sigterm_unwinds())
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop(timeout_s=30)
        finally:
            self._unwind.close()


def _stop(proc: subprocess.Popen | None, sig: int, timeout_s: float) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: what it left behind too
            proc.wait(10)
    return proc.returncode
