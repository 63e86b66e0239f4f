"""Packed 4-bit matmuls against dense ones on PyTorch, side by side in one run.

    python bench/quantized.py                                   # CPU, a small 8B-like layer
    python bench/quantized.py --device cuda --shape 8b --layers 32    # one H200, a whole 8B step

For one decoder layer's linears (q, k, v, o, gate, up, down of the chosen shape) it times,
at each batch of rows, x @ w.T three ways on the same random weights: dense in the model
dtype (what `FLEET_QUANT=dense` runs), and packed through PyTorch's int4 kernel
(engine.backends.pytorch.packed_linear, what a stage runs by default). `--layers` chains
that many layers' linears (each its own weights), as a decode step does. On CUDA each way
is captured once as a CUDA graph and replayed, as the engine's decode rounds are, and the
packed time is set against its floor: the packed bytes over the device's bandwidth
(`--bandwidth-gbs`, an H200's 4,800 GB/s by default). Ratios compare the ways measured in
this run, so a busy machine slows all of them alike.

`--stage` times whole decode rounds instead: a generated qwen3 checkpoint of the chosen
layer shape (`--stage-layers` layers, vocabulary 16,000, bfloat16) quantized to 4 bits, one
torch stage loaded with `FLEET_QUANT=auto` (packed) and one with `dense`, each decoding
greedily at 1 and 8 streams; it prints ms per round and the bytes each stage's weights hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median_s, table
from engine.backends.pytorch.packed_linear import pack_weight, unpack_codes
from engine.checkpoint.quantize import QuantParams

# (hidden, intermediate, attention heads, KV heads, head dim)
SHAPES = {"8b": (4096, 14336, 32, 8, 128), "2b": (2048, 8192, 16, 8, 128),
          "small": (1024, 3584, 8, 2, 128)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer_linears(shape: str) -> list[tuple[int, int]]:
    """[out, in] of one Llama-style layer's q, k, v, o, gate, up and down."""
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q),
            (inter, hidden), (inter, hidden), (hidden, inter)]


def build(shape: str, layers: int, params: QuantParams, dtype: torch.dtype,
          device: torch.device) -> tuple[list, list]:
    """The same random weights dense (dequantized) and packed, `layers` layers of them."""
    rng = np.random.default_rng(0)
    dense, packed = [], []
    for out_features, in_features in layer_linears(shape) * layers:
        # Random codes, scales and biases as mlx-lm stores them (quantizing an 8B model's
        # worth of random floats in numpy would take minutes and time nothing different).
        words = rng.integers(0, 2**32, (out_features, in_features * params.bits // 32),
                             dtype=np.uint32)
        groups = (out_features, in_features // params.group_size)
        scales = rng.uniform(1e-3, 4e-3, groups).astype(np.float32)
        biases = rng.uniform(-0.03, 0.0, groups).astype(np.float32)
        scales_t = torch.from_numpy(scales).to(device, dtype)
        biases_t = torch.from_numpy(biases).to(device, dtype)
        # Dense as dequant.dequantize makes it, unpacked on the device (numpy would be slow).
        codes = unpack_codes(torch.from_numpy(words.view(np.uint8)).to(device), params.bits)
        w = codes.to(dtype).view(out_features, -1, params.group_size) * scales_t[..., None]
        dense.append((w + biases_t[..., None]).view(out_features, in_features))
        del codes, w
        packed.append(pack_weight(words, scales_t, biases_t, params, device, matmul=True,
                                  lookup=False))
    return dense, packed


def step(weights: list, x: torch.Tensor, hidden: int) -> torch.Tensor:
    """Every linear once on rows of its input width; the outputs summed so none is dead."""
    inputs: dict[int, torch.Tensor] = {hidden: x}
    total = torch.zeros((), device=x.device, dtype=torch.float32)
    for w in weights:
        in_features = w.shape[1]
        if in_features not in inputs:
            inputs[in_features] = torch.randn(x.shape[0], in_features, device=x.device,
                                              dtype=x.dtype)
        total = total + F.linear(inputs[in_features], w)[:, :1].float().sum()
    return total


def timed(weights: list, x: torch.Tensor, hidden: int, device: torch.device,
          repeats: int) -> float:
    """Median seconds of one step; on CUDA one graph replay."""
    if device.type != "cuda":
        with torch.inference_mode():
            return median_s(lambda: step(weights, x, hidden), repeats=repeats, warmup=2)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(weights, x, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(weights, x, hidden)
    return median_s(graph.replay, repeats=repeats, warmup=3, sync=torch.cuda.synchronize)


class Decoder:
    """Greedy decode rounds of `batch` streams on one stage, a step at a time."""

    def __init__(self, driver, batch: int) -> None:
        self.driver, self.batch = driver, batch
        self.logits = driver.round({s: [1 + s, 2, 3] for s in range(batch)})

    def step_s(self) -> float:
        start = time.perf_counter()
        self.logits = self.driver.round({s: [int(np.argmax(row))]
                                         for s, row in self.logits.items()})
        return time.perf_counter() - start

    def close(self) -> None:
        self.driver.close(list(range(self.batch)))


def stage_decode(shape: str, layers: int, batches: list[int], device: torch.device,
                 repeats: int) -> None:
    """Decode rounds of a packed and a dense torch stage on one 4-bit checkpoint."""
    from bench.common import ROOT
    from engine.backends.base import StageSpec, load_stage
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
    from engine.checkpoint.quantize import quantize_checkpoint
    from engine.harness.driver import RoundDriver
    from engine.pipeline.runner import LocalRunner

    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    out = ROOT / "build" / f"bench-quantized-{shape}-{layers}"
    dense_dir, packed_dir = out / "dense", out / "q4"
    if not (packed_dir / "config.json").exists():
        print(f"# making a 4-bit {shape} checkpoint in {out}", flush=True)
        make_checkpoint(dense_dir, CheckpointSpec(
            family="qwen3", hidden_size=hidden, intermediate_size=inter,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            num_hidden_layers=layers, vocab_size=16000, dtype="bfloat16", seed=0),
            overwrite=True)
        quantize_checkpoint(dense_dir, packed_dir, 4, 64)
    drivers, weights = {}, {}
    for quant in ("auto", "dense"):
        stage = load_stage(StageSpec(packed_dir, (0, layers), f"torch-{device.type}",
                                     max(batches), 256, 16, quant=quant))
        model = stage.model
        held = [w for layer in model.layers for w in vars(layer).values() if w is not None]
        held += [model.embed, model.norm] + ([model.head] if model.head is not model.embed
                                             else [])
        weights[quant] = sum(int(w.nbytes) for w in held)
        drivers[quant] = RoundDriver(LocalRunner(stage))
    rows = []
    for batch in batches:
        # The two stages step in turn, so a burst of load on a shared machine lands on both.
        decoders = {quant: Decoder(driver, batch) for quant, driver in drivers.items()}
        times: dict[str, list[float]] = {quant: [] for quant in decoders}
        for i in range(repeats + 2):
            for quant, decoder in decoders.items():
                seconds = decoder.step_s()
                if i >= 2:  # warm-up steps
                    times[quant].append(seconds)
        for quant, decoder in decoders.items():
            decoder.close()
            rows.append([quant, batch, statistics.median(times[quant]) * 1e3])
    by = {(q, b): ms for q, b, ms in rows}
    table(f"decode rounds, qwen3 {shape} x {layers} layers 4-bit bfloat16 on {device.type} "
          f"({torch.get_num_threads()} threads): weights packed "
          f"{weights['auto'] / 1e6:.0f} MB, dense {weights['dense'] / 1e6:.0f} MB",
          ["streams", "dense ms / round", "packed ms / round", "dense / packed"],
          [[b, by[("dense", b)], by[("auto", b)], by[("dense", b)] / by[("auto", b)]]
           for b in batches])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    parser.add_argument("--shape", default=None, choices=list(SHAPES),
                        help="layer shape (default: small on the CPU, 8b elsewhere)")
    parser.add_argument("--layers", type=int, default=1, help="layers' linears per step")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="device memory bandwidth for the floor (CUDA)")
    parser.add_argument("--stage", action="store_true",
                        help="time a packed and a dense stage's decode rounds instead")
    parser.add_argument("--stage-layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = args.shape or ("small" if device.type == "cpu" else "8b")
    if args.stage:
        stage_decode(shape, args.stage_layers, [int(b) for b in args.batches.split(",")],
                     device, args.repeats)
        return 0
    dtype = DTYPES[args.dtype]
    params = QuantParams.checked(args.group_size, args.bits, "bench/quantized.py")
    dense, packed = build(shape, args.layers, params, dtype, device)
    dense_bytes = sum(w.nbytes for w in dense)
    packed_bytes = sum(w.nbytes for w in packed)
    hidden = SHAPES[shape][0]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, hidden, device=device, dtype=dtype)
        dense_ms = timed(dense, x, hidden, device, args.repeats) * 1e3
        packed_ms = timed(packed, x, hidden, device, args.repeats) * 1e3
        row = [batch, dense_ms, packed_ms, dense_ms / packed_ms]
        if device.type == "cuda":
            floor_ms = packed_bytes / (args.bandwidth_gbs * 1e9) * 1e3
            row += [floor_ms, f"{100 * floor_ms / packed_ms:.0f} %"]
        rows.append(row)
    header = ["rows", "dense ms", "packed ms", "dense / packed"]
    if device.type == "cuda":
        header += ["packed floor ms", "of floor"]
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    table(f"{shape} x {args.layers} layers' linears, {args.dtype}, {args.bits}-bit group "
          f"{args.group_size}, {args.device}{threads}: dense {dense_bytes / 1e6:.0f} MB, "
          f"packed {packed_bytes / 1e6:.0f} MB ({dense_bytes / packed_bytes:.2f}x smaller)",
          header, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
