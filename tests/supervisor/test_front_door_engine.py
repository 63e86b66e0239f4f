"""The front door in front of a real rank 0 (a fleet-engine process serving a generated
checkpoint, holding a replica secret): a refusal of one request passes through as the engine
wrote it, and the replica's secret, not the client's key, goes upstream; a client that
leaves a whole request frees rank 0's slot at once; a frozen rank 0 (SIGSTOP) ends a stream
with an SSE error, and a request waiting with it with a 503, within the ring's dead-ring
time; a request after them gets its 503 at once (the replica is suspect), and requests are
served again once rank 0 runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest

from engine.harness.launch import LocalReplica, free_port, launch
from supervisor.front_door import FrontDoorConfig, Route, open_front_door
from supervisor.relays import UpstreamSilence
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(180)
LONG = 4000  # tokens: ~15 s of generation on the tiny model, far beyond every bound below


SECRET = "s" * 40  # the replica's API secret: rank 0 answers nothing else but /health


@pytest.fixture(scope="module")
def engine(make_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rank0")
    (run_dir / "api.secret").write_text(SECRET)
    (run_dir / "api.secret").chmod(0o600)
    fleet = launch(make_model("qwen3"), [(0, 3)], context=4096, parallel=2, chunk=32,
                   run_dir=run_dir,
                   extra_env={"FLEET_API_SECRET_FILE": str(run_dir / "api.secret")})
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.stop()


def base_url(fleet: LocalReplica) -> str:
    return f"http://127.0.0.1:{fleet.http_port}"


@dataclass
class Clients:
    door: aiohttp.ClientSession  # through the front door
    direct: aiohttp.ClientSession  # to rank 0 itself
    model: str
    door_url: str  # for a client of its own, one that can leave


async def with_door(fleet: LocalReplica, check: Callable[[Clients], Awaitable[None]]) -> None:
    port = free_port()
    route = Route(url=base_url(fleet), replica="m-g1", api_secret=SECRET)
    config = FrontDoorConfig(lambda model, conversation: route, lambda: [{"id": "m", "serving": True}])
    runner = await open_front_door(config, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as door, \
                aiohttp.ClientSession(base_url(fleet),
                                      headers={"Authorization": f"Bearer {SECRET}"}) as direct:
            async with direct.get("/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            clients = Clients(door, direct, model, f"http://127.0.0.1:{port}")
            await asyncio.wait_for(check(clients), 120)
    finally:
        await runner.cleanup()


def ask(model: str, *, stream: bool = False, **extra) -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "Go."}],
            **extra}


async def a_long_stream_under_way(c: Clients) -> aiohttp.ClientResponse:
    """A streamed reply of LONG tokens through the front door, its first three events read."""
    streamed = await c.door.post("/v1/chat/completions",
                                 json=ask(c.model, stream=True, max_tokens=LONG, ignore_eos=True))
    assert streamed.status == 200
    for _ in range(3):
        await streamed.content.readuntil(b"\n\n")
    return streamed


async def slots_in_use(direct: aiohttp.ClientSession) -> int:
    async with direct.get("/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return (await r.json())["slots_in_use"]


async def wait_slots(direct: aiohttp.ClientSession, want: int, within_s: float) -> float:
    t0 = time.monotonic()

    async def reached() -> bool:
        return await slots_in_use(direct) == want

    await wait_until_async(reached, within_s=within_s, what=f"slots_in_use {want}")
    return time.monotonic() - t0


def test_a_refusal_passes_through_as_the_engine_wrote_it_and_the_secret_goes_upstream(engine):
    async def check(c: Clients) -> None:
        door, direct, model = c.door, c.direct, c.model
        bad = ask(model, temperature=5)
        async with direct.post("/v1/chat/completions", json=bad) as r:
            want_status, want_body = r.status, await r.read()
        async with door.post("/v1/chat/completions", json=bad) as r:
            assert (r.status, await r.read()) == (want_status, want_body)
            assert "Retry-After" not in r.headers
        assert want_status == 400 and b"temperature" in want_body
        # The replica's secret goes upstream, never the client's own Authorization.
        async with door.post("/v1/chat/completions", json=ask(model, max_tokens=2),
                             headers={"Authorization": "Bearer the-clients-own"}) as r:
            assert r.status == 200
        async with aiohttp.ClientSession(base_url(engine)) as stranger, \
                stranger.post("/v1/chat/completions", json=ask(model, max_tokens=2)) as r:
            assert r.status == 401
    asyncio.run(with_door(engine, check))


def test_a_client_that_leaves_a_whole_request_frees_the_slot(engine):
    async def check(c: Clients) -> None:
        direct, model = c.direct, c.model
        async with aiohttp.ClientSession(c.door_url) as client:
            whole = asyncio.ensure_future(client.post(
                "/v1/chat/completions", json=ask(model, max_tokens=LONG, ignore_eos=True)))
            await wait_slots(direct, 1, 10)
        whole.cancel()  # its connection closed with the session: the client is gone
        took = await wait_slots(direct, 0, 3)
        print(f"slot freed {took:.2f} s after the client left")
    asyncio.run(with_door(engine, check))


def test_a_frozen_rank0_ends_streams_and_new_requests_within_the_dead_ring_time(engine):
    limit_s = UpstreamSilence().limit_s
    assert limit_s == 6.0  # keep-alive 2 s x 3 silent intervals, as the ring has it

    async def check(c: Clients) -> None:
        door, direct, model = c.door, c.direct, c.model
        streamed = await a_long_stream_under_way(c)
        os.kill(engine.processes[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            whole = asyncio.ensure_future(door.post("/v1/chat/completions",
                                                    json=ask(model, max_tokens=4)))
            rest = (await streamed.read()).decode()
            stream_took = time.monotonic() - t0
            async with await whole as r:
                whole_took = time.monotonic() - t0
                body = await r.json()
                assert r.status == 503 and int(r.headers["Retry-After"]) > 0
            # Seen silent, it is suspect: the next request is not sent to wait there again.
            t0 = time.monotonic()
            async with door.post("/v1/chat/completions", json=ask(model, max_tokens=4)) as r:
                next_took = time.monotonic() - t0
                next_body = await r.json()
                assert r.status == 503 and int(r.headers["Retry-After"]) > 0
        finally:
            os.kill(engine.processes[0].pid, signal.SIGCONT)
        last = json.loads(rest.strip().splitlines()[-1][6:])
        assert last["error"]["code"] == "unavailable" and "dead-ring" in last["error"]["message"]
        assert "[DONE]" not in rest and '"finish_reason": "length"' not in rest
        assert "did not answer" in body["error"]["message"]
        assert "did not answer" in next_body["error"]["message"]
        print(f"stream ended {stream_took:.1f} s and a request waiting with it "
              f"{whole_took:.1f} s after SIGSTOP; the next request {next_took:.2f} s")
        for took in (stream_took, whole_took):
            assert limit_s - 3.0 < took < limit_s + 3.0, took
        assert next_took < limit_s / 2, next_took

        async def served() -> bool:
            async with door.post("/v1/chat/completions", json=ask(model, max_tokens=2)) as r:
                return r.status == 200
        await wait_until_async(served, within_s=30, what="served again once thawed")
        await wait_slots(direct, 0, 30)  # thawed, rank 0 frees the abandoned stream's slot
    asyncio.run(with_door(engine, check))
