"""The fleet's credentials with real processes on loopback (a supervisor, two agents, a
one-stage replica on node-a): rank 0 answers only requests that bear its replica's secret,
which the front door adds; a node's certificate speaks for its own engines only and the
certificate pinned at its join is the only one accepted for its name; tokens name their node;
a second join for a member's name is refused until it is revoked; joins read the token from
a file or stdin; state, credentials and secrets are owner-only, and a replica's secret files
go when it ends. The tests share one fleet and run in file order.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agent.pki import FleetCA, NodeCredentials, cert_pem
from supervisor.local import LocalFleet

pytestmark = pytest.mark.timeout(240)
MODEL = "demo"
FLEET = """version: 1
supervisor: {{address: "{address}", state_dir: "{state_dir}"}}
nodes:
  - {{name: node-a}}
  - {{name: node-b}}
"""
MODELS = """models:
  - id: demo
    checkpoint: {checkpoint}
    backends: [torch-cpu]
    context: 256
    parallel: 2
    chunk: 64
    placement:
      - {{node: node-a, layers: "0:8"}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("fleet"), supervisor_flags=(
        "--tick-s", "0.2", "--calibration-budget-s", "0", "--drain-s", "5"),
        agent_settings=dict(heartbeat_interval_s=0.3)) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def replica(fleet, checkpoint) -> dict:
    path = fleet.root / "fleet.yaml"
    path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir)
                    + MODELS.format(checkpoint=checkpoint))
    fleet.fleetctl("apply", str(path))
    return fleet.wait_replica(MODEL, timeout_s=120)


def http(url: str, body: dict | None = None, headers: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def as_node(fleet: LocalFleet, creds: NodeCredentials) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(fleet.state_dir / "pki" / "ca.pem"))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    return ctx


def agent_creds(fleet: LocalFleet, node: str) -> NodeCredentials:
    return NodeCredentials(fleet.agent_state_dir(node) / "pki")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello."}], **kw}


def test_rank0_needs_the_secret_that_the_front_door_adds(fleet, replica):
    secret = (fleet.state_dir / "keys" / f"{replica['id']}.api").read_text()
    url = replica["url"]  # what `fleetctl status` prints
    assert http(url + "/health")[0] == 200
    for headers in ({}, {"Authorization": "Bearer not-the-secret"},
                    {"Authorization": "Bearer none"}):
        status, body = http(url + "/v1/chat/completions", chat_body(), headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    status, body = http(fleet.front_door_url + "/chat/completions", chat_body(),
                        {"Authorization": "Bearer whatever-the-client-sends"})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    status, _ = http(url + "/v1/chat/completions", chat_body(),
                     {"Authorization": f"Bearer {secret}"})
    assert status == 200
    link_key = (fleet.state_dir / "keys" / f"{replica['id']}.key").read_text()
    shown = fleet.fleetctl("--json", "status").stdout + fleet.fleetctl("status").stdout
    assert url in shown and secret not in shown and link_key not in shown


def test_state_credentials_and_secrets_are_owner_only(fleet, replica):
    state = fleet.state_dir
    for directory in (state, state / "pki", state / "keys", fleet.credentials,
                      fleet.agent_state_dir("node-a"), fleet.agent_state_dir("node-a") / "pki",
                      fleet.agent_state_dir("node-a") / "keys"):
        assert mode(directory) == 0o700, directory
    engine = replica["stages"][0]["engine_id"]
    files = [state / "supervisor.sqlite", state / "supervisor.sqlite-wal",
             state / "supervisor.sqlite-shm", state / "pki" / "ca.key",
             state / "keys" / f"{replica['id']}.key", state / "keys" / f"{replica['id']}.api",
             fleet.agent_state_dir("node-a") / "keys" / f"{engine}.key",
             fleet.agent_state_dir("node-a") / "keys" / f"{engine}.api",
             agent_creds(fleet, "node-a").key_path, fleet.credentials / "node.key"]
    for path in files:
        assert mode(path) == 0o600, path


def test_a_node_speaks_only_for_its_own_engines_with_its_pinned_certificate(fleet, replica):
    rank0 = replica["stages"][0]["engine_id"]
    forged = {"node": "node-b", "events": [{
        "seq": 1, "engine_id": rank0, "state": "exited", "at": 0,
        "detail": {"replica": replica["id"], "rank": 0, "code": 1,
                   "reason": "rank 0 exited"}}]}
    base = f"https://{fleet.address}/v1/nodes"
    node_b = as_node(fleet, agent_creds(fleet, "node-b"))
    status, body = http(f"{base}/node-b/events", forged, context=node_b)
    assert status == 403 and "runs on node 'node-a'" in body["error"]["message"], body
    beat = {"url": "https://127.0.0.1:1", "engines": [
        {"engine_id": rank0, "replica": replica["id"], "rank": 0, "state": "exited"}]}
    assert http(f"{base}/node-b/heartbeat", beat, context=node_b)[0] == 403
    assert http(f"{base}/node-a/goodbye", {"reason": "forged"}, context=node_b)[0] == 403
    # A certificate that names node-a, signed by the fleet CA (as a token made for any name
    # used to give), is not the one pinned when node-a joined.
    ca = FleetCA.load(fleet.state_dir / "pki")
    key, cert = ca.issue_credentials("node-a", "agent")
    twin = NodeCredentials(fleet.root / "twin")
    twin.store(cert_pem(ca.cert), cert, key)
    for path, body in (("events", dict(forged, node="node-a")), ("goodbye", {"reason": "x"})):
        status, reply = http(f"{base}/node-a/{path}", body, context=as_node(fleet, twin))
        assert status == 403 and "not the one pinned" in reply["error"]["message"], reply
    now = fleet.status()
    [same] = [r for r in now["replicas"] if r["id"] == replica["id"]]
    assert (same["state"], same["since"]) == ("serving", replica["since"])
    assert {m["node"]: m["state"] for m in now["members"]}["node-a"] == "alive"
    assert http(fleet.front_door_url + "/chat/completions", chat_body())[0] == 200


def test_a_token_names_its_node_and_lives_a_finite_time(fleet):
    done = fleet.fleetctl("token", check=False)
    assert done.returncode == 2 and "--node" in done.stderr
    for ttl in ("nan", "inf", "-1", "0"):
        done = fleet.fleetctl("token", "--node", "n", "--ttl-s", ttl, check=False)
        assert done.returncode == 2 and "--ttl-s" in done.stderr, (ttl, done.stderr)


def join(fleet: LocalFleet, node: str, state_dir: Path, *how: str,
         stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "join", f"https://{fleet.address}", *how,
         "--node", node, "--state-dir", str(state_dir), "--listen", "127.0.0.1:1"],
        input=stdin, env=fleet.env, capture_output=True, text=True, timeout=60, check=False)


def token_file(fleet: LocalFleet, node: str) -> Path:
    path = fleet.root / f"{node}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(fleet.fleetctl("token", "--node", node).stdout)
    return path


def test_a_members_name_joins_again_only_after_a_revoke(fleet, replica):
    done = join(fleet, "node-a", fleet.root / "impostor", "--token-file",
                str(token_file(fleet, "node-a")))
    assert done.returncode == 2 and "already a member" in done.stderr, done.stderr
    assert "fleetctl revoke node-a" in done.stderr
    assert not (fleet.root / "impostor" / "pki" / "node.pem").exists()
    first = fleet.root / "node-c-1"
    done = join(fleet, "node-c", first, "--token-file", str(token_file(fleet, "node-c")))
    assert done.returncode == 0 and "joined as node-c" in done.stdout, done.stderr
    assert mode(first) == 0o700 and mode(first / "pki" / "node.key") == 0o600
    done = join(fleet, "node-c", fleet.root / "node-c-2", "--token", "-",
                stdin=fleet.fleetctl("token", "--node", "node-c").stdout)
    assert done.returncode == 2 and "already a member" in done.stderr
    assert "revoked" in fleet.fleetctl("revoke", "node-c").stdout
    done = join(fleet, "node-c", fleet.root / "node-c-2", "--token", "-",
                stdin=fleet.fleetctl("token", "--node", "node-c").stdout)
    assert done.returncode == 0, done.stderr
    status, body = http(f"https://{fleet.address}/v1/nodes/node-c/heartbeat",
                        {"url": "https://127.0.0.1:1", "engines": []},
                        context=as_node(fleet, NodeCredentials(first / "pki")))
    assert status == 403 and "revoked" in body["error"]["message"]
    assert serving_unchanged(fleet, replica)


def serving_unchanged(fleet: LocalFleet, replica: dict) -> bool:
    [same] = [r for r in fleet.status()["replicas"] if r["id"] == replica["id"]]
    return (same["state"], same["since"]) == ("serving", replica["since"])


def test_a_replicas_secret_files_go_when_it_ends(fleet, replica):
    engine = replica["stages"][0]["engine_id"]
    files = [fleet.state_dir / "keys" / f"{replica['id']}.key",
             fleet.state_dir / "keys" / f"{replica['id']}.api",
             fleet.agent_state_dir("node-a") / "keys" / f"{engine}.key",
             fleet.agent_state_dir("node-a") / "keys" / f"{engine}.api"]
    assert all(path.exists() for path in files)
    path = fleet.root / "no-models.yaml"
    path.write_text(FLEET.format(address=fleet.address, state_dir=fleet.state_dir))
    fleet.fleetctl("apply", str(path))
    fleet.wait_replica(MODEL, "stopped", timeout_s=60, where=lambda r: r["id"] == replica["id"])
    fleet.wait(lambda: not any(p.exists() for p in files), 30,
               "the replica's key and secret files to be deleted")
