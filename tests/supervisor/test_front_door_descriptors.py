"""`fleet-front-door` short of file descriptors, as a real process in front of a real rank 0
(a fleet-engine process over a generated checkpoint), with no supervisor: started under a
low RLIMIT_NOFILE, its connection cap follows the limit and a flood of idle connections past
the cap is refused with the 503 while a real completion still gets its answer once the flood
goes; with its limit lowered under it (so the cap no longer saves it), accept() failing
for want of descriptors neither kills it nor spins, a request that cannot open its upstream
connection gets the 503 without the replica being held suspect, and it serves again once
the flood closes."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from agent.pki import FleetCA, write_private
from engine.harness.launch import LOOPBACK, free_port, launch
from supervisor.issuing import ensure_front_door_credentials, init_pki
from supervisor.route_table import ModelRoutes, ReplicaRoute, RouteTable
from tests.waiting import log_has_event, wait_until

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="prlimit of another process and /proc/PID/fd")]
PRLIMIT = shutil.which("prlimit")
NOFILE_AT_START = 64  # the front door's cap is then max(8, 64 // 2 // 2) = 16
CAP_AT_START = 16
FLOOD = 40  # idle connections, bounded: past either cap, far under the test's own limit


@pytest.fixture(scope="module")
def rank0(make_model, tmp_path_factory):
    fleet = launch(make_model("qwen3"), [(0, 3)], context=128, parallel=2, chunk=32,
                   run_dir=tmp_path_factory.mktemp("rank0"))
    try:
        fleet.wait_ready()
        with urllib.request.urlopen(fleet.url + "/models", timeout=10) as reply:
            fleet.model_id = json.loads(reply.read())["data"][0]["id"]
        yield fleet
    finally:
        fleet.stop()


class FrontDoor:
    """`fleet-front-door` serving kept routes to `rank0`, its log in `log`."""

    def __init__(self, root: Path, rank0, nofile: int | None = None,
                 poll_s: float = 0.5) -> None:
        state_dir = root / "supervisor"
        supervisor = f"{LOOPBACK}:{free_port()}"  # nothing listens there
        init_pki(state_dir, supervisor, root / "fleetctl")
        creds = ensure_front_door_credentials(state_dir, FleetCA.load(state_dir / "pki"),
                                              supervisor)
        self.model = rank0.model_id
        table = RouteTable((ModelRoutes(self.model, 2, True, (ReplicaRoute(
            "m-g1", f"http://{LOOPBACK}:{rank0.http_port}"),)),))
        write_private(creds.directory / "routes.json", table.to_json())
        self.address = (LOOPBACK, free_port())
        self.log = root / "front-door.log"

        # util-linux's prlimit sets the soft limit and execs, so the front door starts under it
        limit = [] if nofile is None else [PRLIMIT, f"--nofile={nofile}:"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*limit, sys.executable, "-m", "supervisor.front_door_main", "--credentials",
                 str(creds.directory), "--listen", f"{LOOPBACK}:{self.address[1]}",
                 "--poll-s", str(poll_s)],
                stdout=out, stderr=out)
        # Ready by its log, not by a request: a connection of ours would still hold a
        # descriptor there for a moment after it closed, and spoil the count taken next.
        wait_until(lambda: self.alive() and log_has_event(self.log, "front door open")
                   and log_has_event(self.log, "supervisor not reachable; serving from the "
                                     "last routes"), within_s=60,
                   what="the front door open, its first poll of the absent supervisor done")

    def alive(self) -> bool:
        assert self.proc.poll() is None, f"the front door exited:\n{self.log_tail()}"
        return True

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def url(self, path: str) -> str:
        return f"http://{LOOPBACK}:{self.address[1]}{path}"

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def completion(door: FrontDoor) -> tuple[int, dict]:
    """A real completion through the front door: (status, body); 0 when not connected."""
    request = urllib.request.Request(door.url("/v1/completions"), data=json.dumps(
        {"model": door.model, "prompt": "the cat", "max_tokens": 3}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}") | {"retry_after":
                                                          exc.headers.get("Retry-After")}
    except OSError:
        return 0, {}


def read_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        pass
    return data


@pytest.mark.skipif(PRLIMIT is None, reason="no prlimit (util-linux) to start it under")
def test_a_low_descriptor_limit_lowers_the_cap_and_a_flood_is_refused_cleanly(rank0, tmp_path):
    door = FrontDoor(tmp_path, rank0, nofile=NOFILE_AT_START)
    try:
        flood = [socket.create_connection(door.address, timeout=5) for _ in range(FLOOD)]
        try:
            # Past the cap each connection gets the 503 at once and is closed; those under it
            # sit idle until their header deadline.
            refused = [read_all(sock, 2.0) for sock in flood[CAP_AT_START:]]
            assert all(r.startswith(b"HTTP/1.1 503") and b"too_many_connections" in r
                       and b"Retry-After:" in r for r in refused), refused[:2]
            status, body = completion(door)  # while the cap is taken: the same clean 503
            assert status == 503 and body["error"]["code"] == "too_many_connections", body
        finally:
            for sock in flood:
                sock.close()
        answered: list[dict] = []

        def served() -> bool:
            status, body = completion(door)
            answered.append(body)
            return status == 200

        wait_until(served, within_s=15, what="a real completion once the flood closed")
        assert answered[-1]["choices"][0]["text"] is not None
        assert door.alive()
    finally:
        door.stop()


def test_accept_failing_for_want_of_descriptors_neither_kills_nor_spins(rank0, tmp_path):
    # Polled once only: each poll of the absent supervisor frees a descriptor for a moment,
    # which would let the request below find one.
    door = FrontDoor(tmp_path, rank0, poll_s=3600)
    try:
        pid = door.proc.pid
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        _soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 4, hard))
        process = psutil.Process(pid)
        flood = [socket.create_connection(door.address, timeout=5) for _ in range(FLOOD)]
        try:
            # The first few are accepted; the rest wait in the backlog while accept() fails
            # with EMFILE and is retried (asyncio: once a second).
            wait_until(lambda: door.alive() and b"socket.accept() out of system resource"
                       in door.log.read_bytes(), within_s=10,
                       what="accept failing for want of descriptors")
            cpu_before, wall_before = sum(process.cpu_times()[:2]), time.monotonic()
            # An accepted connection's request finds no descriptor for its upstream: a 503,
            # and rank 0 is not blamed for it.
            ask = json.dumps({"model": door.model, "prompt": "x", "max_tokens": 1}).encode()
            flood[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nConnection: close\r\n"
                             + f"Content-Length: {len(ask)}\r\n\r\n".encode() + ask)
            reply = read_all(flood[0], 10.0)
            assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After:" in reply, reply[:300]
            assert b"out of connections" in reply, reply[-300:]
            # The accepted ones close at their header deadline (5 s): the window is the test.
            wait_until(lambda: door.alive() and b"no request headers in time"
                       in door.log.read_bytes(), within_s=15,
                       what="the accepted idle connections closed at their deadline")
            cpu_s = sum(process.cpu_times()[:2]) - cpu_before
            wall_s = time.monotonic() - wall_before
        finally:
            for sock in flood:
                sock.close()
        print(f"short of descriptors: {cpu_s:.2f} CPU s in {wall_s:.2f} s")
        assert cpu_s < 0.5 * wall_s, (cpu_s, wall_s)  # a spinning accept loop takes all
        # The flood gone, the very next completion is served: the replica was never suspect.
        wait_until(lambda: door.health() == 200, within_s=15, what="/health again")
        status, body = completion(door)
        assert status == 200, body
        assert door.alive()
    finally:
        door.stop()
    lines = door.log.read_text(errors="replace").splitlines()
    assert all(line.startswith("{") for line in lines if line.strip()), \
        "a raw traceback reached the log"
