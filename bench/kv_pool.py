"""What a KV pool in pages (FLEET_KV_PAGES) costs a decode round against a whole window a
slot, side by side in one run.

    python bench/kv_pool.py --backend mlx-cpu --prompt 8000 --batches 1,4
    python bench/kv_pool.py --backend torch-cpu --prompt 8000 --batches 1,4
    python bench/kv_pool.py --backend mlx-cpu --context 32768 --prompt 2000 --batches 4

Three stages of the same model serve the same conversations, their decode rounds timed in
lockstep (bench/decode.py), so a busy machine's slow spells fall on all three alike:

- `windows`: FLEET_KV_PAGES=0, a whole context a slot (on PyTorch a pool of that many
  pages);
- `pool`: a pool as large as the windows, every stream prompted beside the others and
  beside one more that is not timed, a page a stream a round;
- `tight pool`: the same, in a pool of exactly the pages those streams reach, so that
  streams growing side by side run into each other's pages and go on elsewhere.

MLX reads a stream whose pages are consecutive as one slice, as a window, and gathers one
whose pages are not every round (docs/mlx-backend.md); the `gathered` column counts the
timed streams whose pages are not consecutive when the timing starts. PyTorch reads every
stream through its page table either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, table
from bench.decode import Decoding, lockstep_steps, prompts
from engine.kv_pages import PAGE_POSITIONS, consecutive, pages_for

LAYOUTS = ("windows", "pool", "tight pool")


def open_streams(decodings: dict[str, Decoding], batch: int, prompt: int
                 ) -> dict[str, dict[int, int]]:
    """Each decoding's `batch` conversations of `prompt` tokens and slot `batch`'s beside
    them (left open, not timed), untimed, a page a slot a round. Returns each decoding's
    next tokens of slots [0, batch)."""
    out = {}
    for layout, decoding in decodings.items():
        ids = prompts(batch + 1, prompt, decoding.driver.stage.config.vocab_size)
        for start in range(0, prompt, PAGE_POSITIONS):
            drawn = decoding.next_tokens({s: p[start:start + PAGE_POSITIONS]
                                          for s, p in ids.items()})
        out[layout] = {s: t for s, t in drawn.items() if s < batch}
    return out


def gathered(decoding: Decoding, batch: int) -> int:
    """Timed streams whose pages are not consecutive (MLX gathers them every round)."""
    cache = decoding.driver.stage.model.cache
    pages = getattr(cache, "kv", cache).pages  # a hybrid's attention layers'
    return sum(not consecutive(held) for held in pages.held[:batch])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo", help="tiny, demo or 8b (when no --model)")
    parser.add_argument("--backend", default="mlx-cpu")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt", type=int, default=8000, help="conversation tokens")
    parser.add_argument("--context", type=int, default=0,
                        help="the configured context (FLEET_CONTEXT); default: the conversation's")
    parser.add_argument("--steps", type=int, default=16, help="decode rounds a pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes a stream count")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = checkpoint(args.model, args.preset)
    reach = args.prompt + args.steps * (args.repeats + 1) + 1  # positions a stream reaches
    context = max(args.context, reach)
    slots = max(batches) + 1  # the streams' untimed neighbour takes one
    pool = {"windows": 0, "pool": slots * pages_for(context)}
    rows = []
    for batch in batches:
        # the tight pool: the pages every stream reaches by the last timed round
        pool["tight pool"] = (batch + 1) * pages_for(reach)
        decodings = {layout: Decoding(model_dir, args.backend, slots, context, 512,
                                      kv_pages=pool[layout]) for layout in LAYOUTS}
        tokens = open_streams(decodings, batch, args.prompt)
        scattered = {layout: gathered(d, batch) for layout, d in decodings.items()
                     if layout != "windows"}
        lockstep_steps(decodings, tokens, args.steps)  # warm-up
        passes = [lockstep_steps(decodings, tokens, args.steps) for _ in range(args.repeats)]
        del decodings
        ms = {layout: statistics.median(p[layout] for p in passes) for layout in LAYOUTS}
        for layout in LAYOUTS:
            rows.append([args.backend, batch, args.prompt, layout,
                         scattered.get(layout, "-"), ms[layout], ms[layout] / ms["windows"]])
        print(f"# batch {batch}: {ms}", flush=True)
    table(f"decode rounds by KV layout ({model_dir.name}, context {context}, "
          f"{args.prompt}-token conversations, "
          f"median of {args.repeats} passes of {args.steps} rounds)",
          ["backend", "streams", "conversation", "KV", "gathered", "ms/round", "/ windows"],
          rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
