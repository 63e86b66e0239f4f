"""Sampling on the host against sampling where the logits are, and the detokenizer's cost per
token at a short and a long output; side by side in one run.

    python bench/sampling.py                        # CPU: torch (and MLX when installed)
    python bench/sampling.py --device cuda          # on a GPU
    python bench/sampling.py --vocab 152064 --rows 8 --repeats 20 --threads 1

Sampling: a round's rows of float32 logits at a Qwen-sized vocabulary, already on the
device (as the head leaves them). "host" is what serving did before: bring every row to
the host and sample it in float64 numpy (`engine.lanes.sampler.sample_on_host`, the same
rule and the same work as the old per-stream sampler); "device" is
`engine.backends.pytorch.sampling` (and `engine.backends.mlx.sampling`), which brings back
only ids and logprobs. The logits are peaked as a model's are (normal, scale 4: a top-p of
0.95 keeps the number of tokens printed), and a flat case shows a nucleus wider than the
candidates, which falls back to a full sort.

Detokenizing: microseconds per token to turn a reply of 100 and of 4,000 tokens into text
deltas, re-decoding the whole output each token (as before) against the incremental
decoder (`engine.lanes.text.TextStream`), on the real tokenizer when it is built.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, checkpoint, median_s, table
from engine.lanes.sampler import sample_on_host
from engine.lanes.text import TextCodec, TextStream
from engine.sampling import NUCLEUS_CANDIDATES, RowDraw, SamplingBatch, SamplingParams, row_uniform

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature 0.8, top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


def sampling_rows(args: argparse.Namespace) -> list[list[object]]:
    import torch

    from engine.backends.pytorch import sampling as torch_sampling

    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device="cpu").manual_seed(0)
    shapes = {"peaked": 4.0, "flat": 0.05}
    logits = {name: (torch.randn(args.rows, args.vocab, generator=generator) * scale).to(device)
              for name, scale in shapes.items()}
    mlx_logits = None
    if args.mlx:
        import mlx.core as mx

        from engine.backends.mlx import sampling as mlx_sampling

        mlx_logits = {name: mx.array(x.cpu().numpy()) for name, x in logits.items()}
    rows = []
    for shape in shapes:
        for mode, params in MODES.items():
            if shape == "flat" and params.top_p == 1.0:
                continue  # only the nucleus depends on the shape
            batch = SamplingBatch.of([RowDraw(i, params, row_uniform(7, i), 0)
                                      for i in range(args.rows)])
            on_device = logits[shape]
            host_s = median_s(lambda x=on_device, b=batch: sample_on_host(x.cpu().numpy(), b),
                              repeats=args.repeats, sync=sync)
            device_s = median_s(lambda x=on_device, b=batch: torch_sampling.sample(x, b),
                                repeats=args.repeats, sync=sync)
            kept = nucleus_size(on_device[0].cpu().numpy(), params)
            row: list[object] = [f"{mode} ({shape}, nucleus {kept})", host_s * 1e3,
                                 device_s * 1e3, host_s / device_s]
            if mlx_logits is not None:
                mlx_s = median_s(lambda x=mlx_logits[shape], b=batch: mlx_sampling.sample(x, b),
                                 repeats=args.repeats)
                row += [mlx_s * 1e3, host_s / mlx_s]
            rows.append(row)
    return rows


def nucleus_size(logits: np.ndarray, params: SamplingParams) -> int | str:
    """Tokens the row's cut keeps (so the reader sees whether the candidates sufficed)."""
    if params.temperature == 0:
        return 1
    if params.top_k:
        return params.top_k
    if params.top_p >= 1.0:
        return "all"
    probs = np.exp((logits - logits.max()) / params.temperature).astype(np.float64)
    probs = np.sort(probs)[::-1] / probs.sum()
    kept = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
    return f"{kept}{'>' if kept > NUCLEUS_CANDIDATES else '<='}{NUCLEUS_CANDIDATES}"


class RedecodeStream:
    """The text stream as it was: the whole output decoded again for every token."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.ids, self.sent = codec, [], 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta


def detokenizer_rows(model_dir: Path, lengths: list[int]) -> list[list[object]]:
    codec = TextCodec(model_dir)
    text = ("The quick brown fox jumps over the lazy dog; héllo wörld ✓ 北京欢迎你. "
            "Numbers 3.14159 and code `x = f(y)` too.\n")
    ids = codec.encode(text * (max(lengths) // 10))[:max(lengths)]
    rows = []
    for length in lengths:
        reply = ids[:length]
        per_token = []
        for make in (lambda: RedecodeStream(codec), lambda: TextStream(codec, ("</end>",))):
            stream = make()
            start = time.perf_counter()
            for token in reply:
                stream.push(token)
            per_token.append((time.perf_counter() - start) / length * 1e6)
        rows.append([length, per_token[0], per_token[1], per_token[0] / per_token[1]])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, mps")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-mlx", dest="mlx", action="store_false",
                        help="skip the MLX sampler (on by default where MLX imports)")
    parser.add_argument("--model", type=Path, default=None,
                        help="tokenizer's checkpoint (default: the real model, else demo)")
    parser.add_argument("--lengths", default="100,4000")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (FLEET_CPU_THREADS in serving)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.mlx:
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            args.mlx = False
    header = ["sampling, ms per step", "host (logits to host, numpy)", f"torch {args.device}",
              "host / torch"]
    if args.mlx:
        header += ["mlx", "host / mlx"]
    table(f"Sampling {args.rows} rows at a {args.vocab} vocabulary", header, sampling_rows(args))
    real = ROOT / "build" / "smollm2-135m-instruct"
    model_dir = args.model or (real if (real / "tokenizer.json").exists()
                               else checkpoint(None, "demo"))
    table(f"Detokenizing, µs per token ({model_dir.name}'s tokenizer)",
          ["output tokens", "re-decode all (before)", "incremental", "before / incremental"],
          detokenizer_rows(model_dir, [int(n) for n in args.lengths.split(",")]))


if __name__ == "__main__":
    main()
