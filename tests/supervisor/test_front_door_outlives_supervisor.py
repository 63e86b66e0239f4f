"""Serving outlives the supervisor: a fleet whose front door is `fleet-front-door`, a process
of its own, as real processes on loopback (a supervisor, one agent, one torch-cpu stage).
Four clients keep asking through the front door (whole replies and streams, a bounded count
and time) while the supervisor is killed with `kill -9` and started again once the front door
has noticed and answered every client meanwhile:
no request fails, requests are answered while the supervisor is down, and the front door
re-syncs its routes from the supervisor that came back; then, the supervisor down again, a
front door restarted serves from the routes it kept on disk."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from supervisor.local import LocalFleet
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
MODEL = "demo"
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a, labels: {{backend: torch-cpu}}}}
models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 512
    parallel: 4
    chunk: 64
    placement:
      - {{node: node-a, layers: "0:8"}}
"""
CLIENTS = 4
MAX_REQUESTS_PER_CLIENT = 400


class Client(threading.Thread):
    """Asks again and again until told to stop (or its count is spent); every answer that is
    not a whole reply (a status other than 200, a stream without `[DONE]`, an error) is a
    failure."""

    def __init__(self, url: str, stream: bool, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stream, self.stop = url + "/chat/completions", stream, stop
        self.answered: list[float] = []  # when each whole reply ended (monotonic)
        self.failures: list[str] = []

    def ask(self) -> None:
        body = {"model": MODEL, "max_tokens": 4, "stream": self.stream,
                "messages": [{"role": "user", "content": "Say hello."}]}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            self.failures.append(f"HTTP {exc.code}: {exc.read()[:200]!r}")
            return
        except OSError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return
        if self.stream and not text.rstrip().endswith("data: [DONE]"):
            self.failures.append(f"an incomplete stream: {text[-200:]!r}")
            return
        self.answered.append(time.monotonic())

    def run(self) -> None:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if self.stop.is_set():
                return
            self.ask()


def synced_count(fleet: LocalFleet) -> int:
    path = fleet.logs / "front-door.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return text.count("routes synced from the supervisor")


def test_killing_the_supervisor_mid_load_fails_no_request(tmp_path: Path, checkpoint):
    with LocalFleet(tmp_path, nodes=("node-a",), front_door_process=True, supervisor_flags=(
            "--tick-s", "0.2", "--calibration-budget-s", "0"),
            agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        path = tmp_path / "fleet.yaml"
        path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir,
                                     checkpoint=checkpoint))
        fleet.fleetctl("apply", "--no-wait", str(path))
        fleet.wait_replica(MODEL, timeout_s=120)
        warm = Client(fleet.front_door_url, False, threading.Event())
        fleet.wait(lambda: (warm.ask(), bool(warm.answered))[1], 30,
                   "the front door to route to the serving replica", "front-door.log")
        assert fleet.fleetctl("status").stdout.count("fleet-front-door (its own process)") == 1

        stop = threading.Event()
        clients = [Client(fleet.front_door_url, i % 2 == 1, stop) for i in range(CLIENTS)]
        for client in clients:
            client.start()
        try:
            fleet.wait(lambda: all(c.answered for c in clients), 60, "every client answered")
            syncs = synced_count(fleet)
            killed_at = time.monotonic()
            assert fleet.stop_supervisor(signal.SIGKILL) == -signal.SIGKILL
            # Down until the front door has noticed and every client was answered since.
            wait_until(lambda: "supervisor not reachable" in (
                fleet.logs / "front-door.log").read_text() and all(
                    c.answered and c.answered[-1] > killed_at for c in clients),
                within_s=60, what="answers while the supervisor is down")
            fleet.start_supervisor()
            back_at = time.monotonic()
            fleet.wait(lambda: synced_count(fleet) > syncs, 30,
                       "the front door to re-sync its routes", "front-door.log")
            after = sum(len(c.answered) for c in clients)
            fleet.wait(lambda: sum(len(c.answered) for c in clients) >= after + CLIENTS, 60,
                       "requests answered after the re-sync")
        finally:
            stop.set()
            for client in clients:
                client.join(90)
        failures = [f for c in clients for f in c.failures]
        assert failures == [], failures
        while_down = sum(killed_at < t < back_at for c in clients for t in c.answered)
        assert while_down > 0, "nothing was answered while the supervisor was down"
        log = (fleet.logs / "front-door.log").read_text()
        assert "supervisor not reachable; serving from the last routes" in log
        routes_file = fleet.state_dir / "pki" / "front-door" / "routes.json"
        assert routes_file.stat().st_mode & 0o777 == 0o600

        # A front door restarted while the supervisor is down serves from the routes it kept.
        assert fleet.stop_supervisor(signal.SIGKILL) == -signal.SIGKILL
        fleet.supervisor = None  # gone for good: `fleet.wait` stops at an exited supervisor
        assert fleet.stop_front_door() == 0
        fleet.start_front_door()
        restarted = Client(fleet.front_door_url, True, threading.Event())
        restarted.ask()
        assert restarted.failures == [] and restarted.answered
        assert "serving from the routes kept on disk" in (
            fleet.logs / "front-door.log").read_text()
