"""Short requests served at once by a pool of KV pages against whole windows, at the same
memory, through a real ring.

    python bench/page_admission.py                      # 16 requests, 2 windows' memory
    python bench/page_admission.py --requests 32 --windows 4

Two replicas in turn (two torch-cpu stages on loopback, the demo model's widths, random
weights, context 4,096), each given the KV memory of `--windows` whole windows a stage:

- whole windows: FLEET_PARALLEL = windows, every slot a whole context (the default);
- a pool: FLEET_KV_PAGES = windows x the pages of a window, FLEET_PARALLEL = requests, rank
  0 admitting by the pages each request's prompt and `max_tokens` may reach.

Every request is sent at once with the official client, streaming, greedy. Printed side by
side: the most requests decoding at the same moment (from each reply's first and last
token), the wall time until the last reply ends, and the tokens a second that gives.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, n_layers, table
from engine.harness.launch import even_stages, launch
from engine.kv_pages import PAGE_POSITIONS, pages_for

CONTEXT, CHUNK = 4096, 256


async def serve_all(url: str, requests: int, max_tokens: int) -> tuple[float, int, int, int]:
    """(wall seconds, the most replies decoding at once, completion tokens, the longest
    prompt in tokens)."""
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    name = (await client.models.list()).data[0].id

    async def one(i: int) -> tuple[float, float, int, int]:
        words = " ".join(f"item{i}-{j}" for j in range(40))
        stream = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": words}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        first = last = 0.0
        tokens = prompt = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content is not None:
                last = time.monotonic()
                first = first or last
            if chunk.usage is not None:
                tokens, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        return first, last, tokens, prompt

    started = time.monotonic()
    spans = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.monotonic() - started
    at_once = max(sum(a <= t <= b for a, b, _, _ in spans) for t, _, _, _ in spans)
    await client.close()
    return (wall, at_once, sum(span[2] for span in spans), max(span[3] for span in spans))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--windows", type=int, default=2, help="whole windows' memory a stage")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = checkpoint(None, "demo")
    pool = args.windows * pages_for(CONTEXT)
    cases = {"whole windows": (args.windows, {}),
             "a pool of pages": (args.requests, {"FLEET_KV_PAGES": str(pool)})}
    rows, results = [], {}
    for name, (parallel, env) in cases.items():
        with tempfile.TemporaryDirectory() as run_dir, \
                launch(model_dir, even_stages(n_layers(model_dir), 2), context=CONTEXT,
                       parallel=parallel, chunk=CHUNK, run_dir=Path(run_dir),
                       extra_env=env) as fleet:
            fleet.wait_ready()
            results[name] = asyncio.run(serve_all(fleet.url, args.requests, args.max_tokens))
        wall, at_once, tokens, prompt = results[name]
        rows.append([name, parallel, pool * PAGE_POSITIONS, at_once, f"{wall:.1f}",
                     f"{tokens / wall:.1f}"])
    (whole_wall, whole_at_once, _, _), (pool_wall, pool_at_once, _, _) = results.values()
    table(f"{args.requests} requests of up to {prompt} prompt tokens and {args.max_tokens} "
          f"reply tokens, "
          f"sent at once; KV memory of {args.windows} windows of {CONTEXT} positions a stage",
          ["KV", "streams (FLEET_PARALLEL)", "positions a stage holds", "most decoding at once",
           "wall s", "tokens/s"], rows)
    print(f"\npool / whole windows: {pool_at_once / whole_at_once:.2f}x the requests at once, "
          f"{whole_wall / pool_wall:.2f}x the throughput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
