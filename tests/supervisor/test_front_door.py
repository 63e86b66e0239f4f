"""The front door's client semantics against a fake rank 0 served in-process: 503 with
Retry-After before the first byte, an SSE error and no finish_reason after it, 404 for a
model the fleet does not serve, 401 without an API key."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from engine.launch import free_port
from supervisor.front_door import FrontDoorConfig, Route, make_front_door


def chunk(text: str, finish: str | None = None) -> bytes:
    body = {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


async def upstream_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["messages"][0]["content"]
    if mode == "503":
        return web.json_response({"error": {"message": "draining"}}, status=503,
                                 headers={"Retry-After": "2"})
    if mode == "close":  # lost before the first byte
        request.transport.close()
        await asyncio.sleep(0.1)
        return web.Response()
    if not body.get("stream"):
        return web.json_response({"choices": [{"message": {"content": "hi"},
                                               "finish_reason": "stop"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("one"))
    await response.write(chunk("two"))
    if mode == "cut":  # lost after tokens were sent
        await asyncio.sleep(0.05)
        request.transport.abort()
        await asyncio.sleep(0.1)
        return response
    await response.write(chunk("", "stop"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def with_door(check, api_keys: frozenset[str] = frozenset()) -> None:
    up = web.Application()
    up.router.add_post("/v1/chat/completions", upstream_handler)
    up_runner = web.AppRunner(up)
    await up_runner.setup()
    up_port, door_port, closed_port = free_port(), free_port(), free_port()
    await web.TCPSite(up_runner, "127.0.0.1", up_port).start()

    def router(model: str | None) -> Route:
        if model == "m":
            return Route(url=f"http://127.0.0.1:{up_port}", replica="m-g1")
        if model == "gone":
            return Route(url=f"http://127.0.0.1:{closed_port}", replica="gone-g1")
        if model == "idle":
            return Route(status=503, message="model 'idle' has no serving replica now")
        return Route(status=404, message=f"model {model!r} is not served by this fleet")

    door = make_front_door(FrontDoorConfig(router, lambda: [{"id": "m", "serving": True}],
                                           api_keys))
    door_runner = web.AppRunner(door)
    await door_runner.setup()
    await web.TCPSite(door_runner, "127.0.0.1", door_port).start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{door_port}") as session:
            await check(session)
    finally:
        await door_runner.cleanup()
        await up_runner.cleanup()


def ask(model: str, content: str = "hello", stream: bool = False) -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}


def run(check, **kw) -> None:
    asyncio.run(with_door(check, **kw))


def test_whole_and_streamed_replies_pass_through():
    async def check(s: aiohttp.ClientSession) -> None:
        async with s.post("/v1/chat/completions", json=ask("m")) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "stop"
            assert r.headers["X-Ringfleet-Replica"] == "m-g1"
        async with s.post("/v1/chat/completions", json=ask("m", stream=True)) as r:
            text = await r.text()
        assert r.status == 200 and text.endswith("data: [DONE]\n\n") and '"error"' not in text
        async with s.get("/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "m"
    run(check)


def test_before_the_first_byte_is_a_503_with_retry_after():
    async def check(s: aiohttp.ClientSession) -> None:
        for body in (ask("idle"), ask("gone"), ask("gone", stream=True), ask("m", "close"),
                     ask("m", "close", stream=True)):
            async with s.post("/v1/chat/completions", json=body) as r:
                payload = await r.json()
                assert r.status == 503, body
                assert int(r.headers["Retry-After"]) > 0
                assert payload["error"]["code"] == "unavailable" and payload["error"]["message"]
        async with s.post("/v1/chat/completions", json=ask("m", "503")) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "2"  # the engine's own
    run(check)


def test_lost_after_tokens_ends_with_an_sse_error_and_no_finish_reason():
    async def check(s: aiohttp.ClientSession) -> None:
        async with s.post("/v1/chat/completions", json=ask("m", "cut", stream=True)) as r:
            assert r.status == 200
            text = await r.text()
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["one", "two"]
        assert "error" in events[-1] and events[-1]["error"]["code"] == "unavailable"
        assert all(c.get("finish_reason") is None for e in events for c in e.get("choices", []))
        assert "[DONE]" not in text
    run(check)


def test_unknown_model_and_bad_bodies_are_named():
    async def check(s: aiohttp.ClientSession) -> None:
        async with s.post("/v1/chat/completions", json=ask("nope")) as r:
            payload = await r.json()
            assert r.status == 404 and payload["error"]["code"] == "model_not_found"
            assert "'nope'" in payload["error"]["message"]
        async with s.post("/v1/chat/completions", data=b"{") as r:
            assert r.status == 400
    run(check)


def test_api_keys_when_configured():
    async def check(s: aiohttp.ClientSession) -> None:
        async with s.post("/v1/chat/completions", json=ask("m")) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.post("/v1/chat/completions", json=ask("m"),
                          headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.post("/v1/chat/completions", json=ask("m"),
                          headers={"Authorization": "Bearer k1"}) as r:
            assert r.status == 200
    run(check, api_keys=frozenset({"k1"}))
