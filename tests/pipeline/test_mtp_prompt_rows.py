"""The MTP head reads the prompt's rows, as vLLM and SGLang run it: after a prompt its first
drafts are those of a reference that runs the head over the whole sequence at once.

The reference is tests/engine/test_mtp_head.py's, built of transformers' own Qwen3.5
components, fed transformers' hidden rows (after the final norm) at every prompt position,
each beside the next token, and the first token drawn after the prompt's last row. The
served head must have one entry per prompt position before it drafts, and its first
drafts must be the reference's greedy chain: whole and on two stages, on both backends,
for a prompt read in several chunks and for one that resumes a closed slot's state (the
prompt cache), whose head entries are kept, not lost. Where the resumed prompt's token at
the resume point is not the one the old stream paired with the row before it, that one
entry is dropped, and the head drafts over the rest.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.harness.local_pipeline import whole_runner
from engine.lanes.host import Done, DraftPolicy, Failed, GenerationRequest, LaneHost
from engine.lanes.text import TextCodec
from engine.sampling import SamplingParams
from tests.engine.test_mtp_head import reference, reference_drafts
from tests.pipeline.conftest import pipeline
from tests.requirements import require
from tests.waiting import wait_until_async

CHUNK = 16
DRAFTS = 3
PROMPT = [(i * 37 + 11) % 290 + 5 for i in range(37)]  # chunks of 16, 16 and 5 rows


@pytest.fixture(scope="module")
def model_dir(make_model):
    return make_model("qwen3_5", mtp=True, seed=31)


class Recorder:
    """Rank 0's stage, every call to its draft head recorded: (asks, their drafts)."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.calls: list[tuple[list, list]] = []

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def draft(self, asks):
        drafts = self.stage.draft(asks)
        self.calls.append((list(asks), drafts))
        return drafts


def serve_in_turn(runner, model_dir, prompts, max_tokens: int):
    """Each prompt served after the last one's reply ended, on one lane host (so a later
    one may resume an earlier one's slot): per prompt, its reply's tokens, how many prompt
    tokens its slot restored, and its first drafting ask with the drafts it got."""
    recorder = Recorder(runner.stage)
    runner.stage = recorder
    host = LaneHost(runner, TextCodec(model_dir), chunk=CHUNK, max_waiting=1,
                    drafts=DraftPolicy(None, DRAFTS))

    async def go():
        task = asyncio.create_task(host.run())
        out = []
        for prompt in prompts:
            calls_before = len(recorder.calls)
            stream = host.submit(GenerationRequest(
                tuple(prompt), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)))
            tokens = []
            while not isinstance(event := await stream.events.get(), Done):
                assert not isinstance(event, Failed), event.reason
                tokens.append(event.token_id)
            first = next((ask, drafts) for asks, drafted in recorder.calls[calls_before:]
                         for ask, drafts in zip(asks, drafted, strict=True) if ask.count)
            out.append((tokens, event.cached_tokens, *first))
            await wait_until_async(lambda: host.slots_in_use() == 0, within_s=60,
                                   what="the round that closes the slot, which keeps its state")
        task.cancel()
        return out

    try:
        return asyncio.run(go())
    finally:
        runner.stage = recorder.stage
        host.close()


def reference_first_drafts(model_dir, prompt, first_token) -> list[int]:
    torch = require("torch")
    lm, mtp = reference(model_dir)
    with torch.no_grad():
        ids = torch.tensor([*prompt, first_token])
        hidden = lm.model(ids[None]).last_hidden_state[0]  # [n + 1, h], after the final norm
        n = len(prompt)
        return reference_drafts(lm, mtp, hidden[:n], ids[1:n + 1], DRAFTS)


def check_first_drafts(model_dir, served, prompts) -> None:
    for (tokens, _, ask, drafts), prompt in zip(served, prompts, strict=True):
        # Before it drafted, the head held an entry for every position before the last
        # chunk's, was fed that chunk's rows beside the prompt's next tokens, and the
        # prompt's last row beside the first token drawn.
        assert ask.kept == ask.position
        assert ask.tokens == (*prompt[ask.position + 1:], tokens[0])
        assert list(drafts) == reference_first_drafts(model_dir, prompt, tokens[0])


def runners(model_dir, tmp_path, backend):
    """The whole model here, then two stages (a follower process), with drafter mtp."""
    require("mlx.core" if backend.startswith("mlx") else "torch")
    yield whole_runner(model_dir, backend=backend, chunk=CHUNK, drafter="mtp")
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=[backend] * 2, chunk=CHUNK,
                  extra_env={"FLEET_DRAFTER": "mtp"}) as runner:
        yield runner


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_the_first_drafts_after_a_prompt_are_the_reference_over_the_whole_sequence(
        model_dir, tmp_path, backend):
    for runner in runners(model_dir, tmp_path, backend):
        # A fresh prompt in three chunks, then one that goes on from its reply (the slot's
        # state resumes at 32: its two full chunks, and the head's entries with them).
        (tokens, cached, *_), = served = serve_in_turn(runner, model_dir, [PROMPT], 6)
        check_first_drafts(model_dir, served, [PROMPT])
        assert cached == 0
        follow_on = [*PROMPT, *tokens, 7, 8, 9]
        served = serve_in_turn(runner, model_dir, [PROMPT, follow_on], 6)
        assert served[1][1] == 2 * CHUNK  # the prompt cache restored 32 positions
        check_first_drafts(model_dir, served, [PROMPT, follow_on])


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_a_resume_whose_next_token_differs_drops_one_head_entry(model_dir, tmp_path, backend):
    require("mlx.core" if backend.startswith("mlx") else "torch")
    runner = whole_runner(model_dir, backend=backend, chunk=CHUNK, drafter="mtp")
    other = (PROMPT[2 * CHUNK] + 1) % 290
    turned = [*PROMPT[:2 * CHUNK], other, *PROMPT[2 * CHUNK + 1:]]
    served = serve_in_turn(runner, model_dir, [PROMPT, turned], 4)
    (_, cached, ask, _) = served[1]
    assert cached == 2 * CHUNK
    # The old stream paired the row of position 31 with PROMPT[32], not `other`: its entry
    # goes, and the positions from 32 on follow the 31 entries kept.
    assert (ask.kept, ask.position) == (2 * CHUNK - 1, 2 * CHUNK)
