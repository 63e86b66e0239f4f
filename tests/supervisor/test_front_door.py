"""The front door's client semantics against a fake rank 0 served in-process (a fault
injector: it answers what each test needs, stalls or cuts): 503 with Retry-After before the
first byte, an SSE error and no finish_reason after it, an engine's reply about one request
passed through as it is, 404 for a model the fleet does not serve, 401 without an API key
(a non-ASCII one too), a failed or silent replica's relays ended, and the listener's limits
(slow heads and bodies, the connection cap)."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from engine.api.connections import HttpLimits
from engine.harness.launch import free_port
from supervisor.front_door import (
    LINGERING_S,
    MAX_BODY_BYTES,
    FrontDoorConfig,
    Route,
    front_door_limits,
    open_front_door,
)
from supervisor.relays import Relays, UpstreamSilence
from tests.waiting import wait_until_async

QUICK_SILENCE = UpstreamSilence(keepalive_s=0.25, dead_after=3)  # 0.75 s without a sign


def chunk(text: str, finish: str | None = None) -> bytes:
    body = {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


@dataclass
class Upstream:
    """What the fake rank 0 saw, and a switch that freezes it (no reply, no /health)."""

    frozen: bool = False
    health_asks: int = 0
    authorizations: list[str | None] = field(default_factory=list)
    cancelled: int = 0


UPSTREAM = web.AppKey("upstream", Upstream)


async def forever() -> None:
    await asyncio.Event().wait()


async def upstream_health(request: web.Request) -> web.Response:
    request.app[UPSTREAM].health_asks += 1
    if request.app[UPSTREAM].frozen:
        await forever()
    return web.json_response({"status": "ok"})


async def upstream_handler(request: web.Request) -> web.StreamResponse:
    seen = request.app[UPSTREAM]
    seen.authorizations.append(request.headers.get("Authorization"))
    body = await request.json()
    mode = body["messages"][0]["content"]
    try:
        return await _reply(request, body, mode)
    except asyncio.CancelledError:
        seen.cancelled += 1
        raise


async def live_handler(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"choices": [{"message": {"content": "hi"},
                                           "finish_reason": "stop"}]})


async def _reply(request: web.Request, body: dict, mode: str) -> web.StreamResponse:
    if mode == "503":
        return web.json_response({"error": {"message": "draining"}}, status=503,
                                 headers={"Retry-After": "2"})
    if mode == "503-bare":
        return web.json_response({"error": {"message": "busy"}}, status=503)
    if mode in ("400", "500"):  # about this request alone
        return web.json_response({"error": {"message": f"it was a {mode}", "type": "x",
                                            "param": "temperature", "code": None}},
                                 status=int(mode), headers={"X-Engine": "1"})
    if mode == "close":  # lost before the first byte
        request.transport.close()
        await asyncio.sleep(0.1)  # the fake upstream's behaviour: gone, then a late return
        return web.Response()
    if mode == "hang":
        await forever()
    if mode == "slow-whole":  # thinks for longer than the silence bound, alive throughout
        await asyncio.sleep(4 * QUICK_SILENCE.limit_s)  # behaviour: a long, live silence
    if not body.get("stream"):
        return web.json_response({"choices": [{"message": {"content": "hi"},
                                               "finish_reason": "stop"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("one"))
    await response.write(chunk("two"))
    if mode == "cut":  # lost after tokens were sent
        await asyncio.sleep(0.05)  # behaviour, not synchronisation: a loss after a pause
        request.transport.abort()
        await asyncio.sleep(0.1)  # behaviour: the handler returns late, after the loss
        return response
    if mode == "stall":  # tokens, then nothing more
        await forever()
    if mode == "engine-error":  # the engine's own error event, long, then a clean end
        error = {"message": "the engine failed mid-stream: " + "why " * 200,
                 "type": "server_error", "param": None, "code": "unavailable"}
        await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
        await response.write_eof()
        return response
    await response.write(chunk("", "stop"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@dataclass
class Door:
    session: aiohttp.ClientSession
    port: int
    config: FrontDoorConfig
    upstream: Upstream


async def with_door(check: Callable[[Door], Awaitable[None]], **config: object) -> None:
    up = web.Application()
    up[UPSTREAM] = Upstream()
    up.router.add_post("/v1/chat/completions", upstream_handler)
    up.router.add_get("/health", upstream_health)
    up_runner = web.AppRunner(up, handler_cancellation=True)
    await up_runner.setup()
    up_port, door_port, closed_port = free_port(), free_port(), free_port()
    await web.TCPSite(up_runner, "127.0.0.1", up_port).start()
    live = web.Application()  # a second fake rank 0 that is never frozen and always answers
    live[UPSTREAM] = Upstream()
    live.router.add_post("/v1/chat/completions", live_handler)
    live.router.add_get("/health", upstream_health)
    live_runner = web.AppRunner(live, handler_cancellation=True)
    await live_runner.setup()
    live_port = free_port()
    await web.TCPSite(live_runner, "127.0.0.1", live_port).start()

    def router(model: str | None, conversation: str | None = None) -> Route:
        if model == "m":
            return Route(url=f"http://127.0.0.1:{up_port}", replica="m-g1",
                         api_secret="replica-secret")
        if model == "gone":
            return Route(url=f"http://127.0.0.1:{closed_port}", replica="gone-g1")
        if model == "pair":  # two replicas: the first one's rank 0 is gone
            return Route(url=f"http://127.0.0.1:{closed_port}", replica="pair-g1",
                         fallbacks=(Route(url=f"http://127.0.0.1:{up_port}",
                                          replica="pair-g2", api_secret="replica-secret"),))
        if model == "twice":  # two replicas on the same fake rank 0: both answer alike
            same = Route(url=f"http://127.0.0.1:{up_port}", replica="twice-g1")
            return Route(url=same.url, replica="twice-g2", fallbacks=(same,))
        if model == "frozen":  # the fake rank 0 (frozen by the test) first, then a live one
            return Route(url=f"http://127.0.0.1:{up_port}", replica="pair-a", fallbacks=(
                Route(url=f"http://127.0.0.1:{live_port}", replica="pair-b"),))
        if model == "idle":
            return Route(status=503, message="model 'idle' has no serving replica now")
        return Route(status=404, message=f"model {model!r} is not served by this fleet")

    door_config = FrontDoorConfig(router, lambda: [{"id": "m", "serving": True}], **config)
    door_runner = await open_front_door(door_config, "127.0.0.1", door_port)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{door_port}") as session:
            await asyncio.wait_for(check(Door(session, door_port, door_config, up[UPSTREAM])),
                                   60)
    finally:
        await door_runner.cleanup()
        await up_runner.cleanup()
        await live_runner.cleanup()


def ask(model: str, content: str = "hello", stream: bool = False) -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}


def run(check, **kw) -> None:
    asyncio.run(with_door(check, **kw))


def events_of(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def streamed(door: Door, what: str) -> tuple[str, list[dict]]:
    """A streamed reply of the stand-in engine's `what` case through the door: its text and
    events, the first two of which carried the tokens "one" and "two"."""
    async with door.session.post("/v1/chat/completions", json=ask("m", what, stream=True)) as r:
        assert r.status == 200
        text = await r.text()
    events = events_of(text)
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["one", "two"]
    return text, events


async def raw_exchange(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Bytes sent on a fresh connection; everything read back until the door closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_whole_and_streamed_replies_pass_through():
    async def check(door: Door) -> None:
        s = door.session
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
    async def check(door: Door) -> None:
        s = door.session
        for body in (ask("idle"), ask("gone"), ask("gone", stream=True), ask("m", "close"),
                     ask("m", "close", stream=True)):
            async with s.post("/v1/chat/completions", json=body) as r:
                payload = await r.json()
                assert r.status == 503, body
                assert int(r.headers["Retry-After"]) > 0
                assert payload["error"]["code"] == "unavailable" and payload["error"]["message"]
        async with s.post("/v1/chat/completions", json=ask("m", "503")) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "2"  # the engine's own
        async with s.post("/v1/chat/completions", json=ask("m", "503-bare")) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) > 0  # busy: retry later
    run(check)


def test_a_reply_about_one_request_passes_through_as_it_is():
    """A 400 or a 500 about this request is no reason to retry: no Retry-After is added."""
    async def check(door: Door) -> None:
        for status in (400, 500):
            for stream in (False, True):
                async with door.session.post("/v1/chat/completions",
                                             json=ask("m", str(status), stream)) as r:
                    body = await r.json()
                    assert r.status == status and "Retry-After" not in r.headers
                    assert body["error"] == {"message": f"it was a {status}", "type": "x",
                                             "param": "temperature", "code": None}
    run(check)


def test_lost_after_tokens_ends_with_an_sse_error_and_no_finish_reason():
    async def check(door: Door) -> None:
        text, events = await streamed(door, "cut")
        assert "error" in events[-1] and events[-1]["error"]["code"] == "unavailable"
        assert all(c.get("finish_reason") is None for e in events for c in e.get("choices", []))
        assert "[DONE]" not in text
    run(check)


def test_the_engines_own_error_event_passes_through_alone_however_long():
    async def check(door: Door) -> None:
        _, events = await streamed(door, "engine-error")
        errors = [e for e in events if "error" in e]  # the engine's, and no second one
        assert len(errors) == 1 and errors[0]["error"]["message"].startswith("the engine failed")
    run(check)


def test_unknown_model_and_bad_bodies_are_named():
    async def check(door: Door) -> None:
        async with door.session.post("/v1/chat/completions", json=ask("nope")) as r:
            payload = await r.json()
            assert r.status == 404 and payload["error"]["code"] == "model_not_found"
            assert "'nope'" in payload["error"]["message"]
        async with door.session.post("/v1/chat/completions", data=b"{") as r:
            assert r.status == 400
    run(check)


def test_api_keys_when_configured():
    async def check(door: Door) -> None:
        s = door.session
        async with s.post("/v1/chat/completions", json=ask("m")) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.post("/v1/chat/completions", json=ask("m"),
                          headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.post("/v1/chat/completions", json=ask("m"),
                          headers={"Authorization": "Bearer k1"}) as r:
            assert r.status == 200
        for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive
            async with s.post("/v1/chat/completions", json=ask("m"),
                              headers={"Authorization": f"{scheme} k1"}) as r:
                assert r.status == 200, scheme
        async with s.post("/v1/chat/completions", json=ask("m"),
                          headers={"Authorization": "Basic k1"}) as r:
            assert r.status == 401  # another scheme is no bearer key
        # Non-ASCII keys, as UTF-8 and as bytes that are not UTF-8 at all: refused, not a 500.
        body = json.dumps(ask("m")).encode()
        for key in ("é".encode(), b"\xe9", "k1é".encode()):
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Authorization: Bearer " + key + b"\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            reply = await raw_exchange(door.port, head + body)
            assert status_of(reply) == 401, reply[:200]
            assert b"invalid_api_key" in reply
        # The client's key stays at the door; the replica's secret goes upstream.
        assert door.upstream.authorizations == ["Bearer replica-secret"] * 3
    run(check, api_keys=frozenset({"k1"}))


def test_a_failed_replica_ends_its_relays_at_once_and_gets_no_more():
    async def check(door: Door) -> None:
        s = door.session
        streamed = await s.post("/v1/chat/completions", json=ask("m", "stall", stream=True))
        assert streamed.status == 200
        assert b"one" in await streamed.content.readuntil(b"\n\n")
        whole = asyncio.ensure_future(s.post("/v1/chat/completions", json=ask("m", "hang")))
        await wait_until_async(lambda: door.config.relays.open_count("m-g1") >= 2, within_s=5,
                               what="both relays open upstream")
        t0 = time.monotonic()
        assert door.config.relays.replica_failed("m-g1", "rank 1 exited (code 1)") == 2
        rest = (await streamed.read()).decode()
        whole_reply = await whole
        took = time.monotonic() - t0
        assert took < 1.0, took
        [event] = events_of(rest)[-1:]
        assert "rank 1 exited (code 1)" in event["error"]["message"] and "[DONE]" not in rest
        assert whole_reply.status == 503 and int(whole_reply.headers["Retry-After"]) > 0
        assert "rank 1 exited" in (await whole_reply.json())["error"]["message"]
        async with s.post("/v1/chat/completions", json=ask("m")) as r:  # routed there still
            assert r.status == 503 and "failed" in (await r.json())["error"]["message"]
        await wait_until_async(lambda: door.upstream.cancelled >= 2, within_s=5,
                               what="rank 0 seeing both requests end")
        assert len(door.upstream.authorizations) == 2  # the third never went upstream
    run(check, relays=Relays())


def test_a_silent_upstream_is_lost_after_the_dead_ring_time_and_a_live_one_is_not():
    async def check(door: Door) -> None:
        s = door.session
        async with s.post("/v1/chat/completions", json=ask("m", "slow-whole")) as r:
            assert r.status == 200  # no bytes for 3x the bound, but /health answered
        streams = [await s.post("/v1/chat/completions", json=ask("m", "stall", stream=True))
                   for _ in range(3)]
        for streamed in streams:
            assert b"one" in await streamed.content.readuntil(b"\n\n")
        whole = asyncio.ensure_future(s.post("/v1/chat/completions", json=ask("m", "hang")))
        await wait_until_async(lambda: door.config.relays.open_count("m-g1") == 4, within_s=5,
                               what="the whole request relayed")
        door.upstream.frozen, asks_before = True, door.upstream.health_asks
        t0 = time.monotonic()
        rests = [(await streamed.read()).decode() for streamed in streams]
        stream_took = time.monotonic() - t0
        async with await whole as r:
            whole_took = time.monotonic() - t0
            assert r.status == 503 and int(r.headers["Retry-After"]) > 0
            assert "dead-ring" in (await r.json())["error"]["message"]
        # Relays that fell silent together share one probe (each would ask on its own).
        assert door.upstream.health_asks - asks_before < len(streams) + 1
        limit = QUICK_SILENCE.limit_s
        for rest in rests:
            assert events_of(rest)[-1]["error"]["code"] == "unavailable"
            assert "[DONE]" not in rest
        for took in (stream_took, whole_took):
            assert limit * 0.5 < took < limit + 1.0, took
        # Seen silent: suspect here, so a new request is not sent there to wait again, and
        # gets its 503 at once; once /health answers again, requests go there again.
        asked = len(door.upstream.authorizations)
        t0 = time.monotonic()
        async with s.post("/v1/chat/completions", json=ask("m")) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) > 0
            assert "did not answer" in (await r.json())["error"]["message"]
        assert time.monotonic() - t0 < limit * 0.5
        assert len(door.upstream.authorizations) == asked
        door.upstream.frozen = False

        async def served() -> bool:
            async with s.post("/v1/chat/completions", json=ask("m")) as r:
                return r.status == 200
        await wait_until_async(served, within_s=5, what="served again once /health answers")
        assert door.config.relays.suspicion("m-g1") is None
    run(check, silence=QUICK_SILENCE, relays=Relays(recheck_s=0.25))


def test_a_suspect_replica_hands_its_waiting_requests_on_and_gets_no_new_ones():
    """Two replicas, the first frozen: the first request to fall silent there finds it
    suspect, the others waiting on it go to the second at once, and new ones go there only."""
    async def check(door: Door) -> None:
        s = door.session
        relays = door.config.relays
        door.upstream.frozen = True  # freezes "pair-a" (the "frozen" model's first replica)
        first = asyncio.ensure_future(s.post("/v1/chat/completions", json=ask("frozen", "hang")))
        await wait_until_async(lambda: relays.open_count("pair-a") == 1, within_s=5,
                               what="the first request relayed to the frozen replica")
        later = asyncio.ensure_future(s.post("/v1/chat/completions", json=ask("frozen", "hang")))
        await wait_until_async(lambda: relays.open_count("pair-a") == 2, within_s=5,
                               what="a second request waiting on the frozen replica")
        t0 = time.monotonic()
        replies = [await first, await later]
        took = time.monotonic() - t0
        for reply in replies:
            assert reply.status == 200 and reply.headers["X-Ringfleet-Replica"] == "pair-b"
        assert took < QUICK_SILENCE.limit_s + 1.0, took  # both handed on by one probe
        assert relays.suspicion("pair-a") is not None
        for _ in range(4):
            async with s.post("/v1/chat/completions", json=ask("frozen", "hang")) as r:
                assert r.status == 200 and r.headers["X-Ringfleet-Replica"] == "pair-b"
        assert relays.open_count("pair-a") == 0
        async with s.get("/metrics") as r:
            text = await r.text()
        assert "ringfleet_front_door_suspected_total 1.0" in text
        assert 'ringfleet_front_door_handed_on_total{model="frozen"} 2.0' in text
    run(check, silence=QUICK_SILENCE, relays=Relays(recheck_s=60))


def test_a_disconnecting_client_cancels_its_upstream_request():
    async def check(door: Door) -> None:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{door.port}") as client:
            whole = asyncio.ensure_future(client.post("/v1/chat/completions",
                                                      json=ask("m", "hang")))
            await wait_until_async(lambda: door.config.relays.open_count("m-g1") >= 1,
                                   within_s=5, what="the relay open upstream")
        whole.cancel()  # the session closed under it: the client is gone
        await wait_until_async(lambda: door.upstream.cancelled >= 1, within_s=3,
                               what="the upstream request ended with its client")
        assert door.config.relays.open_count("m-g1") == 0
    run(check)


def test_slow_heads_and_bodies_are_cut_and_health_still_answers():
    limits = HttpLimits(header_s=1.0, idle_s=1.0, body_s=1.0, max_connections=64,
                        max_body_bytes=MAX_BODY_BYTES)

    dripping: list[int] = []

    async def slowloris(port: int) -> float:
        """Sends a request head a byte at a time; returns when the door closed it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        dripping.append(port)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        try:
            for byte in head:
                writer.write(bytes([byte]))
                try:
                    if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                        break
                except TimeoutError:
                    continue
            return time.monotonic() - t0
        finally:
            writer.close()

    async def check(door: Door) -> None:
        slow = [asyncio.ensure_future(slowloris(door.port)) for _ in range(20)]
        await wait_until_async(lambda: len(dripping) == len(slow), within_s=10,
                               what="every slow connection open and dripping")
        for _ in range(5):
            t0 = time.monotonic()
            async with door.session.get("/health") as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 0.5
        closed_after = await asyncio.gather(*slow)
        assert all(limits.header_s * 0.8 < t < limits.header_s + 1.5
                   for t in closed_after), closed_after
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        t0 = time.monotonic()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert status_of(head) == 408 and time.monotonic() - t0 < limits.body_s + 1.0
        await asyncio.wait_for(reader.read(), LINGERING_S + 1.0)  # then closed
        writer.close()
        # A kept-alive connection that says nothing more is closed in the same time.
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        t0 = time.monotonic()
        assert status_of(head) == 200 and b"keep-alive" not in head.lower()
        await asyncio.wait_for(reader.read(), limits.idle_s + 1.5)
        assert limits.idle_s * 0.8 < time.monotonic() - t0
        writer.close()
        # A body beyond the bound is refused by name, as JSON.
        async with door.session.post("/v1/chat/completions",
                                     data=b" " * (MAX_BODY_BYTES + 1)) as r:
            assert r.status == 413 and "larger than" in (await r.json())["error"]["message"]
    run(check, limits=limits)


def test_compressed_bodies_are_decoded_within_the_bound():
    """A gzip body is decoded and relayed as JSON; a gzip bomb is a 413 (the decoder stops
    at the bound: tests/api/test_bodies.py), and the door serves on."""
    from tests.api.test_bodies import gzip_bomb

    async def check(door: Door) -> None:
        packed = gzip.compress(json.dumps(ask("m")).encode())
        async with door.session.post("/v1/chat/completions", data=packed, headers={
                "Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "stop"
        async with door.session.post("/v1/chat/completions", data=gzip_bomb(64 << 20),
                                     headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 413 and "larger than 1048576" in (await r.json())["error"]["message"]
        async with door.session.post("/v1/chat/completions", data=b"x",
                                     headers={"Content-Encoding": "br"}) as r:
            assert r.status == 415
        async with door.session.get("/health") as r:
            assert r.status == 200
    run(check, limits=HttpLimits(max_body_bytes=1 << 20))


def test_connections_beyond_the_cap_get_a_503_and_a_close():
    limits = HttpLimits(header_s=10.0, idle_s=10.0, max_connections=8)

    async def check(door: Door) -> None:
        held = [await asyncio.open_connection("127.0.0.1", door.port) for _ in range(8)]

        async def one_too_many() -> bytes | None:  # once every held one is in
            reply = await raw_exchange(door.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 5)
            return reply if status_of(reply) == 503 else None

        reply = await wait_until_async(one_too_many, within_s=5, what="a 503 past the cap")
        assert b"Retry-After: " in reply and b"too many connections" in reply
        for _, writer in held:
            writer.close()

        async def health_answers() -> bool:
            reply = await raw_exchange(door.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n", 5)
            return status_of(reply) == 200

        await wait_until_async(health_answers, within_s=5, what="the cap given back")
    run(check, limits=limits)


def test_the_front_doors_limits_leave_room_for_its_upstream_connections():
    from engine.api.connections import default_max_connections

    limits = front_door_limits()  # each relayed connection holds a second, upstream, socket
    assert 8 <= limits.max_connections <= max(8, default_max_connections() // 2)
    assert limits.max_body_bytes == MAX_BODY_BYTES and limits.header_s <= 5


def test_a_flood_of_one_failure_is_one_log_line():
    import structlog

    async def check(door: Door) -> None:
        with structlog.testing.capture_logs() as logged:
            for _ in range(30):
                async with door.session.post("/v1/chat/completions", json=ask("gone")) as r:
                    assert r.status == 503
        lines = [e for e in logged if e["event"].startswith("upstream not reachable")]
        assert len(lines) == 1 and lines[0]["replica"] == "gone-g1", logged
    run(check)


def test_the_supervisor_failing_a_replica_ends_its_streams(tmp_path):
    """The hook itself: a replica recorded as failed by the supervisor ends its relays."""
    import ssl

    from supervisor import lifecycle as lc
    from supervisor.agents import AgentClient
    from supervisor.control_loop import Supervisor
    from supervisor.settings import SupervisorSettings

    supervisor = Supervisor(SupervisorSettings(state_dir=tmp_path, calibration_budget_s=0),
                            AgentClient(ssl.create_default_context()))
    serving = lc.Replica(id="m-g1", model_id="m", generation=1, state=lc.SERVING, since=0.0,
                         spec_digest="d")

    async def check(door: Door) -> None:
        streamed = await door.session.post("/v1/chat/completions",
                                           json=ask("m", "stall", stream=True))
        assert b"one" in await streamed.content.readuntil(b"\n\n")
        supervisor.apply_all(lc.fail_actions(serving, "node-b is dead", time.time(),
                                             lc.Policy()))
        rest = await asyncio.wait_for(streamed.read(), 2)
        assert b"node-b is dead" in rest and b"[DONE]" not in rest

    try:
        run(check, relays=supervisor.relays)
    finally:
        supervisor.state.close()
