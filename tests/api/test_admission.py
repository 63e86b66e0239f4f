"""Admission: 503 with Retry-After when slots and queue are full; a client that leaves frees
its slot at once."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.api.conftest import http, serve
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def one_slot(make_model, tmp_path_factory):
    fleet = serve(make_model("llama"), tmp_path_factory.mktemp("one-slot"), context=4096,
                  parallel=1, chunk=64, extra_env={"FLEET_MAX_WAITING": "0"})
    yield fleet
    fleet.stop()


def slots_in_use(fleet) -> float:
    base = fleet.url.removesuffix("/v1")
    for line in http("GET", f"{base}/metrics")[1].splitlines():
        if line.startswith("ringfleet_slots_in_use "):
            return float(line.split()[1])
    raise AssertionError("no slots gauge")


def test_busy_gets_503_with_retry_after_and_a_leaving_client_frees_its_slot(one_slot):
    client = OpenAI(base_url=one_slot.url, api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    long = client.completions.create(model=model, prompt="a long one", max_tokens=4000,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(long))  # the stream holds the only slot
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=model, prompt="me too", max_tokens=2)
    assert raised.value.status_code == 503
    assert raised.value.response.headers["Retry-After"] == "1"
    assert raised.value.body["type"] == "server_error"
    long.close()  # the client goes away mid-stream
    wait_until(lambda: slots_in_use(one_slot) == 0, within_s=10,
               what="the slot given back once its client went away")
    assert client.completions.create(model=model, prompt="now", max_tokens=2).choices
