"""`fleet-front-door`'s systemd unit under a real systemd (booted in a namespace where this
machine allows it), with no supervisor anywhere: the front door serves from the routes it
kept on disk, a `kill -9` of it is restarted by systemd and serves again from the same file,
and `systemctl stop` stops it."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.install_service import render_systemd_unit
from agent.pki import write_private
from engine.harness.launch import free_port
from supervisor.issuing import ensure_front_door_credentials, init_pki
from supervisor.route_table import ModelRoutes, ReplicaRoute, RouteTable
from tests.agent.systemd_namespace import SystemdInNamespace, why_systemd_cannot_run
from tests.waiting import wait_until

WHY_NOT = why_systemd_cannot_run()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"no systemd here: {WHY_NOT}")
REPO = Path(__file__).resolve().parents[2]
UNIT_NAME = "fleet-front-door.service"
SECRET = "the-replica-secret"


class StandInRank0(BaseHTTPRequestHandler):
    """A rank 0 that answers a completion when the front door brings the replica's secret."""

    def do_GET(self) -> None:  # /health
        self.answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Authorization") != f"Bearer {SECRET}":
            self.answer(401, {"error": {"message": "no secret"}})
            return
        self.answer(200, {"object": "text_completion", "choices": [
            {"index": 0, "text": "served", "finish_reason": "length"}]})

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def completion(front_door: str) -> str:
    request = urllib.request.Request(
        f"http://{front_door}/v1/completions", data=json.dumps(
            {"model": "m", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer client-key"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def answers(front_door: str) -> bool:
    try:
        return completion(front_door) == "served"
    except OSError:
        return False


def test_the_unit_serves_from_kept_routes_and_systemd_restarts_a_killed_front_door(tmp_path):
    state_dir = tmp_path / "supervisor"
    supervisor = f"127.0.0.1:{free_port()}"  # nothing listens there: the supervisor is away
    init_pki(state_dir, supervisor, tmp_path / "fleetctl")
    from agent.pki import FleetCA

    creds = ensure_front_door_credentials(state_dir, FleetCA.load(state_dir / "pki"), supervisor)
    rank0 = ThreadingHTTPServer(("127.0.0.1", 0), StandInRank0)
    threading.Thread(target=rank0.serve_forever, daemon=True).start()
    table = RouteTable((ModelRoutes("m", 1, True, (ReplicaRoute(
        "m-g1", f"http://127.0.0.1:{rank0.server_port}", SECRET),)),),
        api_keys=frozenset({"client-key"}))
    write_private(creds.directory / "routes.json", table.to_json())
    front_door = f"127.0.0.1:{free_port()}"

    systemd = SystemdInNamespace(tmp_path / "systemd")
    try:
        systemd.boot()
        unit = render_systemd_unit((REPO / "systemd" / UNIT_NAME).read_text(), [
            sys.executable, "-m", "supervisor.front_door_main", "--credentials",
            str(creds.directory), "--listen", front_door], 30)
        (systemd.units / UNIT_NAME).write_text(unit)
        systemd.systemctl("daemon-reload")
        systemd.systemctl("start", UNIT_NAME)
        wait_until(lambda: answers(front_door), within_s=60,
                   what="the front door to serve from its kept routes")

        killed = int(systemd.show(UNIT_NAME, "MainPID"))
        systemd.inside("kill", "-KILL", str(killed))
        wait_until(lambda: int(systemd.show(UNIT_NAME, "MainPID")) not in (0, killed)
                   and systemd.show(UNIT_NAME, "ActiveState") == "active", within_s=60,
                   what="systemd to restart the front door")
        assert systemd.show(UNIT_NAME, "NRestarts") == "1"
        wait_until(lambda: answers(front_door), within_s=60,
                   what="the restarted front door to serve with the supervisor still away")

        systemd.systemctl("stop", UNIT_NAME, timeout_s=60)
        assert systemd.show(UNIT_NAME, "ActiveState") == "inactive"
        assert not answers(front_door)
    except AssertionError as exc:  # what the unit said, for the reader of the failure
        status = systemd.systemctl("status", "-l", UNIT_NAME, check=False)
        raise AssertionError(f"{exc}\n{status.stdout}{status.stderr}") from None
    finally:
        systemd.shutdown()
        rank0.shutdown()
