"""The Qwen3.5 MTP head as rank 0's drafter: greedy replies are the replies without it.

Random checkpoints with a whole MTP head (the maker's --mtp), served with no drafter and
with `drafter: mtp` (FLEET_DRAFTER), whole and on two stages (real follower processes),
on torch-cpu, mlx-cpu and a mixed ring (torch rank 0, MLX follower; MLX rank 0, torch
follower). The head's guesses on random weights are as good as random (1 in the vocab),
so a second run wraps the real head in a stand-in that still runs it (its cache is fed,
cut back and fed again) but proposes the plain reply's tokens, every third draft's second
one wrong: verify rounds then keep all their drafts, some and none, and the head is fed
several rows a landing. Either way every reply must be the plain one (up to a top-two tie
within 1e-4, as tests/pipeline/test_drafting.py holds the hybrid to).
"""

from __future__ import annotations

import pytest

from engine.lanes.host import DraftPolicy, GenerationRequest
from engine.rounds import VERIFY_ROWS
from tests.pipeline.conftest import pipeline
from tests.pipeline.test_drafting import (
    CHUNK,
    GREEDY,
    STEPS,
    check_same_up_to_ties,
    prompts,
    serve,
    whole_runner,
)
from tests.requirements import require

MTP = DraftPolicy(None, 3)  # rank 0's draft head, 3 drafts at most (the issue's k = 1..3)
MTP_ENV = {"FLEET_DRAFTER": "mtp"}


@pytest.fixture(scope="module")
def model_dir(make_model):
    return make_model("qwen3_5", mtp=True, seed=12)


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(tuple(p), max_tokens=STEPS, sampling=GREEDY, top_logprobs=2)
            for p in prompts(3)]


class KnownHead:
    """Rank 0's stage with its draft head run as always, its proposals replaced by the plain
    replies' next tokens (each stream told apart by its first token)."""

    def __init__(self, stage, plain) -> None:
        self.stage = stage
        self.replies = [r.tokens for r in plain]
        assert len({r[0] for r in self.replies}) == len(self.replies)
        self.calls = 0
        self.fed_rows = 0  # most rows one landing fed the head

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def draft(self, asks):
        real = self.stage.draft(asks)
        self.calls += 1
        guesses = []
        for ask, drafts in zip(asks, real, strict=True):
            assert len(drafts) == ask.count
            if not ask.count:  # a prompt chunk's rows, or a paused stream's: fed only
                guesses.append(())
                continue
            prompt = len(prompts(1)[0])
            if ask.position >= prompt:  # a decode or verify round's rows, not the prompt's
                self.fed_rows = max(self.fed_rows, len(ask.rows))
            done = ask.position + len(ask.tokens) - prompt + 1  # generated so far
            handed = list(ask.tokens[-min(done, len(ask.tokens)):])  # the reply's tokens
            reply = next(r for r in self.replies if r[done - len(handed):done] == handed)
            guess = list(reply[done:done + ask.count])
            if done % 3 == 1 and len(guess) > 1:
                guess[1] = (guess[1] + 1) % 300
            guesses.append(tuple(guess))
        return guesses


def with_known_head(runner, plain):
    runner.stage = KnownHead(runner.stage, plain)
    return runner


def check(plain, drafted, *, rare: bool) -> None:
    """The same tokens, text and ends as without a drafter, which did propose; where the
    guesses are the known ones, verify rounds both kept and refused drafts."""
    for a, b in zip(plain, drafted, strict=True):
        assert (b.tokens, b.text, b.done.finish_reason) == (a.tokens, a.text,
                                                             a.done.finish_reason)
    assert sum(r.done.drafted_tokens for r in drafted) > 0
    if not rare:  # random weights' guesses are kept by chance only
        check_same_up_to_ties(plain, drafted, 1e-4)


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_greedy_replies_are_the_same_with_the_mtp_drafter_whole_and_split(model_dir, tmp_path,
                                                                          backend):
    require("mlx.core" if backend.startswith("mlx") else "torch")
    reqs = requests()
    plain = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK), model_dir, reqs,
                  drafts=None)
    whole = serve(whole_runner(model_dir, backend=backend, chunk=CHUNK, drafter="mtp"),
                  model_dir, reqs, drafts=MTP)
    check(plain, whole, rare=True)
    known = with_known_head(whole_runner(model_dir, backend=backend, chunk=CHUNK,
                                         drafter="mtp"), plain)
    kept = serve(known, model_dir, reqs, drafts=DraftPolicy(None, VERIFY_ROWS - 1))
    check(plain, kept, rare=False)
    assert known.stage.fed_rows > 1  # a verify round's kept rows fed the head together
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=[backend] * 2,
                  chunk=CHUNK, extra_env=MTP_ENV) as runner:
        split = serve(runner, model_dir, reqs, drafts=MTP)
        check(plain, split, rare=True)
        split_known = serve(with_known_head(runner, plain), model_dir, reqs,
                            drafts=DraftPolicy(None, VERIFY_ROWS - 1))
    check(plain, split_known, rare=False)


@pytest.mark.parametrize("ring", [("torch-cpu", "mlx-cpu"), ("mlx-cpu", "torch-cpu")])
def test_a_mixed_ring_gives_its_own_replies_with_the_mtp_drafter(model_dir, tmp_path, ring):
    """A mixed ring promises determinism per placement (DESIGN.md), so its replies with the
    drafter are held to its own replies without it."""
    require("mlx.core")
    reqs = requests()
    with pipeline(model_dir, [(0, 2), (2, 4)], tmp_path / "plain", backends=list(ring),
                  chunk=CHUNK, extra_env=MTP_ENV) as runner:
        plain = serve(runner, model_dir, reqs, drafts=None)
        drafted = serve(runner, model_dir, reqs, drafts=MTP)
        check(plain, drafted, rare=True)
        known = serve(with_known_head(runner, plain), model_dir, reqs,
                      drafts=DraftPolicy(None, VERIFY_ROWS - 1))
    check(plain, known, rare=False)
