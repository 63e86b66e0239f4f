"""A rank 0 whose round loop is stuck while its HTTP server answers, with real processes on
loopback: a fleet-engine (through `tests.wedging_engine`, whose SIGUSR1 makes the next
round's launch never return) behind the front door. Unlike a frozen process, it answers
/health, and in a ring its keep-alive threads keep the ring alive, so neither the front
door's probes nor the ring's dead-ring time end it. Its /health shows the round loop's
progress (`rounds_owed_s` growing); once no round has landed for the round deadline while
rounds were owed, rank 0 fails itself: a stream through the front door ends with the SSE
error naming it, a request waiting gets the 503 with Retry-After, and the process exits 1
(past the stuck thread) so its agent and supervisor replace it as any exited engine. In a
ring its follower exits with the same reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from engine.harness.launch import LocalReplica, launch
from tests.supervisor.test_front_door_engine import (
    LONG,
    SECRET,
    Clients,
    a_long_stream_under_way,
    ask,
    with_door,
)
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(180)
ROUND_DEADLINE_S = 4  # rank 0's bound on rounds owed with none landing (FLEET_ROUND_DEADLINE_S)
STUCK = "the round loop is stuck"


def start(make_model, run_dir, stages, rank0_env: dict[str, str]) -> LocalReplica:
    (run_dir / "api.secret").write_text(SECRET)
    (run_dir / "api.secret").chmod(0o600)
    replica = launch(make_model("qwen3"), stages, context=4096, parallel=2, chunk=32,
                     run_dir=run_dir, engine_module="tests.wedging_engine",
                     extra_env={"FLEET_API_SECRET_FILE": str(run_dir / "api.secret")},
                     rank_env={0: rank0_env})
    replica.wait_ready()
    return replica


def exit_line(replica: LocalReplica, rank: int) -> dict:
    return next(e for e in reversed(replica.events(rank)) if e.get("event") == "exiting")


def test_a_stuck_one_stage_rank0_fails_itself_at_the_round_deadline(make_model, tmp_path):
    replica = start(make_model, tmp_path, [(0, 3)],
                    {"FLEET_ROUND_DEADLINE_S": str(ROUND_DEADLINE_S)})
    rank0 = replica.processes[0]

    async def check(c: Clients) -> None:
        door, direct, model = c.door, c.direct, c.model
        streamed = await a_long_stream_under_way(c)
        os.kill(rank0.pid, signal.SIGUSR1)
        t0 = time.monotonic()
        whole = asyncio.ensure_future(door.post("/v1/chat/completions",
                                                json=ask(model, max_tokens=4)))

        async def owed_while_answering() -> float:
            async with direct.get("/health") as r:
                body = await r.json()
                return r.status == 200 and body["rounds_owed_s"] >= 1.0 and body["rounds_owed_s"]
        # Stuck, it still answers /health 200: what shows it is the progress figure.
        owed_s = await wait_until_async(owed_while_answering, within_s=ROUND_DEADLINE_S * 3,
                                        what="/health answering 200 with rounds owed")
        rest = (await streamed.read()).decode()
        stream_took = time.monotonic() - t0
        async with await whole as r:
            body = await r.json()
            assert r.status == 503 and int(r.headers["Retry-After"]) > 0
        last = json.loads(rest.strip().splitlines()[-1][6:])
        assert last["error"]["code"] == "unavailable" and STUCK in last["error"]["message"]
        assert "[DONE]" not in rest and '"finish_reason": "length"' not in rest
        assert STUCK in body["error"]["message"]
        print(f"stuck: /health 200 with rounds_owed_s {owed_s}; the stream ended "
              f"{stream_took:.1f} s after the wedge (round deadline {ROUND_DEADLINE_S} s)")

    try:
        asyncio.run(with_door(replica, check))
        # It exits although its round thread never returns (the interpreter would join it).
        wait_until(lambda: rank0.poll() is not None, within_s=30, what="the stuck rank 0 exits")
        assert rank0.returncode == 1
        assert STUCK in exit_line(replica, 0)["reason"]
    finally:
        replica.stop(grace_s=5)


def test_a_stuck_rank0_of_a_ring_ends_the_ring_with_its_reason(make_model, tmp_path):
    # Only rank 0 gets the short deadline: the follower's own bound on waiting for rows
    # (300 s) must not be what ends the ring here.
    replica = start(make_model, tmp_path, [(0, 2), (2, 3)],
                    {"FLEET_ROUND_DEADLINE_S": str(ROUND_DEADLINE_S)})
    rank0, follower = replica.processes

    async def check(c: Clients) -> None:
        async with aiohttp.ClientSession(c.door_url) as client:
            whole = asyncio.ensure_future(client.post(
                "/v1/chat/completions", json=ask(c.model, max_tokens=LONG, ignore_eos=True)))

            async def busy() -> bool:
                async with c.direct.get("/health") as r:
                    return (await r.json())["slots_in_use"] == 1
            await wait_until_async(busy, within_s=30, what="the request holds a slot")
            os.kill(rank0.pid, signal.SIGUSR1)
            async with await whole as r:
                body = await r.json()
                assert r.status == 503 and STUCK in body["error"]["message"]

    try:
        asyncio.run(with_door(replica, check))
        wait_until(lambda: rank0.poll() is not None and follower.poll() is not None,
                   within_s=30, what="both stages exit")
        assert (rank0.returncode, follower.returncode) == (1, 1)
        assert STUCK in exit_line(replica, 0)["reason"]
        assert STUCK in exit_line(replica, 1)["reason"]  # learned from rank 0's ABORT
    finally:
        replica.stop(grace_s=5)
