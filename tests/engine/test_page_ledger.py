"""Rank 0's admission by KV pages (engine/lanes/page_ledger.py): short requests share a pool
that whole windows would spend on one stream, a request that can never fit is refused by
name, one that must wait waits, and kept conversations give way, every reply the bytes of
the same request without a pool. A real tiny model on a real stage."""

from __future__ import annotations

import asyncio

import pytest

from engine.lanes.host import Busy, Done, GenerationRequest, LaneHost, NeverFits, Token
from engine.lanes.page_ledger import PageLedger
from engine.lanes.text import TextCodec
from engine.pipeline.runner import LocalRunner
from engine.sampling import SamplingParams
from tests.engine.conftest import whole_stage
from tests.waiting import wait_until_async

CONTEXT, CHUNK = 512, 16  # a whole window is 8 pages of 64 positions


def test_a_reservation_is_the_prompt_and_reply_or_what_the_slot_holds():
    ledger = PageLedger(pool=8, context=CONTEXT)
    assert ledger.reservation(10, 54) == 1 and ledger.reservation(10, 55) == 2
    assert ledger.reservation(10, 20, held=3) == 3
    assert ledger.reservation(500, 400) == 8  # never past the context
    assert ledger.never_fits(100, 400) is None
    assert ledger.drops(2, 7, [(4, 1), (2, 3)]) == [4]
    assert ledger.drops(3, 7, [(4, 1), (2, 3)]) == [4, 2]
    assert ledger.drops(6, 7, [(4, 1), (2, 3)]) is None


def request(seed: int, prompt_tokens: int, max_tokens: int) -> GenerationRequest:
    prompt = tuple((seed * 31 + 7 * i) % 200 + 3 for i in range(prompt_tokens))
    return GenerationRequest(prompt, max_tokens=max_tokens,
                             sampling=SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def model_dir(make_model):
    return make_model("qwen3", seed=21)


def host_of(model_dir, *, kv_pages: int, parallel: int = 6, streams: int | None = None,
            max_waiting: int = 8):
    stage = whole_stage(model_dir, parallel=parallel, context=CONTEXT, chunk=CHUNK,
                        kv_pages=kv_pages)
    return LaneHost(LocalRunner(stage), TextCodec(model_dir), chunk=CHUNK,
                    max_waiting=max_waiting, streams=streams)


def served(host: LaneHost, requests: list[GenerationRequest], *,
           placed: list | None = None) -> list[tuple[list[int], Done]]:
    """`replies` in an event loop of its own; the host is closed after."""
    try:
        return asyncio.run(replies(host, requests, placed=placed))
    finally:
        host.close()


async def replies(host: LaneHost, requests: list[GenerationRequest], *,
                  placed: list | None = None) -> list[tuple[list[int], Done]]:
    """Every request's tokens and Done, once every slot's CLOSE has landed (the host idle);
    `placed`: the streams in slots right after submit."""
    loop = asyncio.create_task(host.run())
    streams = [host.submit(r) for r in requests]
    if placed is not None:
        placed.extend([host.slots_in_use(), len(host.waiting)])
    out = []
    for stream in streams:
        tokens = []
        while not isinstance(event := await asyncio.wait_for(stream.events.get(), 60), Done):
            assert isinstance(event, Token), event
            tokens.append(event.token_id)
        out.append((tokens, event))
    await wait_until_async(host.idle, within_s=60, what="every stream's CLOSE landed")
    loop.cancel()
    return out


def tokens_of(results) -> list[list[int]]:
    return [tokens for tokens, _ in results]


def test_short_requests_share_one_windows_pages_with_the_bytes_of_whole_windows(model_dir):
    """A pool of 8 pages (one whole window) runs six short streams at once."""
    requests = [request(seed, 10 + seed, 24) for seed in range(6)]
    placed: list[int] = []
    pooled = served(host_of(model_dir, kv_pages=8), requests, placed=placed)
    whole = served(host_of(model_dir, kv_pages=0), requests)
    assert placed == [6, 0]  # every stream admitted at once: a page each
    assert tokens_of(pooled) == tokens_of(whole)
    assert all(len(tokens) == 24 for tokens in tokens_of(pooled))


def test_a_request_past_the_pool_is_refused_and_one_that_must_wait_waits(model_dir):
    host = host_of(model_dir, kv_pages=6)
    with pytest.raises(NeverFits, match="need 7 KV pages of 64 positions; this model's pool "
                                        r"holds 6 \(384 positions\)"):
        host.submit(request(1, 100, 340))
    requests = [request(2, 100, 150), request(3, 90, 160)]  # 4 pages each: one at a time
    placed: list[int] = []
    pooled = served(host, requests, placed=placed)
    assert placed == [1, 1]
    whole = served(host_of(model_dir, kv_pages=0), requests)
    assert tokens_of(pooled) == tokens_of(whole)


def test_a_full_queue_behind_a_full_pool_says_the_pages_are_short(model_dir):
    """Slots are free, pages are not: the 503's reason names the pool, not the streams."""
    host = host_of(model_dir, kv_pages=6, max_waiting=1)

    async def submit_three() -> None:
        host.submit(request(2, 100, 150))  # 4 pages: placed
        host.submit(request(3, 90, 160))  # 4 more: waits
        with pytest.raises(Busy, match=r"the open streams reserve the KV pool's pages \(6 of "
                                       r"64 positions\) and 1 requests wait"):
            host.submit(request(4, 100, 150))
        assert (host.slots_in_use(), len(host.waiting)) == (1, 1)

    try:
        asyncio.run(submit_three())
    finally:
        host.close()


@pytest.mark.parametrize(("kv_pages", "hit"), [(5, False), (8, True)])
def test_kept_conversations_give_way_to_a_new_request(model_dir, kv_pages, hit):
    """One stream at a time, every slot past it keeps a finished conversation. A pool of 5
    pages holds one kept conversation (3 pages) beside a new one, so the older is dropped
    (a CANCEL on its closed slot) and resending it later starts over; a pool of 8 keeps
    both, and the resend resumes. The same bytes either way."""
    first, second = request(4, 150, 8), request(5, 150, 8)  # 3 pages each
    host = host_of(model_dir, kv_pages=kv_pages, parallel=3, streams=1)

    async def turns():
        return [(await replies(host, [r]))[0] for r in (first, second, first)]

    try:
        results = asyncio.run(turns())
    finally:
        host.close()
    stage_slots = host.runner.slots.slots
    assert sum(s.pages for s in stage_slots) <= kv_pages
    assert results[2][0] == results[0][0]
    assert (results[2][1].cached_tokens > 0) == hit  # dropped for the second: it ran again
