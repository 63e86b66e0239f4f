"""One stream's fault ends that stream alone: a real model, lane host and API in this process,
real HTTP on loopback, and a fault injected into one stream's sampler or text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

import engine.lanes.host as lane_host
from engine.api.connections import GuardedSite
from engine.api.metrics import EngineMetrics
from engine.api.schema import ServedModel
from engine.api.server import CONNECTIONS, ROUND_LOOP, ApiConfig, make_app
from engine.backends.base import StageSpec, load_stage
from engine.harness.launch import free_port
from engine.lanes.host import LaneHost
from engine.lanes.sampler import Sampler
from engine.lanes.text import TextCodec, TextStream
from engine.pipeline.runner import LocalRunner
from tests.waiting import wait_until_async

POISON_SEED = 666  # the sampler of a stream with this seed fails after its third token
POISON_STOP = "poison-stop"  # the text of a stream with this stop string fails at once


class FaultySampler(Sampler):
    def take(self, sampled, i, top_logprobs):
        if self.params.seed == POISON_SEED and self.drawn >= 3:
            raise ValueError("injected sampler fault")
        return super().take(sampled, i, top_logprobs)


class FaultyText(TextStream):
    def push(self, token_id: int) -> str:
        if POISON_STOP in self.stops:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected text fault")
        return super().push(token_id)


@pytest.fixture
def faulty(monkeypatch):
    monkeypatch.setattr(lane_host, "Sampler", FaultySampler)
    monkeypatch.setattr(lane_host, "TextStream", FaultyText)


def serve_in_process(model_dir: Path, scenario) -> None:
    """Run `scenario(session, base_url, host)` against a real API over a real model."""
    spec = StageSpec(model_dir, (0, 3), "torch-cpu", parallel=4, context=256, chunk=32)
    codec = TextCodec(model_dir)
    runner = LocalRunner(load_stage(spec))

    async def main() -> None:
        host = LaneHost(runner, codec, chunk=32, max_waiting=4)
        metrics = EngineMetrics(host.slots_in_use, lambda: len(host.waiting))
        app = make_app(host, ApiConfig(ServedModel("m", 256, codec.vocab_size, codec), "p"),
                       metrics)
        web_runner = web.AppRunner(app, handler_cancellation=True)
        await web_runner.setup()  # the app starts its round loop
        try:
            port = free_port()
            await GuardedSite(web_runner, "127.0.0.1", port, app[CONNECTIONS]).start()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                await scenario(session, f"http://127.0.0.1:{port}", host)
            assert not app[ROUND_LOOP].done(), "the round loop ended"
            assert host.failure is None
        finally:
            await web_runner.cleanup()  # and stops it

    asyncio.run(main())


async def sse_events(response: aiohttp.ClientResponse) -> list:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


async def wait_for_free_slots(host: LaneHost, timeout_s: float = 10.0) -> None:
    await wait_until_async(lambda: host.slots_in_use() == 0, within_s=timeout_s,
                           what="every slot free again (a failed stream keeps none)")


def body(**fields) -> dict:
    return dict(model="m", prompt="the cat sat on", max_tokens=12, temperature=0.7, **fields)


def test_a_sampler_fault_ends_only_its_own_stream(make_model, faulty):
    async def scenario(session, base, host):
        url = f"{base}/v1/completions"
        bystander = session.post(url, json=body(stream=True, seed=1))
        poisoned_stream = session.post(url, json=body(stream=True, seed=POISON_SEED))
        poisoned_whole = session.post(url, json=body(seed=POISON_SEED))
        async with bystander as b, poisoned_stream as ps, poisoned_whole as pw:
            kept, cut, whole = await asyncio.gather(sse_events(b), sse_events(ps), pw.json())
            statuses = b.status, ps.status, pw.status
        assert statuses == (200, 200, 500)
        # The bystander ran every round with the poisoned streams and finished normally.
        assert kept[-1] == "[DONE]" and kept[-2]["choices"][0]["finish_reason"] == "length"
        # The poisoned stream had sent tokens: an error event, no finish_reason, no [DONE].
        assert "[DONE]" not in cut and cut[-1]["error"]["code"] == "request_failed"
        assert "injected sampler fault" in cut[-1]["error"]["message"]
        assert any(e.get("choices", [{}])[0].get("text") for e in cut[:-1])
        assert all(e.get("choices", [{}])[0].get("finish_reason") is None for e in cut[:-1])
        # Not streamed: a 500 that is not retryable, with an OpenAI-style body.
        assert whole["error"]["type"] == "server_error"
        assert whole["error"]["code"] == "request_failed" and "Retry-After" not in pw.headers
        await wait_for_free_slots(host)
        async with session.post(url, json=body(seed=2)) as again:
            assert again.status == 200 and (await again.json())["choices"][0]["text"]

    serve_in_process(make_model("qwen3"), scenario)


def test_a_text_fault_before_the_first_token_is_a_500_and_the_engine_serves_on(
        make_model, faulty):
    async def scenario(session, base, host):
        url = f"{base}/v1/chat/completions"
        chat = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        async with session.post(url, json=dict(chat, stop=[POISON_STOP], stream=True)) as r:
            assert r.status == 500  # nothing was sent yet: a plain error, not a retryable 503
            error = (await r.json())["error"]
            assert error["code"] == "request_failed" and "injected text fault" in error["message"]
        await wait_for_free_slots(host)
        async with session.get(f"{base}/health") as health:
            assert health.status == 200
        async with session.post(url, json=chat) as ok:
            assert ok.status == 200
            assert (await ok.json())["choices"][0]["finish_reason"] in ("stop", "length")

    serve_in_process(make_model("qwen3"), scenario)


def test_a_bug_in_the_round_loop_fails_the_engine_with_its_reason(make_model, monkeypatch):
    """Not a stream's fault: the loop itself. It must end with `failure` set, not raise."""
    spec = StageSpec(make_model("qwen3"), (0, 3), "torch-cpu", parallel=2, context=64, chunk=16)
    runner = LocalRunner(load_stage(spec))
    host = LaneHost(runner, TextCodec(spec.model_dir), chunk=16, max_waiting=1)

    def broken_round(inputs):
        raise KeyError("injected loop bug")

    monkeypatch.setattr(lane_host, "build_round", broken_round)

    async def main():
        stream = host.submit(lane_host.GenerationRequest((1, 2, 3), max_tokens=2))
        await asyncio.wait_for(host.run(), 10)  # returns: never raises
        return await asyncio.wait_for(stream.events.get(), 1)

    event = asyncio.run(main())
    host.close()
    assert "injected loop bug" in host.failure and "KeyError" in host.failure
    assert isinstance(event, lane_host.Failed) and not event.per_request
