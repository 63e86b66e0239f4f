"""README's "Running a fleet", followed as written: its fenced commands run in order with
real processes on loopback, in a temporary folder, and the fleet they build serves.

What is changed, and only that: the example LAN addresses become free loopback ports and
/var/lib/ringfleet a temporary folder; `sudo ` is dropped; `.venv/bin/X` are small scripts
in the temporary folder that run this checkout's X and keep the agent's files there too
(`--config`, `--state-dir`; `install-service` gets `--unit-dir`, so the unit is written but
no systemctl runs). The service is then started the way systemd would: its ExecStart line,
as a process. `fleet.yaml` is the test's own: one node, a tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent.install_service import UNIT_NAME
from engine.harness.launch import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def section_commands(markdown: str, heading: str) -> list[list[str]]:
    """Each ```sh block under `heading` (to the next heading of its level), as commands:
    backslash continuations joined, trailing comments dropped."""
    level = heading.split(" ", 1)[0]
    body = markdown.split(heading + "\n", 1)[1]
    body = re.split(rf"^{re.escape(level)} ", body, flags=re.MULTILINE)[0]
    blocks = []
    for block in re.findall(r"^```sh\n(.*?)^```", body, flags=re.DOTALL | re.MULTILINE):
        commands, pending = [], ""
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).rstrip()
            line = line.strip() if pending else line
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            if pending + line:
                commands.append((pending + line).strip())
            pending = ""
        blocks.append(commands)
    return blocks


def test_section_commands_joins_continuations_and_drops_comments():
    text = ("## Running a fleet\n\n```sh\na --x 1 \\\n    --y 2   # why\nb  # more\n```\n"
            "text\n```sh\nc\n```\n## Next\n```sh\nnot this\n```\n")
    assert section_commands(text, "## Running a fleet") == [["a --x 1 --y 2", "b"], ["c"]]


SHIMS = {
    "fleetctl": 'exec "$PY" -m supervisor.fleetctl "$@"',
    # Fast calibrations, and engine ports of its own beside other tests on this machine.
    "fleet-supervisor": ('exec "$PY" -m supervisor.main "$@" --calibration-budget-s 2 '
                         '--engine-ports "$ENGINE_PORTS"'),
    "fleet-front-door": 'exec "$PY" -m supervisor.front_door_main "$@"',
    "fleet-agent": '''sub="$1"; shift
case "$sub" in
  join) set -- "$@" --state-dir "$AGENT_STATE" ;;
  install-service) set -- "$@" --unit-dir "$UNITS" ;;
esac
exec "$PY" -m agent.cli "$sub" "$@" --config "$AGENT_CONFIG"''',
}

FLEET_YAML = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: gb10, labels: {{backend: torch-cpu}}}}
models:
  - id: tiny
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 512
    parallel: 2
    chunk: 64
"""


class Readme:
    """The README's commands run in `root`, each checked, with the processes they leave."""

    def __init__(self, root: Path, checkpoint: Path) -> None:
        self.root = root
        self.work = root / "work"
        (self.work / ".venv/bin").mkdir(parents=True)
        self.supervisor_address = f"127.0.0.1:{free_port()}"
        self.front_door = f"127.0.0.1:{free_port()}"
        self.agent_address = f"127.0.0.1:{free_port()}"
        self.state_dir = root / "supervisor"
        self.agent_config = root / "agent" / "agent.yaml"
        self.units = root / "units"
        first = 20000 + free_port() % 10000  # below the ephemeral range
        self.env = dict(os.environ, HOME=str(root / "home"), PY=sys.executable,
                        PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                        ENGINE_PORTS=f"{first}:{first + 50}", AGENT_STATE=str(root / "agent"),
                        AGENT_CONFIG=str(self.agent_config), UNITS=str(self.units))
        self.env.pop("FLEETCTL_DIR", None)
        self.env.pop("FLEETCTL_FLEET", None)
        for name, body in SHIMS.items():
            shim = self.work / ".venv/bin" / name
            shim.write_text("#!/bin/sh\n" + body + "\n")
            shim.chmod(0o755)
        # What the operator would put in agent.yaml for a small machine shared with other
        # tests; join keeps these and adds its own.
        self.agent_config.parent.mkdir(parents=True)
        stage = free_port() % 10000 + 40000
        self.agent_config.write_text(yaml.safe_dump(dict(
            os_floor_bytes=256 << 20, heartbeat_interval_s=0.5, drain_s=20.0,
            stage_port_first=stage, stage_port_last=stage + 20)))
        (self.work / "fleet.yaml").write_text(FLEET_YAML.format(
            address=self.supervisor_address, state_dir=self.state_dir, checkpoint=checkpoint))
        self.background: list[subprocess.Popen] = []
        self.logs = root / "logs"
        self.logs.mkdir()

    def local(self, command: str) -> str:
        for example, here in (("192.168.1.10:7400", self.supervisor_address),
                              ("192.168.1.10:8000", self.front_door),
                              ("192.168.1.20:7700", self.agent_address),
                              ("/var/lib/ringfleet", str(self.state_dir))):
            command = command.replace(example, here)
        return command.removeprefix("sudo ")

    def run(self, command: str) -> subprocess.CompletedProcess:
        command = self.local(command)
        if command.endswith("&"):  # a server the README leaves running
            with open(self.logs / f"background-{len(self.background)}.log", "ab") as log:
                self.background.append(subprocess.Popen(
                    ["sh", "-c", "exec " + command[:-1]], cwd=self.work, env=self.env,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            return subprocess.CompletedProcess(command, 0, "", "")
        done = subprocess.run(["sh", "-c", command], cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=400, check=False)
        assert done.returncode == 0, f"$ {command}\n{done.stdout}{done.stderr}"
        return done

    def start_service(self) -> None:
        """The installed unit's ExecStart, as systemd would run it."""
        unit = (self.units / UNIT_NAME).read_text()
        [exec_start] = [line.split("=", 1)[1] for line in unit.splitlines()
                        if line.startswith("ExecStart=")]
        with open(self.logs / "agent-service.log", "ab") as log:
            self.background.append(subprocess.Popen(
                shlex.split(exec_start), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))

    def fleetctl_json(self, *args: str) -> dict:
        return json.loads(self.run(".venv/bin/fleetctl --json " + " ".join(args)).stdout)

    def stop(self) -> None:
        for proc in reversed(self.background):  # the agent drains first, then the supervisor
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_readme_fleet_commands_work_as_written(tmp_path):
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "model", CheckpointSpec())  # the smallest: fast
    blocks = section_commands((REPO / "README.md").read_text(), "### Running a fleet")
    assert len(blocks) == 3, blocks  # the supervisor's machine, a node, the supervisor again
    on_supervisor, on_node, then = blocks
    readme = Readme(tmp_path, checkpoint)
    try:
        for command in on_supervisor:
            readme.run(command)
            if command.endswith("&"):
                wait_until(lambda: listening(readme.supervisor_address), within_s=60,
                           what="the supervisor to listen")
        token = readme.work / "gb10.token"
        assert token.read_text().startswith("rf1.")
        assert token.stat().st_mode & 0o777 == 0o600  # --out: readable by its owner only

        said = [readme.run(command).stdout for command in on_node]
        config = yaml.safe_load(readme.agent_config.read_text())
        assert config["supervisor_url"] == f"https://{readme.supervisor_address}"
        assert f"{config['listen_host']}:{config['listen_port']}" == readme.agent_address
        assert config["node"] == "gb10" and config["os_floor_bytes"] == 256 << 20
        assert "the service runs:" in said[1] and "warning" not in said[1]  # the dry run
        assert f"heartbeats to https://{readme.supervisor_address}" in said[2]
        readme.start_service()

        def gb10_alive() -> bool:
            members = {m["node"]: m for m in readme.fleetctl_json("status")["members"]}
            return "gb10" in members and members["gb10"]["state"] == "alive" and bool(
                members["gb10"]["backends"])

        wait_until(gb10_alive, within_s=90, what="gb10 to be alive with its facts")
        outputs = {}
        for command in then:
            if "revoke" in command:  # first: the applied fleet serves (apply returns once
                # its placement is final; the engine may still be loading)
                wait_until(lambda: [r["state"] for r in readme.fleetctl_json("status")[
                    "replicas"] if r["model_id"] == "tiny"] == ["serving"], within_s=120,
                    what="the tiny model to be served")
                # The front door is a process of its own that polls the supervisor's routes:
                # it learns of the serving replica a poll later.
                wait_until(lambda: front_door_serves(readme.front_door, "tiny"), within_s=30,
                           what="the front door to route to the tiny model")
                answer_through_front_door(readme.front_door)
            outputs[command] = readme.run(command).stdout
        assert "gb10" in outputs[".venv/bin/fleetctl status"]
    finally:
        readme.stop()


def front_door_serves(front_door: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{front_door}/health", timeout=5) as reply:
            return model in json.loads(reply.read())["serving"]
    except (OSError, ValueError):  # 503 (HTTPError is an OSError) until it routes there
        return False


def answer_through_front_door(front_door: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{front_door}/v1", api_key="none", max_retries=0)
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert reply.choices and reply.usage.completion_tokens >= 1
