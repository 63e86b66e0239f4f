"""The front door with several replicas of a model: requests go to the one with the most free
slots (round-robin among equals); one that cannot take a request before anything reached the
client (gone, or its own 503) hands it to the next; a 503 only when every replica refuses; a
replica seen silent is suspect until its /health answers again, asked at a bounded rate."""

from __future__ import annotations

import asyncio

from supervisor.front_door import ReplicaLoad, by_free_slots
from supervisor.relays import Relays
from tests.supervisor.test_front_door import ask, run


def test_most_free_slots_first_and_equals_take_turns():
    loads = [ReplicaLoad("m-g1", 4, 3), ReplicaLoad("m-g2", 4, 1), ReplicaLoad("m-g3", 4, 1)]
    firsts = [by_free_slots(loads, turn)[0].replica for turn in range(4)]
    assert set(firsts) == {"m-g2", "m-g3"}  # never the fuller one while others have room
    assert firsts[0] != firsts[1] and firsts[:2] == firsts[2:]
    assert [x.replica for x in by_free_slots(loads, 0)][-1] == "m-g1"
    full = [ReplicaLoad("m-g1", 2, 2), ReplicaLoad("m-g2", 2, 5)]
    assert [x.replica for x in by_free_slots(full)] == ["m-g1", "m-g2"]  # the least over
    assert by_free_slots([]) == []


def test_a_gone_replica_hands_the_request_to_the_next():
    async def check(door):
        async with door.session.post("/v1/chat/completions", json=ask("pair")) as reply:
            assert reply.status == 200
            assert reply.headers["X-Ringfleet-Replica"] == "pair-g2"
            assert (await reply.json())["choices"][0]["finish_reason"] == "stop"
        async with door.session.post("/v1/chat/completions",
                                     json=ask("pair", stream=True)) as reply:
            assert reply.status == 200 and b"[DONE]" in await reply.read()
        assert door.upstream.authorizations[-1] == "Bearer replica-secret"

    run(check)


def test_every_replica_refusing_is_a_503_with_the_last_ones_reason():
    async def check(door):
        async with door.session.post("/v1/chat/completions", json=ask("twice", "503")) as reply:
            assert reply.status == 503 and reply.headers["Retry-After"] == "2"
            assert (await reply.json())["error"]["message"] == "draining"
        assert len(door.upstream.authorizations) == 2  # asked both, once each

    run(check)


def test_a_suspect_is_asked_again_at_most_once_per_interval_and_cleared_by_an_answer():
    async def check() -> None:
        now = [100.0]
        relays = Relays(lambda: now[0], recheck_s=2.0)
        asks: list[bool] = []
        answer = [False]

        async def ask_health() -> bool:
            asks.append(answer[0])
            return answer[0]

        relays.recheck("m-g1", ask_health)  # not suspect: nothing to ask
        relays.suspect("m-g1", "rank 0 did not answer /health")
        # The failed probe that made it suspect was just now: nothing is asked.
        probes = [relays.recheck("m-g1", ask_health)]
        await asyncio.gather(*filter(None, probes))  # the probes started, if any
        assert asks == [] and relays.suspicion("m-g1") == "rank 0 did not answer /health"
        now[0] += 2.0
        probes = [relays.recheck("m-g1", ask_health),
                  relays.recheck("m-g1", ask_health)]  # one at a time, once per interval
        await asyncio.gather(*filter(None, probes))
        assert asks == [False] and relays.suspicion("m-g1") is not None
        answer[0] = True
        now[0] += 1.0
        probes = [relays.recheck("m-g1", ask_health)]  # too soon after the last
        now[0] += 1.0
        probes.append(relays.recheck("m-g1", ask_health))
        await asyncio.gather(*filter(None, probes))
        assert asks == [False, True] and relays.suspicion("m-g1") is None
        with relays.open("m-g1") as watch:  # a watch of a suspect knows it
            relays.suspect("m-g1", "again")
            assert watch.suspected.is_set()
            relays.clear("m-g1")
            assert not watch.suspected.is_set()
        await relays.close()

    asyncio.run(check())
