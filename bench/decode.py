"""Decode speed of our engine against the reference implementation, side by side in one run.

    python bench/decode.py --preset demo --backend torch-cpu --batches 1,8
    python bench/decode.py --preset 8b --device cuda --batches 1,8           # on a GPU
    python bench/decode.py --preset demo --backend mlx-cpu                   # vs mlx-lm
    python bench/decode.py --preset demo --contexts 256,32768 --prompt 96 --no-reference
    python bench/decode.py --preset demo --contexts 8192,32768 --prompt 8000 --prompt-chunk 512 \
        --prompt-once --no-reference                                        # long, on a CPU
    python bench/decode.py --preset 8b --device cuda --anchor --no-reference  # vs the anchor
    python bench/decode.py --preset 8b --device cuda --prompt-rate 8192 --no-reference

PyTorch backends are compared with transformers' `generate`, MLX backends with mlx-lm's
`generate_step`, on the same checkpoint, device and dtype. Our decode rounds are timed
directly after an untimed prompt round (greedy, each token drawn on the stage's device and
only its id brought to the host, as serving does); the references' time per step is the difference between generating
N + 1 tokens and 1 token, divided by N, so prompt processing cancels out. On CUDA it also prints ms per token against the
floor set by weight bytes / memory bandwidth.

The configured context (`--contexts`, FLEET_CONTEXT) is separate from the conversation
(`--prompt` tokens, then `--steps` decoded): the same conversation is timed under each
context, so the table shows whether a step's cost follows the conversation (ratio near 1)
or the context. A long conversation on a slow machine: `--prompt-chunk` prompts in rounds
of that many rows, `--prompt-once` prompts once per stream count and times each repeat as
the conversation's next `--steps` tokens. With CUDA graphs it also times the path before
live-length buckets, whose captured steps read the whole context, beside the current one
in the same run.

`--anchor` times our stage with its decode layers compiled (FLEET_COMPILE=on) and eager
(off), and compiled with each round's logits brought to the host (where this bench drew
tokens before), in lockstep, then the anchor (bench/anchor.py: a gpt-fast-style step
compiled with mode="reduce-overhead") in the same process, at each stream count, all
against weight bytes / the copy bandwidth measured here; and prints each side's cold
start (the first pass, compiling and capturing, from empty Inductor caches; the anchor's
at the first stream count only, later ones find its kernels cached). The anchor keeps its
tokens on the device and waits at the end of a pass, gpt-fast's way; ours brings each
step's token ids to the host, as serving does.

`--prompt-rate N` times one stream's N-token prompt in rounds of `--chunk` rows and
prints prompt tokens/s and the share of the device's dense matrix rate it reaches:
2 x (layer parameters) x tokens (+ the head, once a round) over the time, against
`--peak-tflops` (an H200's dense bf16: 989). Attention's own FLOPs are left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    add_unstacked,
    checkpoint,
    copy_bandwidth_gbs,
    median_s,
    n_layers,
    projections_apart,
    table,
)
from engine.backends.base import StageSpec, load_stage
from engine.harness.driver import RoundDriver
from engine.pipeline.runner import LocalRunner


def prompts(batch: int, length: int, vocab: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(0)
    return {s: rng.integers(0, min(vocab, 256), length).tolist() for s in range(batch)}


class Decoding:
    """One stage serving every stream count of a run (slots [0, batch)); each round's next
    tokens drawn greedily on the stage's device, only the ids brought to the host, as
    serving does (`on_device`), or from the logits brought to the host."""

    def __init__(self, model_dir: Path, backend: str, parallel: int, context: int, chunk: int,
                 cuda_graphs: bool = True, live_keys: bool = True,
                 compile_mode: str = "auto", on_device: bool = True, kv_pages: int = 0) -> None:
        spec = StageSpec(model_dir, (0, n_layers(model_dir)), backend, parallel, context,
                         chunk, cuda_graphs, live_keys, compile=compile_mode, kv_pages=kv_pages)
        self.driver = RoundDriver(LocalRunner(load_stage(spec)))
        self.on_device = on_device

    def next_tokens(self, feeds: dict[int, list[int]]) -> dict[int, int]:
        """One round of `feeds` (slot -> ids); slot -> its greedy next token."""
        if self.on_device:
            return self.driver.greedy_round(feeds)
        return {s: int(np.argmax(row)) for s, row in self.driver.round(feeds).items()}


def open_conversations(decodings: dict[object, Decoding], batch: int, prompt: int,
                       prompt_chunk: int = 0) -> dict[object, dict[int, int]]:
    """Each decoding's `batch` conversations prompted, untimed: in one round, or with
    `prompt_chunk` > 0 in rounds of that many rows shared among the slots (a long prompt
    in one round would build attention over all of its rows at once). Returns each
    decoding's next tokens."""
    out = {}
    for key, decoding in decodings.items():
        ids = prompts(batch, prompt, decoding.driver.stage.config.vocab_size)
        per_slot = max(1, prompt_chunk // batch) if prompt_chunk else prompt
        for start in range(0, prompt, per_slot):
            out[key] = decoding.next_tokens({s: p[start:start + per_slot]
                                             for s, p in ids.items()})
    return out


def lockstep_steps(decodings: dict[object, Decoding], tokens: dict[object, dict[int, int]],
                   steps: int) -> dict[object, float]:
    """ms/step of `steps` greedy decode rounds of each decoding, each decoding's round timed
    in turn, step by step, so a busy machine's slow spells fall on all of them alike.
    `tokens` (each decoding's next) advances in place."""
    spent = dict.fromkeys(decodings, 0.0)
    for _ in range(steps):
        for key, decoding in decodings.items():
            start = time.perf_counter()
            # The token reaches the host (ids, or the logits): a sync, as serving's is.
            tokens[key] = decoding.next_tokens({s: [t] for s, t in tokens[key].items()})
            spent[key] += time.perf_counter() - start
    return {key: t * 1000 / steps for key, t in spent.items()}


def lockstep_pass(decodings: dict[object, Decoding], batch: int, prompt: int,
                  steps: int, prompt_chunk: int = 0) -> dict[object, float]:
    """ms/step of each decoding over one conversation: an untimed prompt, then `steps`
    timed greedy decode rounds (lockstep_steps); slots closed after."""
    tokens = open_conversations(decodings, batch, prompt, prompt_chunk)
    out = lockstep_steps(decodings, tokens, steps)
    for decoding in decodings.values():
        decoding.driver.close(list(range(batch)))
    return out


def interleaved_ms_per_step(decodings: dict[object, Decoding], batches: list[int], steps: int,
                            prompt: int, repeats: int, prompt_chunk: int = 0,
                            prompt_once: bool = False) -> dict[tuple[object, int], float]:
    """Median ms/step per (decoding, batch) over `repeats` lockstep passes after one
    untimed pass (warm-up, and graph captures). `prompt_once`: one conversation per batch,
    prompted once, its passes the next `steps` tokens of it each (a long prompt costs more
    than the decoding it sets up; the conversation grows by `steps` a pass)."""
    out = {}
    for batch in batches:
        if prompt_once:
            tokens = open_conversations(decodings, batch, prompt, prompt_chunk)
            lockstep_steps(decodings, tokens, steps)
            passes = [lockstep_steps(decodings, tokens, steps) for _ in range(repeats)]
            for decoding in decodings.values():
                decoding.driver.close(list(range(batch)))
        else:
            lockstep_pass(decodings, batch, prompt, steps, prompt_chunk)
            passes = [lockstep_pass(decodings, batch, prompt, steps, prompt_chunk)
                      for _ in range(repeats)]
        out.update({(key, batch): statistics.median(p[key] for p in passes)
                    for key in decodings})
    return out


def ours_ms_per_step(model_dir: Path, backend: str, batches: list[int], steps: int,
                     prompt: int, repeats: int, *, cuda_graphs: bool = True) -> dict[int, float]:
    """Decode rounds timed directly, per stream count, with a context the conversation fits."""
    decoding = Decoding(model_dir, backend, max(batches), prompt + steps + 8,
                        prompt * max(batches), cuda_graphs)
    times = interleaved_ms_per_step({None: decoding}, batches, steps, prompt, repeats)
    del decoding
    release_device_memory()
    return {batch: times[None, batch] for batch in batches}


def release_device_memory() -> None:
    """Free a stage's KV cache before the next one is made (32768 positions x 8 slots of
    an 8B model is 34 GB)."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def transformers_ms_per_step(model_dir: Path, device: str, batch: int, steps: int, prompt: int,
                             repeats: int) -> float:
    import torch
    import transformers

    dtype = json.loads((model_dir / "config.json").read_text()).get("dtype", "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(list(prompts(batch, prompt, model.config.vocab_size).values()),
                       device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    whole = median_s(lambda: generate(steps + 1), repeats=repeats, sync=sync)
    first = median_s(lambda: generate(1), repeats=repeats, sync=sync)
    return (whole - first) * 1000 / steps


def mlx_lm_ms_per_step(model_dir: Path, steps: int, prompt: int, repeats: int) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _tokenizer = load(str(model_dir))
    ids = mx.array(prompts(1, prompt, 256)[0])

    def generate(n: int) -> None:
        for i, (token, _logprobs) in enumerate(generate_step(ids, model, max_tokens=n)):
            mx.eval(token)
            if i + 1 == n:
                break

    whole = median_s(lambda: generate(steps + 1), repeats=repeats)
    first = median_s(lambda: generate(1), repeats=repeats)
    return (whole - first) * 1000 / steps


def weight_bytes_per_step(model_dir: Path) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row is read)."""
    from engine.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    total = 0
    for name in ckpt.tensor_names():
        if name == "model.embed_tokens.weight" and "lm_head.weight" in ckpt.weight_map:
            continue
        shape = ckpt.tensor_shape(name)
        itemsize = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}.get(ckpt.tensor_dtype(name), 2)
        total += int(np.prod(shape)) * itemsize
    return total


def anchor_rows(model_dir: Path, backend: str, batches: list[int], steps: int, prompt: int,
                repeats: int) -> list[list[object]]:
    """Ours compiled and eager (lockstep), then the anchor, per stream count, against the
    floor: weight bytes / the measured copy bandwidth."""
    import torch
    from torch._inductor.utils import fresh_inductor_cache

    from bench.anchor import time_anchor

    device = backend.removeprefix("torch-")
    # Compiled with the token drawn on the device (serving's path), compiled with the
    # logits brought to the host (this bench's path before), and eager (device draws).
    modes = {"on": ("on", True), "on, logits": ("on", False), "off": ("off", True)}
    decodings = {key: Decoding(model_dir, backend, max(batches), prompt + steps + 8,
                               prompt * max(batches), compile_mode=mode, on_device=on_device)
                 for key, (mode, on_device) in modes.items()}
    cold = {}
    for key, decoding in decodings.items():  # the first pass compiles and captures
        start = time.perf_counter()
        with fresh_inductor_cache():  # a cold start: nothing compiled before
            lockstep_pass({key: decoding}, max(batches), prompt, 2)
        cold[key] = time.perf_counter() - start
    ours = interleaved_ms_per_step(decodings, batches, steps, prompt, repeats)
    del decodings
    release_device_memory()
    bandwidth = copy_bandwidth_gbs(device)
    floor_ms = weight_bytes_per_step(model_dir) / (bandwidth * 1e9) * 1000
    print(f"# copy bandwidth {bandwidth:.1f} GB/s: floor {floor_ms:.3f} ms/step; our first "
          f"pass {cold['on']:.1f} s compiled, {cold['off']:.1f} s eager", flush=True)
    dtype = getattr(torch, json.loads((model_dir / "config.json").read_text()).get(
        "dtype", "float32"))
    rows = []
    for batch in batches:
        anchor = time_anchor(model_dir, torch.device(device), dtype, batch, prompt, steps,
                             repeats, cold=batch == batches[0])
        release_device_memory()
        compiled, logits, eager = (ours[key, batch] for key in modes)
        rows.append([backend, batch, compiled, logits, eager, anchor.ms_per_step,
                     compiled / anchor.ms_per_step, floor_ms, floor_ms / compiled,
                     floor_ms / eager, floor_ms / anchor.ms_per_step, anchor.cold_start_s])
        print(f"# anchor, batch {batch}: {rows[-1]}", flush=True)
    return rows


def prompt_rate_row(model_dir: Path, backend: str, tokens: int, chunk: int, repeats: int,
                    peak_tflops: float) -> list[object]:
    """One stream's `tokens`-token prompt in rounds of `chunk` rows: tokens/s, and the
    share of the peak matrix rate its layers' and head's matmuls reach."""
    from engine.checkpoint.reader import open_checkpoint

    driver = Decoding(model_dir, backend, 1, tokens + 8, chunk).driver
    ids = prompts(1, tokens, driver.stage.config.vocab_size)[0]

    def prompt_once() -> None:
        for start in range(0, tokens, chunk):
            driver.round({0: ids[start:start + chunk]})  # logits reach the host: a sync
        driver.close([0])

    seconds = median_s(prompt_once, repeats=repeats)
    ckpt = open_checkpoint(model_dir)
    layer_params = sum(int(np.prod(ckpt.tensor_shape(n))) for n in ckpt.tensor_names()
                       if ".layers." in n)
    config = json.loads((model_dir / "config.json").read_text())
    head_params = config["hidden_size"] * config["vocab_size"]
    flops = 2 * layer_params * tokens + 2 * head_params * -(-tokens // chunk)
    return [backend, tokens, chunk, seconds * 1000, tokens / seconds,
            flops / seconds / 1e12, flops / seconds / (peak_tflops * 1e12)]


def context_rows(model_dir: Path, backend: str, batches: list[int], contexts: list[int],
                 steps: int, prompt: int, repeats: int, graphs: bool, prompt_chunk: int = 0,
                 prompt_once: bool = False) -> list[list[object]]:
    """ms/step of one conversation under each configured context, timed in lockstep: the
    live-length path and, where captured graphs exist, the whole-context one after it."""
    needed = prompt + steps * (repeats + 1 if prompt_once else 1) + 1
    usable = [c for c in contexts if c >= needed]
    for skipped in sorted(set(contexts) - set(usable)):
        print(f"# context {skipped} cannot hold a {needed}-position conversation: skipped")
    rows_a_round = prompt_chunk or prompt * max(batches)
    times = {}
    for live_keys in (True, False) if graphs else (True,):
        decodings = {(c, live_keys): Decoding(model_dir, backend, max(batches), c,
                                              rows_a_round, live_keys=live_keys)
                     for c in usable}
        times.update(interleaved_ms_per_step(decodings, batches, steps, prompt, repeats,
                                             prompt_chunk, prompt_once))
        del decodings
        release_device_memory()
    rows = []
    for batch in batches:
        for c in usable:
            live = times[(c, True), batch]
            row = [backend, batch, prompt, c, live, live / times[(usable[0], True), batch]]
            if graphs:
                whole = times[(c, False), batch]
                row += [whole, whole / times[(usable[0], False), batch], whole / live]
            else:
                row += ["-", "-", "-"]
            rows.append(row)
            print(f"# context {c}, batch {batch}: {row}", flush=True)
    return rows


def time_inductor_choices() -> None:
    """Undo compiled_step's deterministic mode each time it is set, for this process."""
    from engine.backends.pytorch import compiled_step

    prepare = compiled_step._prepare

    def prepare_then_time() -> None:
        prepare()
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = False

    compiled_step._prepare = prepare_then_time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo", help="tiny, demo or 8b (when no --model)")
    parser.add_argument("--backend", default="torch-cpu")
    parser.add_argument("--device", choices=["cpu", "cuda", "mps"],
                        help="shorthand for --backend torch-DEVICE")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32, help="conversation tokens before decode")
    parser.add_argument("--contexts", default="",
                        help="configured contexts (FLEET_CONTEXT) to time the same conversation "
                             "under, e.g. 256,32768; empty: only what the conversation needs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-chunk", type=int, default=0,
                        help="with --contexts: prompt rows a round, shared among the streams "
                             "(0: the whole prompt in one round)")
    parser.add_argument("--prompt-once", action="store_true",
                        help="with --contexts: prompt each conversation once and time each "
                             "repeat as its next --steps tokens (for long prompts on slow "
                             "machines; the conversation grows by --steps a repeat)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="memory bandwidth for the floor (H200 HBM3e: 4800 GB/s)")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's CPU threads (FLEET_CPU_THREADS in serving); 0: torch's own")
    parser.add_argument("--anchor", action="store_true",
                        help="time ours compiled and eager against bench/anchor.py's step")
    parser.add_argument("--prompt-rate", type=int, default=0,
                        help="time one stream's prompt of this many tokens (0: not)")
    parser.add_argument("--chunk", type=int, default=2048, help="prompt rows a round")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the device's dense matrix rate in the model's dtype "
                             "(H200 bf16: 989)")
    add_unstacked(parser)
    parser.add_argument("--inductor-timed", action="store_true",
                        help="let Inductor time its launch choices, as before its "
                             "deterministic mode: prices that mode (a ring's stages may then "
                             "round differently from one process; never for serving)")
    args = parser.parse_args()
    if args.inductor_timed:
        time_inductor_choices()
    if args.unstacked:
        projections_apart()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.device:
        args.backend = f"torch-{args.device}"
    model_dir = checkpoint(args.model, args.preset)
    device = args.backend.split("-", 1)[1]
    reference = "mlx-lm" if args.backend.startswith("mlx") else "transformers"
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    graphs = args.backend == "torch-cuda"  # the stage captures decode graphs by default
    if args.prompt_rate:
        table(f"prompt rate, {model_dir.name}, one stream (FLOP share: against "
              f"{args.peak_tflops:g} TFLOP/s)",
              ["backend", "prompt tokens", "chunk", "ms", "prompt tok/s", "TFLOP/s",
               "share of peak"],
              [prompt_rate_row(model_dir, args.backend, args.prompt_rate, args.chunk,
                               args.repeats, args.peak_tflops)])
        release_device_memory()
    if args.anchor:
        table(f"decode against the anchor, {model_dir.name}, {args.steps} steps after a "
              f"{args.prompt}-token prompt (floor: weight bytes / measured copy bandwidth)",
              ["backend", "batch", "ours compiled ms/step",
               "ours compiled, logits to the host", "ours eager ms/step", "anchor ms/step", "ours compiled / anchor", "floor ms", "compiled: floor share",
               "eager: floor share", "anchor: floor share", "anchor first calls s"],
              anchor_rows(model_dir, args.backend, batches, args.steps, args.prompt,
                          args.repeats))
    if (args.anchor or args.prompt_rate) and args.no_reference and not contexts:
        return 0
    if contexts:
        table(f"decode by configured context, {model_dir.name}, {args.steps} steps after a "
              f"{args.prompt}-token prompt (ratio: against context {contexts[0]})",
              ["backend", "batch", "conversation", "context", "ms/step", "ratio",
               "whole-context graphs ms/step", "whole-context ratio",
               "whole-context / live"],
              context_rows(model_dir, args.backend, batches, contexts, args.steps,
                           args.prompt, args.repeats, graphs, args.prompt_chunk,
                           args.prompt_once))
        if args.no_reference:
            return 0
    ours = ours_ms_per_step(model_dir, args.backend, batches, args.steps, args.prompt,
                            args.repeats)
    rows = []
    for batch in batches:
        row = [args.backend, batch, ours[batch], batch * 1000 / ours[batch]]
        if args.no_reference or (reference == "mlx-lm" and batch != 1):
            row += ["-", "-", "-"]
        else:
            ref = (mlx_lm_ms_per_step(model_dir, args.steps, args.prompt, args.repeats)
                   if reference == "mlx-lm" else
                   transformers_ms_per_step(model_dir, device, batch, args.steps, args.prompt,
                                            args.repeats))
            row += [ref, batch * 1000 / ref, ref / ours[batch]]
        rows.append(row)
        print(f"# batch {batch}: {row}", flush=True)
    table(f"decode, {model_dir.name}, {args.steps} steps after a {args.prompt}-token prompt",
          ["backend", "batch", "ours ms/step", "ours tok/s", f"{reference} ms/step",
           f"{reference} tok/s", f"speed-up vs {reference}"], rows)
    if device == "cuda":
        eager = ours_ms_per_step(model_dir, args.backend, [1], args.steps, args.prompt,
                                 args.repeats, cuda_graphs=False)[1]
        floor_ms = weight_bytes_per_step(model_dir) / (args.bandwidth_gbs * 1e9) * 1000
        table("decode against the memory-bandwidth floor (batch 1)",
              ["weight bytes / bandwidth, ms", "ours ms/token (CUDA graphs)",
               "ours ms/token (eager)", "fraction of the floor (graphs)",
               "fraction of the floor (eager)"],
              [[floor_ms, rows[0][2], eager, floor_ms / rows[0][2], floor_ms / eager]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
