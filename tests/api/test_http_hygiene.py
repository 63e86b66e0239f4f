"""HTTP hygiene on rank 0's API, against a real fleet-engine process on loopback:
bounded metrics labels, slowloris and connection floods closed while /health answers,
big prompts tokenized off the event loop, repeated errors logged once per interval, and
an unexpected failure that still exits with one structured line."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.client import HTTPConnection

import psutil
import pytest

from engine.harness.launch import LOOPBACK, launch
from tests.api.conftest import http, serve
from tests.waiting import wait_until

HEADER_S = 1.5
IDLE_S = 3.0
BODY_S = 2.0
CAP = 48
DRIP_INTERVAL_S = 0.1  # a slowloris client sends a header line this often
PROBE_INTERVAL_S = 0.02  # /health sampled this often while a big prompt is read


@pytest.fixture(scope="module")
def guarded(make_model, tmp_path_factory):
    fleet = serve(make_model("qwen3"), tmp_path_factory.mktemp("guarded"), context=256,
                  parallel=2, chunk=32,
                  extra_env={"FLEET_HTTP_HEADER_S": str(HEADER_S),
                             "FLEET_HTTP_IDLE_S": str(IDLE_S), "FLEET_HTTP_BODY_S": str(BODY_S),
                             "FLEET_HTTP_MAX_CONNECTIONS": str(CAP)})
    yield fleet
    fleet.stop()


def base(fleet) -> str:
    return fleet.url.removesuffix("/v1")


def health_latency_s(fleet, timeout_s: float = 5.0) -> float:
    started = time.monotonic()
    status, _ = http("GET", f"{base(fleet)}/health")
    assert status == 200
    return time.monotonic() - started


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed this socket (what it sent before is skipped)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_unknown_paths_do_not_grow_metrics(guarded):
    before = http("GET", f"{base(guarded)}/metrics")[1]
    connection = HTTPConnection(LOOPBACK, guarded.http_port, timeout=10)
    for i in range(600):
        connection.request("GET", f"/scan/{i}/{'x' * (i % 50)}")
        reply = connection.getresponse()
        reply.read()
        assert reply.status == 404
    connection.close()
    after = http("GET", f"{base(guarded)}/metrics")[1]
    assert "/scan/" not in after
    assert 'endpoint="unmatched",status="404"' in after
    assert len(after) - len(before) < 1000  # one new series at most, not one per path


def test_slowloris_connections_are_closed_while_health_answers(guarded):
    slow = []
    for _ in range(20):
        sock = socket.create_connection((LOOPBACK, guarded.http_port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    opened = time.monotonic()
    latencies = []
    while not all(closed_by_peer(s) for s in slow):
        assert time.monotonic() - opened < HEADER_S + 3, "slow connections were held open"
        for s in slow:
            try:
                s.send(b"X-Drip: 1\r\n")  # a header line now and then, never the end
            except OSError:
                pass
        latencies.append(health_latency_s(guarded))
        time.sleep(DRIP_INTERVAL_S)  # the attack's own pace, not a wait for anything
    held_s = time.monotonic() - opened
    for s in slow:
        s.close()
    assert held_s < HEADER_S + 3
    assert latencies and max(latencies) < 1.0


def test_a_dripping_body_gets_a_408_and_an_idle_connection_is_closed(guarded):
    with socket.create_connection((LOOPBACK, guarded.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - started < BODY_S + 2
    with socket.create_connection((LOOPBACK, guarded.http_port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answered = time.monotonic()
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        wait_until(lambda: closed_by_peer(sock), within_s=IDLE_S + 3,
                   what="an idle connection closed by the server")
        assert time.monotonic() - answered > IDLE_S - 0.5  # idle, not refused


def test_connections_past_the_cap_are_refused_at_once_and_service_resumes(guarded):
    idle = [socket.create_connection((LOOPBACK, guarded.http_port), timeout=5)
            for _ in range(CAP + 12)]
    try:
        refused = []
        for sock in idle[CAP:]:
            sock.settimeout(2.0)  # well before the header deadline closes the idle ones
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
            refused.append(data)
        assert all(r.startswith(b"HTTP/1.1 503") and b"too_many_connections" in r
                   for r in refused)
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: http("GET", f"{base(guarded)}/health")[0] == 200, within_s=10,
               what="/health answering after the flood")


def test_a_request_sent_past_the_cap_reads_the_503_not_a_reset(guarded):
    """A client that sends its whole request at once (as every HTTP client does) must read
    the refusal: closing with that request unread would answer with a reset instead."""
    body = json.dumps({"model": "m", "prompt": "x" * (256 << 10), "max_tokens": 1}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    idle = [socket.create_connection((LOOPBACK, guarded.http_port), timeout=5)
            for _ in range(CAP)]
    try:
        answers = []
        for _ in range(6):  # well inside the header deadline that frees the idle ones
            with socket.create_connection((LOOPBACK, guarded.http_port), timeout=5) as sock:
                try:
                    sock.sendall(request)
                    answers.append(read_until_closed(sock))
                except ConnectionResetError as exc:
                    answers.append(repr(exc).encode())
        assert all(a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a
                   for a in answers), [a[:60] for a in answers]
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: http("GET", f"{base(guarded)}/health")[0] == 200, within_s=10,
               what="/health answering after the flood")


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_a_megabyte_prompt_does_not_stall_health(guarded):
    model = json.loads(http("GET", f"{guarded.url}/models")[1])["data"][0]["id"]
    words = "the quick brown fox jumps over the lazy dog; héllo wörld 北京 "
    prompt = (words * (1_000_000 // len(words))).encode()[:1_000_000].decode(errors="ignore")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 4}, ensure_ascii=False).encode()
    assert len(body) < 1 << 20
    reply = {}
    big = threading.Thread(target=lambda: reply.update(zip(
        ("status", "text"), http("POST", f"{guarded.url}/chat/completions", body))))
    big.start()
    latencies = []
    while big.is_alive():
        latencies.append(health_latency_s(guarded))
        time.sleep(PROBE_INTERVAL_S)  # how often /health is sampled while the prompt is read
    big.join()
    assert reply["status"] == 400  # it was read and tokenized: too long for the context
    assert json.loads(reply["text"])["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s while tokenizing"
    assert len(latencies) >= 3, "the big prompt was answered too fast to measure anything"


def test_compressed_bodies_are_decoded_within_the_bound(guarded):
    """A gzip request is served; a gzip bomb gets its 413 from the bounded decoder
    (tests/api/test_bodies.py shows it stops at the bound) and /health answers after it."""
    import gzip
    import urllib.error
    import urllib.request

    from tests.api.test_bodies import gzip_bomb

    def post(data: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(f"{guarded.url}/chat/completions", data=data,
                                         headers={"Content-Type": "application/json",
                                                  "Content-Encoding": "gzip"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    model = json.loads(http("GET", f"{guarded.url}/models")[1])["data"][0]["id"]
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, reply = post(gzip.compress(json.dumps(chat).encode()))
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
    status, reply = post(gzip_bomb(64 << 20))
    assert status == 413 and "larger than" in reply["error"]["message"]
    assert health_ok(guarded)


def test_a_taken_api_port_exits_with_one_structured_line(make_model, tmp_path):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        fleet = launch(make_model("qwen3"), [(0, 3)], run_dir=tmp_path, context=64,
                       http_port=taken.getsockname()[1])
        try:
            code = fleet.processes[0].wait(120)
        finally:
            fleet.stop()
    assert code == 1
    lines = fleet.log_paths[0].read_text().splitlines()
    assert all(line.startswith("{") for line in lines), "\n".join(lines)  # no raw traceback
    exits = [e for e in fleet.events(0) if e.get("event") == "exiting"]
    assert len(exits) == 1 and exits[0]["code"] == 1
    assert "rank 0 failed" in exits[0]["reason"] and "OSError" in exits[0]["reason"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prlimit on another process")
def test_running_out_of_descriptors_logs_one_line_per_interval(make_model, tmp_path):
    import os
    import resource

    fleet = serve(make_model("qwen3"), tmp_path, context=64, parallel=1, chunk=16,
                  extra_env={"FLEET_HTTP_HEADER_S": "2", "FLEET_HTTP_MAX_CONNECTIONS": "100000"})
    try:
        pid = fleet.processes[0].pid
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        _soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 8, hard))
        flood = [socket.create_connection((LOOPBACK, fleet.http_port), timeout=5)
                 for _ in range(60)]
        # The flood sits in the backlog while accept() fails with EMFILE, retried each second.
        wait_until(lambda: "socket.accept() out of system resource" in fleet.log_tail(0, 200),
                   within_s=10, what="accept failing for want of descriptors")
        process = psutil.Process(pid)
        cpu_before, wall_before = sum(process.cpu_times()[:2]), time.monotonic()
        # The connections accepted before the limit close at their header deadline (2 s),
        # by which time accept() has failed and been retried at least twice more: the
        # window is the test (a spinning accept loop would take the whole CPU meanwhile).
        wait_until(lambda: "no request headers in time" in fleet.log_tail(0, 200),
                   within_s=10, what="the accepted connections closed at their deadline")
        cpu_s = sum(process.cpu_times()[:2]) - cpu_before
        wall_s = time.monotonic() - wall_before
        for sock in flood:
            sock.close()
        wait_until(lambda: health_ok(fleet), within_s=15, what="/health coming back")
        # And a real request is served again, not only /health.
        model = json.loads(http("GET", f"{fleet.url}/models")[1])["data"][0]["id"]
        status, text = http("POST", f"{fleet.url}/completions", json.dumps(
            {"model": model, "prompt": "the cat", "max_tokens": 3}).encode())
        assert status == 200 and json.loads(text)["choices"][0]["finish_reason"], text
        assert fleet.processes[0].poll() is None
    finally:
        fleet.stop()
    print(f"rank 0 short of descriptors: {cpu_s:.2f} CPU s in {wall_s:.2f} s")
    assert cpu_s < 0.5 * wall_s, (cpu_s, wall_s)
    lines = fleet.log_paths[0].read_text().splitlines()
    assert all(line.startswith("{") for line in lines), "a raw traceback reached the log"
    accept_lines = [e for e in fleet.events(0)
                    if e.get("event", "").startswith("socket.accept() out of system")]
    assert 1 <= len(accept_lines) <= 2, accept_lines


def health_ok(fleet) -> bool:
    try:
        return http("GET", f"{base(fleet)}/health")[0] == 200
    except OSError:
        return False


