"""Time to first token of a conversation's second turn against its first, through a real ring.

    python bench/prompt_cache.py                                   # 2,000 and 8,000 tokens
    python bench/prompt_cache.py --histories 2000 --rings torch-cpu,torch-cpu

Each case starts one replica (real engine processes on loopback, the demo model's shape,
dense or hybrid, random weights) and sends, as an OpenAI client does, over HTTP with
streaming:

1. turn 1: a history of H prompt tokens, reply R tokens (greedy);
2. turn 2: the same history, turn 1's reply and N new tokens. The ring that served turn 1
   restores the slot it kept and runs only the rows past the last full chunk it reused
   (`usage.prompt_tokens_details.cached_tokens` says how many it skipped);
3. "own": a fresh prompt as long as the rows turn 2 ran (its new tokens' own prompt time).

Time to first token is the wait for the first streamed token, the median of `--repeats`
conversations (each a different history, so turn 1 never hits). The issue's goal reads
`turn 2 <= 10 % of turn 1 + own`, printed as `(turn 2 - own) / turn 1`.

"own" runs its rows at the start of a conversation, where they attend to nothing before
them; turn 2 runs the same number after the whole history. `--by-offset` shows what that
difference is worth on each backend: one process, the whole model (dense), a prompt of
`--offset-tokens` run chunk by chunk, ms a chunk by its offset, ours on every backend of
`--rings` and, for MLX, mlx-lm's model over its own KV cache beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table
from engine.checkpoint.maker import PRESETS, make_checkpoint
from engine.harness.launch import even_stages, launch

ROOT = Path(__file__).resolve().parent.parent
# The demo model's widths, and for the hybrid the same with Gated DeltaNet layers (every
# fourth layer full attention, as the 27B has it).
HYBRID = dict(family="qwen3_5", full_attention_interval=4, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def model(kind: str) -> Path:
    out = ROOT / "build" / f"bench-prompt-cache-{kind}"
    if not (out / "config.json").exists():
        demo = PRESETS["demo"]
        spec = demo if kind == "dense" else dataclasses.replace(demo, **HYBRID)
        print(f"# making the {kind} checkpoint in {out}", flush=True)
        make_checkpoint(out, spec, overwrite=True)
    return out


@dataclass(frozen=True)
class Endpoint:
    url: str  # rank 0's OpenAI base URL
    model: str  # the name it serves


async def first_token_s(session: aiohttp.ClientSession, at: Endpoint, prompt: list[int],
                        max_tokens: int) -> tuple[float, int]:
    """Stream one completion: (seconds to its first token, prompt tokens it reused)."""
    # logprobs: a chunk for every token, also one whose text is empty at random weights
    body = dict(model=at.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                logprobs=1, stream_options=dict(include_usage=True))
    started = time.perf_counter()
    first, cached = None, 0
    async with session.post(f"{at.url}/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{reply.status}: {await reply.text()}")
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            if first is None and any(c.get("logprobs") for c in chunk.get("choices", [])):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the reply streamed no token")
    return first, cached


async def conversation(at: Endpoint, rng: np.random.Generator, history: int, reply: int,
                       new: int, vocab: int) -> dict:
    def tokens(n: int) -> list[int]:
        return rng.integers(10, vocab, n).tolist()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        turn1 = tokens(history)
        t1, _ = await first_token_s(session, at, turn1, reply)
        # Turn 2 resends turn 1 and its reply; the cache reuses only turn 1's prompt chunks,
        # so which tokens stand for the reply does not change what it reuses.
        turn2 = turn1 + tokens(reply + new)
        t2, cached = await first_token_s(session, at, turn2, reply)
        own, _ = await first_token_s(session, at, tokens(len(turn2) - cached), reply)
    return dict(turn1=t1, turn2=t2, own=own, cached=cached, ran=len(turn2) - cached)


def measure(ring: list[str], kind: str, histories: list[int], args) -> list[list[object]]:
    model_dir = model(kind)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", 1024)
    layers = PRESETS["demo"].num_hidden_layers
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prompt-cache-") as run_dir, \
            launch(model_dir, even_stages(layers, len(ring)), ring, context=args.context,
                   parallel=args.parallel, chunk=args.chunk,
                   prompt_cache_slots=args.prompt_cache_slots, run_dir=Path(run_dir)) as fleet:
        fleet.wait_ready(timeout_s=300)
        rng = np.random.default_rng(0)
        for history in histories:
            runs = [asyncio.run(conversation(Endpoint(fleet.url, model_dir.name), rng, history, args.reply, args.new,
                                             vocab)) for _ in range(args.repeats + 1)][1:]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append(["+".join(ring), kind, history, med["cached"], med["ran"],
                         f"{med['turn1'] * 1e3:.0f}", f"{med['turn2'] * 1e3:.0f}",
                         f"{med['own'] * 1e3:.0f}", f"{med['turn2'] / med['turn1']:.3f}",
                         f"{(med['turn2'] - med['own']) / med['turn1']:.3f}"])
            print(f"# {rows[-1]}", flush=True)
    return rows


def chunk_ms(prompts: Iterator[Callable[[list[int]], object]], tokens: int,
             chunk: int) -> list[float]:
    """ms each `chunk`-token piece of one `tokens`-token prompt takes, in order, each fed
    to the conversation `prompts` opens (the second of two: the first warms up)."""
    ids = np.random.default_rng(0).integers(10, 1000, tokens).tolist()
    for feed in itertools.islice(prompts, 2):
        times = []
        for first in range(0, tokens, chunk):
            started = time.perf_counter()
            feed(ids[first:first + chunk])
            times.append((time.perf_counter() - started) * 1e3)
    return times


def ours(backend: str, context: int, chunk: int) -> Iterator[Callable[[list[int]], object]]:
    """Conversations on a whole dense model in this process, each in a slot of its own."""
    from engine.harness.driver import RoundDriver
    from engine.harness.local_pipeline import whole_runner

    driver = RoundDriver(whole_runner(model("dense"), backend=backend, parallel=2,
                                      context=context, chunk=chunk))
    for slot in itertools.count():
        yield lambda ids, slot=slot: driver.greedy_round({slot: ids})


def mlx_lm() -> Iterator[Callable[[list[int]], object]]:
    """The same with mlx-lm's own model and KV cache (the reference we did not write): a
    fresh cache a conversation."""
    from bench.mlx_vs_mlx_lm import MlxLm

    lm = MlxLm(model("dense"))
    while True:
        lm.reset()
        yield lm.feed


def by_offset(args) -> None:
    backends = sorted({b for ring in args.rings.split(";") for b in ring.split(",")})
    rows = []
    for backend in backends:
        rows.append([f"ours, {backend}", *chunk_ms(ours(backend, args.context, args.chunk),
                                                   args.offset_tokens, args.chunk)])
        if backend.startswith("mlx"):
            rows.append(["mlx-lm", *chunk_ms(mlx_lm(), args.offset_tokens, args.chunk)])
    offsets = list(range(0, args.offset_tokens, args.chunk))
    table(f"a {args.chunk}-row prompt chunk by its offset, the whole dense model in one "
          "process (ms)", ["", *(f"at {o:,}" for o in offsets)],
          [[r[0], *(f"{ms:.0f}" for ms in r[1:])] for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--histories", default="2000,8000")
    parser.add_argument("--rings", default="torch-cpu,torch-cpu;torch-cpu,mlx-cpu",
                        help="rings, ';' between them, one backend per stage")
    parser.add_argument("--kinds", default="dense,hybrid")
    parser.add_argument("--reply", type=int, default=32, help="tokens each turn replies")
    parser.add_argument("--new", type=int, default=48, help="turn 2's new tokens")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--prompt-cache-slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--by-offset", action="store_true",
                        help="a prompt chunk's ms by its offset, in one process, instead")
    parser.add_argument("--offset-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.by_offset:
        by_offset(args)
        return 0
    histories = [int(h) for h in args.histories.split(",")]
    rows = []
    for ring in args.rings.split(";"):
        for kind in args.kinds.split(","):
            rows += measure(ring.split(","), kind, histories, args)
    table(f"time to first token, turn 2 against turn 1 (reply {args.reply}, {args.new} new "
          f"tokens, chunk {args.chunk}, context {args.context}; ms, medians of {args.repeats})",
          ["ring", "model", "history", "reused", "ran", "turn 1", "turn 2", "own",
           "turn 2 / turn 1", "(turn 2 - own) / turn 1"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
