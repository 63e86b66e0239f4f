"""What a KV pool in pages (FLEET_KV_PAGES) costs a decode round against a whole window a
slot, side by side in one run.

    python bench/kv_pool.py --backend mlx-cpu --prompt 8000 --batches 1,4
    python bench/kv_pool.py --backend torch-cpu --prompt 8000 --batches 1,4

Three stages of the same model serve the same conversations, their decode rounds timed in
lockstep (bench/decode.py), so a busy machine's slow spells fall on all three alike:

- `windows`: FLEET_KV_PAGES=0, a whole context a slot (on PyTorch a pool of that many
  pages, each slot's in order);
- `pool, in order`: a pool, each stream prompted alone, so its pages are consecutive
  (on MLX read as one slice, as a window is);
- `pool, scattered`: the same pool, every stream prompted in rounds of one page a slot
  beside a stream that is not timed, so that no two of a stream's pages are neighbours
  (on MLX gathered into one run every round: the price of a pool where conversations
  grow side by side).

The pool holds as many pages as the windows: what is measured is where pages lie, not
how many there are.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, table
from bench.decode import Decoding, lockstep_steps, prompts
from engine.kv_pages import PAGE_POSITIONS, pages_for

LAYOUTS = ("windows", "pool, in order", "pool, scattered")


def open_streams(decodings: dict[str, Decoding], batch: int, prompt: int
                 ) -> dict[str, dict[int, int]]:
    """Each decoding's `batch` conversations of `prompt` tokens, untimed, prompted as its
    layout says; the scattered one's slot `batch` is prompted beside them and left open.
    Returns each decoding's next tokens of slots [0, batch)."""
    out = {}
    for layout, decoding in decodings.items():
        vocab = decoding.driver.stage.config.vocab_size
        if layout == "pool, scattered":
            ids = prompts(batch + 1, prompt, vocab)
            for start in range(0, prompt, PAGE_POSITIONS):
                drawn = decoding.next_tokens({s: p[start:start + PAGE_POSITIONS]
                                              for s, p in ids.items()})
            out[layout] = {s: t for s, t in drawn.items() if s < batch}
            continue
        out[layout] = {}
        for slot, ids in prompts(batch, prompt, vocab).items():
            for start in range(0, prompt, 512):
                drawn = decoding.next_tokens({slot: ids[start:start + 512]})
            out[layout][slot] = drawn[slot]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo", help="tiny, demo or 8b (when no --model)")
    parser.add_argument("--backend", default="mlx-cpu")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt", type=int, default=8000, help="conversation tokens")
    parser.add_argument("--steps", type=int, default=16, help="decode rounds a pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes a stream count")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = checkpoint(args.model, args.preset)
    context = args.prompt + args.steps * (args.repeats + 1) + 1
    slots = max(batches) + 1  # the scattered streams' neighbour takes one
    pool = slots * pages_for(context)
    decodings = {layout: Decoding(model_dir, args.backend, slots, context, 512,
                                  kv_pages=0 if layout == "windows" else pool)
                 for layout in LAYOUTS}
    rows = []
    for batch in batches:
        tokens = open_streams(decodings, batch, args.prompt)
        lockstep_steps(decodings, tokens, args.steps)  # warm-up
        passes = [lockstep_steps(decodings, tokens, args.steps) for _ in range(args.repeats)]
        for decoding in decodings.values():
            decoding.driver.close(list(range(slots)))
            decoding.driver.drop(list(range(slots)))
        ms = {layout: statistics.median(p[layout] for p in passes) for layout in LAYOUTS}
        for layout in LAYOUTS:
            rows.append([args.backend, batch, args.prompt, layout, ms[layout],
                         ms[layout] / ms["windows"]])
        print(f"# batch {batch}: {ms}", flush=True)
    table(f"decode rounds by KV layout ({model_dir.name}, {args.prompt}-token conversations, "
          f"median of {args.repeats} passes of {args.steps} rounds)",
          ["backend", "streams", "conversation", "KV", "ms/round", "/ windows"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
