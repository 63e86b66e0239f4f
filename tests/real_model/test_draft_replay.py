"""bench/draft_replay.py replays a drafting policy on a greedy reply's tokens; its drafted and
kept counts must be what the lane host itself drafts and keeps serving that reply, or the
policies it compares say nothing of serving."""

from __future__ import annotations

import pytest

from bench.draft_replay import Policy, replay
from bench.drafting import TASKS, serve_one
from engine.harness.local_pipeline import whole_runner
from engine.lanes.drafting import PromptLookup
from engine.lanes.host import DraftPolicy
from engine.lanes.text import TextCodec

TOKENS, CHUNK = 64, 128


@pytest.mark.parametrize("task", ["copy", "rewrite"])
def test_a_replayed_policy_drafts_and_keeps_what_serving_does(real_model_dir, task):
    codec = TextCodec(real_model_dir)
    runner = whole_runner(real_model_dir, backend="torch-cpu", parallel=1, context=512,
                          chunk=CHUNK)
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": TASKS[task]}]))
    plain = serve_one(runner, codec, prompt, TOKENS, None, CHUNK)
    served = serve_one(runner, codec, prompt, TOKENS, DraftPolicy(PromptLookup(), 5), CHUNK)

    _rounds, drafted, accepted = replay(prompt, plain.tokens, Policy("served", PromptLookup(), 5),
                                        TOKENS)

    assert served.tokens == plain.tokens
    assert (drafted, accepted) == (served.drafted, served.accepted)
    assert drafted > 0  # both tasks draft: the copy keeps most, the paraphrase some
