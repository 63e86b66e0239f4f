"""Speculative rounds with prompt lookup against plain decoding, on a real model, as users
are served: one stream through rank 0's lane host, whole and on two stages.

    make real-model && python bench/drafting.py                  # SmolLM2-135M-Instruct
    python bench/drafting.py --tokens 400 --draft-tokens 5,7 --repeats 3

Five chat tasks, greedy, each reply `--tokens` long at most:
- rewrite: a paragraph, then "rewrite it with one change" (the reply should repeat the
  prompt; SmolLM2-135M paraphrases instead);
- copy: "copy this text with one change", then the paragraph (SmolLM2 copies it);
- code: a Python file, then "rename a function and return the whole file" (SmolLM2
  rewrites the file its own way);
- docstring: "add a docstring to a function and return the whole file", then the file;
- chat: a free question (little of the reply is in its prompt: the drafter must back off).

For each task and placement it prints the decode tokens/s without a drafter and with one
(after the first token, whose time is the prompt's), their ratio (the issue's goals: at
least 1.8x on the repeating tasks on two stages, at least 0.97x on free chat), the share
of drafted tokens accepted, the tokens a round hands out, and whether the reply is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, n_layers, table
from engine.harness.local_pipeline import local_pipeline, whole_runner
from engine.lanes.drafting import PromptLookup
from engine.lanes.host import Done, DraftPolicy, Failed, GenerationRequest, LaneHost, Token
from engine.lanes.text import TextCodec
from engine.pipeline.runner import RoundRunner
from engine.sampling import SamplingParams

PARAGRAPH = (
    "The harbour town wakes before the sun. Fishing boats slip out past the breakwater, "
    "their lamps swinging, while the bakery on Quay Street pulls the first loaves from its "
    "ovens. By seven the market square is full: crates of mackerel and crab, baskets of "
    "apples from the hill farms, and a man who has sold the same brass compasses from the "
    "same folding table for forty years. Tourists arrive on the nine o'clock ferry, and by "
    "noon the cafes along the sea wall have no empty chairs. In the evening the boats come "
    "home, the gulls follow them in, and the whole town smells of salt and woodsmoke.")
CODE = '''import json
from pathlib import Path


def load_orders(path):
    """Read the orders file: one JSON object a line."""
    orders = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            orders.append(json.loads(line))
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0) + order["amount"]
    return totals


def largest_customers(orders, count=3):
    totals = total_by_customer(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return ranked[:count]


if __name__ == "__main__":
    orders = load_orders("orders.jsonl")
    for customer, amount in largest_customers(orders):
        print(customer, amount)
'''
TASKS = {
    # The repeating tasks with the instruction after the text ("rewrite", "code") and
    # before it ("copy", "docstring"). SmolLM2-135M paraphrases the first two, so they
    # measure replies that do not repeat their prompt; it copies the text of the other two.
    "rewrite": f"{PARAGRAPH}\n\nRewrite the paragraph above word for word, changing only "
               "'harbour town' to 'mountain village'.",
    "copy": f"Copy this text exactly, but write 'mountain village' instead of 'harbour town':"
            f"\n\n{PARAGRAPH}",
    "code": f"```python\n{CODE}```\n\nRename the function total_by_customer to "
            "sum_by_customer everywhere and return the whole file, unchanged otherwise.",
    "docstring": "Add a docstring to the function total_by_customer in this file and return "
                 f"the whole file:\n\n```python\n{CODE}```",
    "chat": "What should I think about when choosing my first telescope?",
}


@dataclass(frozen=True)
class Served:
    tokens: list[int]
    decode_s: float  # from the first token to the last
    rounds: int  # rounds the reply's decoding took
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s


def serve_one(runner: RoundRunner, codec: TextCodec, prompt: list[int], max_tokens: int,
              drafts: DraftPolicy | None, chunk: int) -> Served:
    rounds = []
    host = LaneHost(runner, codec, chunk=chunk, max_waiting=1, drafts=drafts,
                    on_round=lambda plan, _logits: rounds.append(time.perf_counter()))

    async def go() -> Served:
        task = asyncio.create_task(host.run())
        stream = host.submit(GenerationRequest(tuple(prompt), max_tokens=max_tokens,
                                               sampling=SamplingParams(temperature=0.0),
                                               stop_token_ids=codec.stop_token_ids))
        tokens, first = [], None
        while not isinstance(event := await stream.events.get(), Done):
            if isinstance(event, Failed):
                raise RuntimeError(event.reason)  # noqa: TRY004 - a failed stream
            if isinstance(event, Token):
                tokens.append(event.token_id)
                first = first or time.perf_counter()
        last = time.perf_counter()
        deadline = time.monotonic() + 60  # the round that closes the slot
        while host.slots_in_use() and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.001)
        task.cancel()
        decoding = sum(first < t <= last for t in rounds)
        return Served(tokens, last - first, decoding, event.drafted_tokens, event.accepted_tokens)

    try:
        return asyncio.run(go())
    finally:
        host.close()


def median_run(runner: RoundRunner, codec: TextCodec, prompt: list[int],
               drafts: DraftPolicy | None, args) -> tuple[float, Served]:
    """The median decode tokens/s of `args.repeats` replies, and the first reply."""
    runs = [serve_one(runner, codec, prompt, args.tokens, drafts, args.chunk)
            for _ in range(args.repeats)]
    return statistics.median(r.tokens_per_s for r in runs), runs[0]


@contextmanager
def placed(placement: str, args, layers: int) -> Iterator[RoundRunner]:
    """The whole model in this process, or two stages (rank 1 a process of its own)."""
    if placement == "whole":
        yield whole_runner(args.model, backend=args.backend, parallel=2, context=args.context,
                           chunk=args.chunk)
        return
    half = layers // 2
    with local_pipeline(args.model, [(0, half), (half, layers)],
                        ROOT / "build" / "bench-drafting-run", backends=[args.backend] * 2,
                        parallel=2, context=args.context, chunk=args.chunk) as runner:
        yield runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "smollm2-135m-instruct")
    parser.add_argument("--backend", default="torch-cpu")
    parser.add_argument("--tokens", type=int, default=256, help="most tokens a reply has")
    parser.add_argument("--draft-tokens", default="5", help="drafts a round carries at most")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each; the median")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--placements", default="whole,two")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        parser.error(f"no checkpoint at {args.model}: run `make real-model` first")
    codec = TextCodec(args.model)
    prompts = {name: codec.encode(codec.render_chat([{"role": "user", "content": text}]))
               for name, text in TASKS.items() if name in args.tasks.split(",")}
    layers = n_layers(args.model)
    draft_lengths = [int(k) for k in args.draft_tokens.split(",")]
    rows = []
    for placement in args.placements.split(","):
        with placed(placement, args, layers) as runner:
            for task, prompt in prompts.items():
                serve_one(runner, codec, prompt, 8, None, args.chunk)  # warm-up
                plain_rate, plain = median_run(runner, codec, prompt, None, args)
                for most in draft_lengths:
                    rate, drafted = median_run(runner, codec, prompt,
                                               DraftPolicy(PromptLookup(), most), args)
                    rows.append([
                        task, placement, len(prompt), len(plain.tokens), most,
                        f"{plain_rate:.1f}", f"{rate:.1f}", f"{rate / plain_rate:.2f}",
                        f"{drafted.accepted / max(1, drafted.drafted):.0%}",
                        f"{(len(drafted.tokens) - 1) / max(1, drafted.rounds):.2f}",
                        "yes" if drafted.tokens == plain.tokens else "NO"])
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
    table(f"Prompt lookup against plain decoding ({args.model.name}, {args.backend}, "
          f"greedy, at most {args.tokens} tokens, context {args.context})", ["task", "placement", "prompt tokens", "reply tokens", "draft tokens",
                 "plain tok/s", "drafted tok/s", "drafted / plain", "accepted",
                 "tokens a round", "same reply"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
