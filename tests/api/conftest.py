"""A real fleet-engine process (the whole model, one stage) and clients pointed at it."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from engine.harness.launch import launch


def serve(model_dir, tmp_path, **kwargs):
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    fleet = launch(model_dir, [(0, n_layers)], run_dir=tmp_path, **kwargs)
    fleet.wait_ready()
    return fleet


@pytest.fixture(scope="module")
def engine(make_model, tmp_path_factory):
    fleet = serve(make_model("qwen3"), tmp_path_factory.mktemp("engine"), context=256, parallel=4,
                  chunk=32)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def client(engine) -> OpenAI:
    return OpenAI(base_url=engine.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, str]:
    """A plain HTTP request (for what the openai client does not expose): status, text."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
