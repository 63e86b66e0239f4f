"""The API's app owns the round loop: it starts with the app, and shutting the app down ends
every stream in flight with an answer (a 503, an SSE error event) before the loop stops.

A real model, lane host and API in this process over real HTTP on loopback; the one fault
injected is a round that stalls, so that requests are certainly in flight at shutdown."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from engine.api.connections import GuardedSite
from engine.api.metrics import EngineMetrics
from engine.api.schema import ServedModel
from engine.api.server import CONNECTIONS, ROUND_LOOP, SHUTTING_DOWN, ApiConfig, make_app
from engine.backends.base import StageSpec, load_stage
from engine.harness.launch import free_port
from engine.lanes.host import LaneHost
from engine.lanes.text import TextCodec
from tests.stalling_runner import StallingRunner
from tests.waiting import wait_until_async


def test_shutting_the_app_down_answers_every_stream_in_flight_then_stops_the_loop(make_model):
    model_dir = make_model("qwen3")
    spec = StageSpec(model_dir, (0, 3), "torch-cpu", parallel=4, context=256, chunk=32)
    codec = TextCodec(model_dir)
    runner = StallingRunner(load_stage(spec), free_rounds=4)  # the stream sends tokens first

    async def main() -> None:
        host = LaneHost(runner, codec, chunk=32, max_waiting=4)
        app = make_app(host, ApiConfig(ServedModel("m", 256, codec.vocab_size, codec), "p"),
                       EngineMetrics(host.slots_in_use, lambda: len(host.waiting)))
        web_runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=20)
        await web_runner.setup()
        loop_task = app[ROUND_LOOP]
        assert not loop_task.done(), "the app did not start its round loop"
        port = free_port()
        await GuardedSite(web_runner, "127.0.0.1", port, app[CONNECTIONS]).start()
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = dict(model="m", prompt="the cat sat on", max_tokens=100, temperature=0)
        cleaned = False
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                streamed = await session.post(url, json=dict(body, stream=True))
                whole = asyncio.create_task(session.post(url, json=body))
                events = []
                async for line in streamed.content:  # the first token arrived
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))
                        if events[-1]["choices"][0]["text"]:
                            break
                await wait_until_async(
                    lambda: runner.stalled.is_set() and host.slots_in_use() == 2,
                    within_s=20, what="both requests hold a slot while a round stalls")
                await web_runner.cleanup()
                cleaned = True
                # The loop stopped, after the streams had ended with the shutdown's reason.
                assert loop_task.done() and host.failure == SHUTTING_DOWN
                rest = [line[6:].strip() async for line in streamed.content
                        if line.startswith(b"data: ")]
                assert streamed.status == 200 and rest and b"[DONE]" not in rest
                last = json.loads(rest[-1])
                assert last["error"]["code"] == "unavailable"
                assert SHUTTING_DOWN in last["error"]["message"]
                reply = await whole
                assert reply.status == 503 and reply.headers["Retry-After"]
                assert SHUTTING_DOWN in (await reply.json())["error"]["message"]
        finally:
            runner.release.set()
            if not cleaned:
                await web_runner.cleanup()

    asyncio.run(main())
