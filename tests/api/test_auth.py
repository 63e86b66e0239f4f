"""Rank 0's API with a per-replica secret (FLEET_API_SECRET_FILE), as the supervisor starts
it: every route but /health needs `Authorization: Bearer SECRET`, compared in constant time,
and a wrong or missing one gets an OpenAI-style 401. Without the variable (a standalone
`fleet-engine` or `engine.harness.launch`), the API stays open. Real engine processes, real HTTP."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine.env import EngineEnv, EnvError
from tests.api.conftest import serve

pytestmark = pytest.mark.timeout(180)


def call(url: str, *, body: dict | None = None, authorization: bytes | None = None,
         ) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    if authorization is not None:  # raw bytes: a header urllib would not encode by itself
        request.add_unredirected_header("Authorization", authorization.decode("latin-1"))
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def model_dir(make_model) -> Path:
    return make_model("qwen3")


def test_a_replica_secret_guards_every_route_but_health(model_dir, tmp_path):
    secret = secrets.token_hex(32)
    secret_file = tmp_path / "api.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    fleet = serve(model_dir, tmp_path / "run", context=128, parallel=2, chunk=32,
                  extra_env={"FLEET_API_SECRET_FILE": str(secret_file)})
    base = f"http://127.0.0.1:{fleet.http_port}"
    chat = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert call(base + "/health")[0] == 200  # the supervisor's probe carries no secret
        wrong = (None, b"", b"Bearer", b"Bearer " + secret[:-1].encode(),
                 b"Bearer " + secret.encode() + b"x", b"Basic " + secret.encode(),
                 b"Bearer \xe9" + secret.encode(), secret.encode())
        for path, body in (("/v1/chat/completions", chat), ("/v1/models", None),
                           ("/metrics", None), ("/v1/nowhere", None)):
            for authorization in wrong:
                status, reply = call(base + path, body=body, authorization=authorization)
                assert status == 401, (path, authorization, status, reply)
                assert reply["error"]["code"] == "invalid_api_key"
                assert "front door" in reply["error"]["message"]
                assert secret not in json.dumps(reply)
        status, models = call(base + "/v1/models", authorization=f"Bearer {secret}".encode())
        assert status == 200
        for scheme in (b"bearer", b"BEARER", b"bEaReR"):  # RFC 9110 11.1: any case
            assert call(base + "/v1/models",
                        authorization=scheme + b" " + secret.encode())[0] == 200, scheme
        chat["model"] = models["data"][0]["id"]
        status, reply = call(base + "/v1/chat/completions", body=chat,
                             authorization=f"Bearer {secret}".encode())
        assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
        # The secret never reaches the engine's log.
        assert secret not in (tmp_path / "run" / "rank0.log").read_text()
    finally:
        fleet.stop()


def test_a_standalone_engine_stays_open(model_dir, tmp_path):
    fleet = serve(model_dir, tmp_path, context=128, parallel=2, chunk=32)
    base = f"http://127.0.0.1:{fleet.http_port}"
    try:
        status, models = call(base + "/v1/models")
        assert status == 200
        status, reply = call(base + "/v1/completions", body={
            "model": models["data"][0]["id"], "prompt": "a", "max_tokens": 2})
        assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        fleet.stop()


@pytest.mark.parametrize(("content", "why"), [(None, "cannot read"), ("", "at least 16"),
                                              ("short", "at least 16"),
                                              ("é" * 20, "printable ASCII")])
def test_an_unusable_secret_file_stops_rank0_at_start(tmp_path, content, why):
    path = tmp_path / "api.secret"
    if content is not None:
        path.write_text(content)
    env = {"FLEET_MODEL": str(tmp_path), "FLEET_API_SECRET_FILE": str(path)}
    with pytest.raises(EnvError, match=f"FLEET_API_SECRET_FILE=.*{why}"):
        EngineEnv.from_environ(env)
    secret = "s" * 40
    path.write_text(secret)
    assert EngineEnv.from_environ(env).api_secret == secret
    assert secret not in repr(EngineEnv.from_environ(env))
