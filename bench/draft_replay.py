"""Drafting policies replayed on real replies, without timing: how many tokens a round each
would hand out on bench/drafting.py's tasks.

    make real-model && python bench/draft_replay.py

A greedy reply is the same with a drafter as without one, so the rounds a drafter would
run can be replayed on the reply's tokens: each round proposes from the history (prompt
and the reply so far), keeps the drafts that equal the reply's next tokens, and hands out
those plus one. The replies are generated once (whole, torch-cpu); each policy is then
pure arithmetic, so the comparison carries none of a shared machine's noise. A verify
row's cost is left out: the tokens a round are what a policy buys, bench/drafting.py and
bench/verify_rounds.py what it pays.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, table
from bench.drafting import TASKS, serve_one
from engine.harness.local_pipeline import whole_runner
from engine.lanes.drafting import Drafting, DraftLength, PromptLookup
from engine.lanes.text import TextCodec


@dataclass(frozen=True)
class Policy:
    name: str
    lookup: PromptLookup
    most: int  # draft_tokens
    pauses: bool = True  # back off after rejections (DraftLength), as served


class NoPauses(DraftLength):
    """A draft length that never backs off: every round may draft."""

    def allowed(self) -> int:
        return self.next


POLICIES = (
    Policy("served: n 2-4, 5 drafts", PromptLookup(), 5),
    Policy("no pauses", PromptLookup(), 5, pauses=False),
    Policy("n 1-4", PromptLookup(min_n=1), 5),
    Policy("n 1-4, no pauses", PromptLookup(min_n=1), 5, pauses=False),
    Policy("7 drafts", PromptLookup(), 7),
    Policy("n 2-8, 10 drafts, no pauses", PromptLookup(max_n=8), 10, pauses=False),
)


def replay(prompt: list[int], reply: list[int], policy: Policy,
           max_tokens: int) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of decoding `reply` (its first token from the prompt's
    round) under `policy`, for a request of `max_tokens`: the lane host's own `Drafting`,
    asked and told as serving asks and tells it. A reply ended by a stop token instead of
    the limit may differ from serving in its last round, where a draft past the reply's end
    counts as rejected."""
    drafting = Drafting(policy.lookup, policy.most, prompt, len(prompt) + max_tokens)
    if not policy.pauses:
        drafting.length = NoPauses(policy.most)
    drafting.took(reply[0])
    done, rounds = 1, 0
    while done < len(reply):
        drafts = drafting.propose(max_tokens - done - 1)  # room after the round's next token
        kept = 0
        while kept < min(len(drafts), len(reply) - done) and drafts[kept] == reply[done + kept]:
            kept += 1
        if drafts:
            drafting.verified(len(drafts), kept)
        for token_id in reply[done:done + kept + 1]:
            drafting.took(token_id)
        rounds, done = rounds + 1, done + kept + 1
    return rounds, drafting.drafted, drafting.accepted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=256, help="most tokens a reply has")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        parser.error(f"no checkpoint at {args.model}: run `make real-model` first")
    codec = TextCodec(args.model)
    runner = whole_runner(args.model, backend="torch-cpu", parallel=2, context=4096, chunk=256)
    rows = []
    for task, text in TASKS.items():
        prompt = codec.encode(codec.render_chat([{"role": "user", "content": text}]))
        reply = serve_one(runner, codec, prompt, args.tokens, None, 256).tokens
        for policy in POLICIES:
            rounds, drafted, accepted = replay(prompt, reply, policy, args.tokens)
            rows.append([task, len(reply), policy.name, rounds, drafted,
                         f"{accepted / max(1, drafted):.0%}",
                         f"{(len(reply) - 1) / max(1, rounds):.2f}"])
    table(f"Drafting policies replayed on greedy replies ({args.model.name})",
          ["task", "reply tokens", "policy", "rounds", "drafted", "accepted",
           "tokens a round"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
