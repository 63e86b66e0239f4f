"""Speculative rounds: a drafter changes how many rounds a reply takes, never the reply.

Streams are served twice on real stages, without a drafter and with prompt lookup: the
tokens must be the same (greedy, and seeded sampling, whose draws depend only on the seed
and the token's index), their logprobs within the rounding of a matmul over more rows
(docs/exactness.md), and `max_tokens` and stop strings end a reply where they would have.
Prompts repeat a stretch, and random models repeat themselves, so drafts are both kept and
refused: each test checks that both happened, or it would prove nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from engine.harness.local_pipeline import whole_runner
from engine.lanes.drafting import PromptLookup
from engine.lanes.host import Done, DraftPolicy, Failed, GenerationRequest, LaneHost, Token
from engine.lanes.text import TextCodec
from engine.rounds import VERIFY_ROWS
from engine.sampling import SamplingParams
from tests.pipeline.conftest import pipeline
from tests.waiting import wait_until_async

CHUNK = 16
STEPS = 40
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Reply:
    tokens: list[int]
    logprobs: list[float]
    text: str
    done: Done
    gaps: list[float] = field(default_factory=list)  # top two's logprob gap, when asked


def prompts(count: int) -> list[list[int]]:
    """Prompts that say a stretch twice, so a reply that goes on saying it is drafted."""
    rng = np.random.default_rng(11)
    out = []
    for _ in range(count):
        stretch = rng.integers(0, 300, 12).tolist()
        out.append([*rng.integers(0, 300, 5).tolist(), *stretch, *stretch, *stretch[:3]])
    return out


def serve(runner, model_dir, requests, *, drafts: DraftPolicy | None) -> list[Reply]:
    """Every request submitted at once on one lane host; each reply in full."""
    host = LaneHost(runner, TextCodec(model_dir), chunk=CHUNK, max_waiting=len(requests),
                    drafts=drafts)

    async def go() -> list[Reply]:
        task = asyncio.create_task(host.run())
        replies = []
        for stream in [host.submit(r) for r in requests]:
            reply = Reply([], [], "", None)
            while not isinstance(event := await stream.events.get(), Done):
                assert not isinstance(event, Failed), event.reason
                if isinstance(event, Token):
                    reply.tokens.append(event.token_id)
                    reply.logprobs.append(event.choice.logprob)
                    if len(event.choice.top) > 1:
                        reply.gaps.append(event.choice.top[0][1] - event.choice.top[1][1])
                    reply.text += event.text
            reply.done = event
            replies.append(reply)
        await wait_until_async(lambda: host.slots_in_use() == 0 or task.done(), within_s=60,
                               what="the round that closes the last slots")
        assert not task.done(), host.failure
        task.cancel()
        return replies

    try:
        return asyncio.run(go())
    finally:
        host.close()


def check_same_replies(plain: list[Reply], drafted: list[Reply]) -> None:
    for a, b in zip(plain, drafted, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.done.finish_reason == a.done.finish_reason
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
        assert a.done.drafted_tokens == 0
    accepted = sum(r.done.accepted_tokens for r in drafted)
    refused = sum(r.done.drafted_tokens - r.done.accepted_tokens for r in drafted)
    assert accepted > 0, "no draft was kept: the test proved nothing"
    assert refused > 0, "no draft was refused: no rollback was tried"


def ngram(most: int = VERIFY_ROWS - 1, min_n: int = 2) -> DraftPolicy:
    return DraftPolicy(PromptLookup(min_n=min_n), most)


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_greedy_replies_are_the_same_with_a_drafter(make_model, backend):
    model_dir = make_model("llama", seed=8)
    requests = [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY)
                for p in prompts(3)]
    plain = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK), model_dir, requests,
                  drafts=None)
    drafted = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK), model_dir,
                    requests, drafts=ngram())
    check_same_replies(plain, drafted)


def test_seeded_sampling_draws_the_same_tokens_with_a_drafter(make_model):
    """An accepted draft is the token the stream's own draw chose from that row."""
    model_dir = make_model("qwen3", seed=9)  # a checkpoint of its own, whatever ran before
    requests = [GenerationRequest(tuple(p), max_tokens=STEPS,
                                  sampling=SamplingParams(temperature=0.3, seed=seed),
                                  top_logprobs=2)
                for seed, p in enumerate(prompts(3))]
    plain = serve(whole_runner(model_dir, chunk=CHUNK), model_dir, requests, drafts=None)
    # Drafting from any one-token match: sampled replies repeat less than greedy ones.
    drafted = serve(whole_runner(model_dir, chunk=CHUNK), model_dir, requests,
                    drafts=ngram(min_n=1))
    check_same_replies(plain, drafted)


def test_a_reply_ends_where_it_would_without_a_drafter(make_model):
    """max_tokens inside a verify round's accepted drafts, and a stop string."""
    model_dir = make_model("llama", seed=8)
    base = serve(whole_runner(model_dir, chunk=CHUNK), model_dir,
                 [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY)
                  for p in prompts(3)], drafts=None)
    text = base[2].text  # the reply whose request below has room to reach its middle
    stop = text[len(text) // 2:][:2]
    requests = [GenerationRequest(tuple(p), max_tokens=n, sampling=GREEDY, stop=(stop,))
                for p, n in zip(prompts(3), (7, 13, STEPS))]
    plain = serve(whole_runner(model_dir, chunk=CHUNK), model_dir, requests, drafts=None)
    drafted = serve(whole_runner(model_dir, chunk=CHUNK), model_dir, requests,
                    drafts=ngram())
    assert [len(r.tokens) for r in drafted] == [len(r.tokens) for r in plain]
    assert any(r.done.finish_reason == "stop" for r in plain)
    for a, b in zip(plain, drafted):
        assert (b.tokens, b.text, b.done.finish_reason) == (a.tokens, a.text,
                                                             a.done.finish_reason)


def test_two_stages_roll_back_together(make_model, tmp_path):
    """A split ring: every stage keeps the accepted rows of each verify round."""
    model_dir = make_model("llama", seed=8)
    requests = [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY)
                for p in prompts(3)]
    plain = serve(whole_runner(model_dir, chunk=CHUNK), model_dir, requests, drafts=None)
    with pipeline(model_dir, [(0, 1), (1, 3)], tmp_path, chunk=CHUNK) as runner:
        drafted = serve(runner, model_dir, requests, drafts=ngram())
    check_same_replies(plain, drafted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_replies_are_the_same_with_a_drafter_on_cuda(make_model, dtype):
    """Decode rows and verify rows replay CUDA graphs of the compiled step, whose kernels
    differ by row count: replies may part only at a tie within the dtype's rounding."""
    model_dir = make_model("llama", seed=8, dtype=dtype)
    requests = [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY, top_logprobs=2)
                for p in prompts(3)]
    plain = serve(whole_runner(model_dir, backend="torch-cuda", chunk=CHUNK), model_dir,
                  requests, drafts=None)
    drafted = serve(whole_runner(model_dir, backend="torch-cuda", chunk=CHUNK), model_dir,
                    requests, drafts=ngram())
    check_same_up_to_ties(plain, drafted, 1e-4 if dtype == "float32" else 0.1)


def test_greedy_replies_are_the_same_with_a_drafter_through_the_compiled_step(make_model):
    """FLEET_COMPILE=on: decode rows and verify rows through the compiled layer (Inductor
    on the CPU; CUDA captures the same graph). The compiler picks kernels by the shapes it
    has seen in this process (a fixed row count, then any), whose float32 sums round
    differently, so a reply may leave the plain one only where the plain one's top two
    tokens were within that rounding."""
    from engine.backends.base import StageSpec, load_stage
    from engine.pipeline.runner import LocalRunner

    model_dir = make_model("llama", seed=8)

    def runner():
        return LocalRunner(load_stage(StageSpec(model_dir, (0, 3), "torch-cpu", 4, 512, CHUNK,
                                                compile="on")))

    requests = [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY, top_logprobs=2)
                for p in prompts(3)]
    first = runner()
    assert first.stage.decode_step is not None
    plain = serve(first, model_dir, requests, drafts=None)
    drafted = serve(runner(), model_dir, requests, drafts=ngram())
    check_same_up_to_ties(plain, drafted, 1e-4)


def check_same_up_to_ties(plain: list[Reply], drafted: list[Reply], tolerance: float) -> None:
    """Each drafted reply is the plain one up to a token where the plain one's top two
    logprobs were within `tolerance` (then the two may part), and drafts were both kept and
    refused."""
    for a, b in zip(plain, drafted, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                    min(len(a.tokens), len(b.tokens)))
        if same < len(a.tokens):
            assert a.gaps[same] < tolerance, f"token {same} differs; its top two were " \
                                             f"{a.gaps[same]} apart"
        np.testing.assert_allclose(b.logprobs[:same], a.logprobs[:same], atol=tolerance,
                                   rtol=0)
    assert sum(r.done.accepted_tokens for r in drafted) > 0
    assert sum(r.done.drafted_tokens - r.done.accepted_tokens for r in drafted) > 0


class KnownReplies:
    """A drafter that knows the plain replies (a stand-in for a drafter that guesses well:
    random hybrids seldom repeat themselves), and gets every third draft's second token
    wrong, so verify rounds keep all their drafts, some, and none."""

    def __init__(self, requests: list[GenerationRequest], replies: list[Reply]) -> None:
        self.known = [(r.prompt_ids, reply.tokens) for r, reply in zip(requests, replies)]

    def draft(self, history: np.ndarray, limit: int) -> tuple[int, ...]:
        tokens = history.tolist()
        for prompt, reply in self.known:
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                guess = list(reply[done:done + limit])
                if done % 3 == 1 and len(guess) > 1:
                    guess[1] = (guess[1] + 1) % 300
                return tuple(guess)
        return ()


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_a_hybrids_replies_are_the_same_with_a_drafter_whole_and_split(make_model, tmp_path,
                                                                        backend):
    """Gated DeltaNet layers keep their state after each verify row; every keep puts back
    the accepted row's, on every stage (the cut after a DeltaNet layer)."""
    model_dir = make_model("qwen3_5", seed=8)
    requests = [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY, top_logprobs=2)
                for p in prompts(3)]
    plain = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK), model_dir, requests,
                  drafts=None)
    drafts = DraftPolicy(KnownReplies(requests, plain), VERIFY_ROWS - 1)
    whole = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK, drafter="ngram"),
                  model_dir, requests, drafts=drafts)
    check_same_up_to_ties(plain, whole, 1e-4)
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=[backend] * 2,
                  chunk=CHUNK, extra_env={"FLEET_DRAFTER": "ngram"}) as runner:
        split = serve(runner, model_dir, requests, drafts=drafts)
    check_same_up_to_ties(plain, split, 1e-4)
    accepted = sum(r.done.accepted_tokens for r in whole)
    assert accepted > len(requests) * STEPS // 2  # most tokens came from verify rounds
