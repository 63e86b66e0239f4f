"""Packed 4-bit matmuls against dense ones on PyTorch, side by side in one run.

    python bench/quantized.py                                   # CPU, a small 8B-like layer
    python bench/quantized.py --device cuda --shape 8b --layers 32    # one H200, a whole 8B step
    python bench/quantized.py --device cuda --shape 8b --layers 32 --libraries  # + gemlite, torchao

For one decoder layer's linears (q, k, v, o, gate, up, down of the chosen shape) it times,
at each batch of rows, x @ w.T two ways on the same random weights: dense in the model
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

`--triton` (CUDA) sets our Triton kernel (engine.backends.pytorch.packed_matmul_triton,
what a CUDA stage runs by default) beside dense and PyTorch's int4 kernel, in one run: the
matmuls alone at 1, 8, 32 and 64 rows for each linear shape, a 2048-row prompt chunk, and
whole decode rounds of torch stages of `--stage-layers` layers with each, against the packed
floor over the copy bandwidth measured in the run (bench/quantized_triton.py):

    python bench/quantized.py --device cuda --shape 8b --triton --layers 16 --stage-layers 32

`--libraries` sets the libraries made for group-wise affine low-bit weights beside ours, on
the same weights (rows 1, 8 and 64 by default): gemlite (Triton kernels; mlx's bias is its
additive term, zero = -bias / scale in its (q - zero) * scale form), torchao's int4
`tile_packed_to_4d` layout (the same aten kernel as ours behind torchao's tensor) and its
`plain` layout (mslk's kernel). Each that is not installed, or cannot run on this device,
dtype or width, prints one line saying so; the rest are timed like dense and ours, with each
way's max abs error on one layer's outputs against the float32 product of the dense
dequantized weights, and whether a second run gives the same bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_unstacked, captured, median_s, projections_apart, table
from engine.backends.pytorch.packed_linear import PackedWeight, pack_weight, unpack_codes
from engine.checkpoint.quant_config import QuantParams

# (hidden, intermediate, attention heads, KV heads, head dim)
SHAPES = {"8b": (4096, 14336, 32, 8, 128), "2b": (2048, 8192, 16, 8, 128),
          "small": (1024, 3584, 8, 2, 128), "tiny": (256, 512, 4, 2, 64)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer_linears(shape: str) -> list[tuple[int, int]]:
    """[out, in] of one Llama-style layer's q, k, v, o, gate, up and down."""
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q),
            (inter, hidden), (inter, hidden), (hidden, inter)]


@dataclass(frozen=True)
class Affine:
    """One linear's weight in mlx-lm's affine format on the device: w = q * scale + bias."""

    words: np.ndarray  # uint32 [out, in * bits / 32], the codes as stored
    codes: torch.Tensor  # int64 [out, in], unpacked on the device
    scales: torch.Tensor  # [out, in / group_size], the model dtype
    biases: torch.Tensor
    params: QuantParams

    @property
    def stored_bytes(self) -> int:
        """The format's own bytes: what a kernel reading it once must read."""
        return self.words.nbytes + self.scales.nbytes + self.biases.nbytes

    def dense(self) -> torch.Tensor:
        """Dequantized as dequant.dequantize makes it: the multiply rounded, then the add."""
        out_features, in_features = self.codes.shape
        w = self.codes.to(self.scales.dtype).view(out_features, -1, self.params.group_size)
        w = w * self.scales[..., None]
        return (w + self.biases[..., None]).view(out_features, in_features)

    def ours(self, kernel: str | None = None) -> PackedWeight:
        """Packed as a torch stage holds it: for `kernel` ("int4", "triton"; None: the
        stage's choice on this device)."""
        return pack_weight(self.words, self.scales, self.biases, self.params, self.codes.device,
                           matmul=True, lookup=False, kernel=kernel)


def affine_weights(shape: str, layers: int, params: QuantParams, dtype: torch.dtype,
                   device: torch.device) -> Iterator[Affine]:
    """Random weights in mlx-lm's format, every linear of `layers` layers, one at a time."""
    rng = np.random.default_rng(0)
    for out_features, in_features in layer_linears(shape) * layers:
        # Random codes, scales and biases as mlx-lm stores them (quantizing an 8B model's
        # worth of random floats in numpy would take minutes and time nothing different).
        words = rng.integers(0, 2**32, (out_features, in_features * params.bits // 32),
                             dtype=np.uint32)
        groups = (out_features, in_features // params.group_size)
        scales = rng.uniform(1e-3, 4e-3, groups).astype(np.float32)
        biases = rng.uniform(-0.03, 0.0, groups).astype(np.float32)
        # Unpacked on the device (numpy would be slow).
        codes = unpack_codes(torch.from_numpy(words.view(np.uint8)).to(device), params.bits)
        yield Affine(words, codes, torch.from_numpy(scales).to(device, dtype),
                     torch.from_numpy(biases).to(device, dtype), params)


def build(shape: str, layers: int, params: QuantParams, dtype: torch.dtype,
          device: torch.device, makers: dict[str, Callable[[Affine], Any]]
          ) -> tuple[dict[str, list], dict[str, str], int]:
    """Each way's weights, made by its maker from the same random weights; the ways whose
    maker failed, with why; and the stored bytes of the format."""
    ways: dict[str, list] = {name: [] for name in makers}
    failed: dict[str, str] = {}
    stored = 0
    for weight in affine_weights(shape, layers, params, dtype, device):
        stored += weight.stored_bytes
        for name in [n for n in makers if n not in failed]:
            try:
                ways[name].append(makers[name](weight))
            except Exception as exc:  # noqa: BLE001 - a library refusing a weight: say, go on
                failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                ways.pop(name)
        del weight
    return ways, failed, stored


def inputs_for(weights: list, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Rows for every input width the linears take: x for the hidden width, random others."""
    inputs = {x.shape[1]: x}
    for w in weights:
        if w.shape[1] not in inputs:
            inputs[w.shape[1]] = torch.randn(x.shape[0], w.shape[1], device=x.device,
                                             dtype=x.dtype)
    return inputs


def step(weights: list, inputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """Every linear once on rows of its input width; the outputs summed so none is dead."""
    total = torch.zeros((), device=next(iter(inputs.values())).device, dtype=torch.float32)
    for w in weights:
        total = total + F.linear(inputs[w.shape[1]], w)[:, :1].float().sum()
    return total


def timed(weights: list, inputs: dict[int, torch.Tensor], device: torch.device,
          repeats: int, graph: bool = True) -> float:
    """Median seconds of one step; on CUDA one graph replay (`graph`: else launched eagerly)."""
    if device.type != "cuda" or not graph:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            return median_s(lambda: step(weights, inputs), repeats=repeats, warmup=2, sync=sync)
    with torch.inference_mode():
        replay = captured(lambda: step(weights, inputs))
    return median_s(replay, repeats=repeats, warmup=3, sync=torch.cuda.synchronize)


# --- The libraries made for group-wise affine low-bit weights (--libraries) ---------------

GEMLITE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # activations it takes
GEMLITE_BITS = (1, 2, 4, 8)
GEMLITE_FMA_MODE = 4  # its W_group_mode for w = q * scale + zeros (one fused multiply-add)
TILE_WIDTH, TILE_ROWS = 1024, 8  # torchao's tile_packed_to_4d pads in and out to these


class LibraryWeight:
    """A library's layer standing where a dense [out, in] weight stood: `step`'s
    F.linear(x, w) reaches `forward` through __torch_function__, as with PackedWeight."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size,
                 nbytes: int) -> None:
        self.forward, self.shape, self.nbytes = forward, shape, nbytes

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> torch.Tensor:
        if func is F.linear and len(args) == 2 and not kwargs:
            x, weight = args
            return weight.forward(x)
        raise TypeError(f"a library's weight here supports F.linear(x, w) only, not {func}")


def tinygemm_zero(weight: Affine) -> torch.Tensor:
    """The zero of kernels computing (q - 8) * scale + zero: bias + 8 * scale, formed in
    float32 and rounded once (as engine.backends.pytorch.packed_linear forms it)."""
    return (weight.biases.float() + 8 * weight.scales.float()).to(weight.scales.dtype)


def gemlite_maker(device: torch.device, dtype: torch.dtype) -> Callable[[Affine], LibraryWeight]:
    from gemlite.helper import A16Wn  # optional: imported only when asked for, on CUDA

    def make(weight: Affine) -> LibraryWeight:
        out_features, in_features = weight.codes.shape
        # gemlite's group form is w = (q - zero) * scale, so mlx's q * scale + bias has
        # zero = -bias / scale. Packed for its fused multiply-add it keeps -zero * scale, the
        # bias again, but rounded through a zero held in the model dtype (8 significant bits
        # in bfloat16: a bias comes back up to a rounding step off), so mlx's bias itself is
        # written there.
        zeros = (-weight.biases.float() / weight.scales.float()).to(dtype)
        layer = A16Wn(device=str(device), dtype=dtype).from_weights(
            weight.codes.to(torch.uint8), weight.scales, zeros, W_nbits=weight.params.bits,
            group_size=weight.params.group_size)
        groups = in_features // weight.params.group_size
        if (layer.W_group_mode != GEMLITE_FMA_MODE
                or tuple(layer.zeros.shape) != (groups, out_features)):
            raise RuntimeError(f"gemlite packed mode {layer.W_group_mode}, zeros "
                               f"{tuple(layer.zeros.shape)}: not q * scale + zeros "
                               f"[{groups}, {out_features}], so mlx's bias has no place")
        with torch.no_grad():
            layer.zeros.copy_(weight.biases.t())
        nbytes = sum(t.nbytes for t in (layer.W_q, layer.scales, layer.zeros))
        return LibraryWeight(layer, weight.codes.shape, nbytes)

    return make


def torchao_tile_maker(dtype: torch.dtype) -> Callable[[Affine], LibraryWeight]:
    from torchao.quantization import Int4TilePackedTo4dTensor
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    def make(weight: Affine) -> LibraryWeight:
        # The same aten kernel as ours (_weight_int4pack_mm) behind torchao's tensor: rows
        # padded to 8 and the width to 1024 (it pads the activations to match each call);
        # padded codes get scale and zero 0.
        out_features, in_features = weight.codes.shape
        group_size = weight.params.group_size
        pad_in, pad_out = -in_features % TILE_WIDTH, -out_features % TILE_ROWS
        codes = F.pad(weight.codes, (0, pad_in, 0, pad_out))
        scales = F.pad(weight.scales, (0, pad_in // group_size, 0, pad_out))
        zeros = F.pad(tinygemm_zero(weight), (0, pad_in // group_size, 0, pad_out))
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # even code high
        qdata = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), 8)
        scale_and_zero = pack_tinygemm_scales_and_zeros(scales, zeros, dtype)
        tensor = Int4TilePackedTo4dTensor(qdata, scale_and_zero, [1, group_size],
                                          weight.codes.shape)
        return LibraryWeight(lambda x: F.linear(x, tensor), weight.codes.shape,
                             qdata.nbytes + scale_and_zero.nbytes)

    return make


def torchao_plain_maker() -> Callable[[Affine], LibraryWeight]:
    from mslk.quantize.shuffle import pack_int4
    from torchao.quantization import Int4Tensor

    def make(weight: Affine) -> LibraryWeight:
        # Its kernel (mslk's bf16i4bf16_rowwise) takes signed codes q - 8 with
        # w = (q - 8) * scale + zero, scale and zero [groups, out].
        qdata = pack_int4((weight.codes - 8).to(torch.int8))
        scale = weight.scales.t().contiguous()
        zero = tinygemm_zero(weight).t().contiguous()
        tensor = Int4Tensor(qdata, scale, zero, [1, weight.params.group_size],
                            weight.codes.shape)
        return LibraryWeight(lambda x: F.linear(x, tensor), weight.codes.shape,
                             qdata.nbytes + scale.nbytes + zero.nbytes)

    return make


def library_makers(device: torch.device, dtype: torch.dtype, params: QuantParams
                   ) -> tuple[dict[str, Callable[[Affine], Any]], list[str]]:
    """The libraries that can run here, by way name; a line for each that cannot, saying why."""
    makers: dict[str, Callable[[Affine], Any]] = {}
    skipped: list[str] = []

    def usable(way: str, modules: list[str], bits: tuple[int, ...],
               dtypes: list[torch.dtype]) -> bool:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            skipped.append(f"{way}: not installed ({', '.join(missing)})")
        elif device.type != "cuda":
            skipped.append(f"{way}: installed, but its kernels run on CUDA only")
        elif params.bits not in bits or dtype not in dtypes:
            names = [str(d).removeprefix("torch.") for d in [*dtypes, dtype]]
            skipped.append(f"{way}: takes {'/'.join(map(str, bits))}-bit codes with "
                           f"{'/'.join(names[:-1])} activations, not {params.bits}-bit "
                           f"{names[-1]}")
        else:
            return True
        return False

    candidates = [
        ("gemlite", ["gemlite", "triton"], GEMLITE_BITS, GEMLITE_DTYPES,
         lambda: gemlite_maker(device, dtype)),
        ("torchao int4 tile_packed_to_4d", ["torchao"], (4,), [torch.bfloat16],
         lambda: torchao_tile_maker(dtype)),
        ("torchao int4 plain", ["torchao", "mslk"], (4,), [torch.bfloat16],
         torchao_plain_maker),
    ]
    for way, modules, bits, dtypes, maker in candidates:
        if not usable(way, modules, bits, dtypes):
            continue
        try:
            makers[way] = maker()
        except Exception as exc:  # noqa: BLE001 - installed but broken here: one line
            skipped.append(f"{way}: import failed: {type(exc).__name__}: {exc}".splitlines()[0])
    return makers, skipped


def accuracy(weights: list, inputs: dict[int, torch.Tensor],
             reference: list[torch.Tensor]) -> tuple[float, float, bool]:
    """Max abs error of each linear's output against the float32 product of the dense
    dequantized weight, that over the largest |y|, and whether a second run is byte-equal."""
    error, largest, repeatable = 0.0, 0.0, True
    with torch.inference_mode():
        for w, want in zip(weights, reference, strict=True):
            x = inputs[w.shape[1]]
            got = F.linear(x, w)
            repeatable &= torch.equal(got, F.linear(x, w))
            error = max(error, (got.float() - want).abs().max().item())
            largest = max(largest, want.abs().max().item())
    return error, error / largest, repeatable


def compare_libraries(shape: str, layers: int, params: QuantParams, dtype: torch.dtype,
                      device: torch.device, batches: list[int], repeats: int,
                      bandwidth_gbs: float) -> None:
    """Dense, ours and each library that runs here, on the same weights: ms, ratios, error."""
    makers: dict[str, Callable[[Affine], Any]] = {"dense": Affine.dense,
                                                  "ours (torch int4)": Affine.ours}
    extra, skipped = library_makers(device, dtype, params)
    ways, failed, stored = build(shape, layers, params, dtype, device, makers | extra)
    skipped += [f"{way}: could not pack these weights: {why}" for way, why in failed.items()]
    for line in skipped:
        print(f"# skipped {line}", flush=True)
    held = {way: sum(w.nbytes for w in weights) for way, weights in ways.items()}
    one_layer = len(layer_linears(shape))  # the error is checked on the first layer's linears
    floor_ms = stored / (bandwidth_gbs * 1e9) * 1e3
    rows = []
    for batch in batches:
        inputs = inputs_for(ways["dense"], torch.randn(batch, SHAPES[shape][0], device=device,
                                                       dtype=dtype))
        with torch.inference_mode():
            reference = [F.linear(inputs[w.shape[1]].float(), w.float())
                         for w in ways["dense"][:one_layer]]
        dense_ms = None
        for way, weights in ways.items():
            try:  # checked first, eagerly: a library that tunes its kernels does so here
                error, relative, repeatable = accuracy(weights[:one_layer], inputs, reference)
            except Exception as exc:  # noqa: BLE001 - a library refusing these rows: say so
                print(f"# {way} at {batch} rows failed: {type(exc).__name__}: "
                      f"{exc}".splitlines()[0], flush=True)
                continue
            how = ""
            try:
                ms = timed(weights, inputs, device, repeats) * 1e3
            except Exception as exc:  # noqa: BLE001 - not capturable: timed as launched
                print(f"# {way} at {batch} rows: no CUDA graph ({type(exc).__name__}: "
                      f"{exc})".splitlines()[0], flush=True)
                ms, how = timed(weights, inputs, device, repeats, graph=False) * 1e3, " (eager)"
            dense_ms = ms if dense_ms is None else dense_ms
            row = [batch, way + how, ms, dense_ms / ms]
            if device.type == "cuda":
                row.append(f"{100 * floor_ms / ms:.0f} %")
            rows.append(row + [held[way] / 1e6, error, relative,
                               "yes" if repeatable else "no"])
    header = ["rows", "way", "ms", "dense / way"]
    header += ["of floor"] if device.type == "cuda" else []
    header += ["held MB", "max abs error", "error / max abs y", "repeatable"]
    floor = f", packed floor {floor_ms:.3g} ms" if device.type == "cuda" else ""
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    table(f"{shape} x {layers} layers' linears, {str(dtype).removeprefix('torch.')}, "
          f"{params.bits}-bit group {params.group_size}, {device.type}{threads}: stored "
          f"{stored / 1e6:.3g} MB{floor}; errors on one layer against the float32 product "
          f"of the dense dequantized weights", header, rows)


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
    parser.add_argument("--batches", default=None,
                        help="rows per matmul (default: 1,8; 1,8,64 with --libraries)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="device memory bandwidth for the floor (CUDA)")
    parser.add_argument("--stage", action="store_true",
                        help="time a packed and a dense stage's decode rounds instead")
    parser.add_argument("--stage-layers", type=int, default=4)
    parser.add_argument("--libraries", action="store_true",
                        help="compare gemlite's and torchao's int4 kernels too (each if "
                             "installed), with each way's error")
    parser.add_argument("--triton", action="store_true",
                        help="CUDA: our Triton kernel beside dense and int4: matmuls, a "
                             "prompt chunk and stage rounds (--layers, --stage-layers)")
    add_unstacked(parser)
    args = parser.parse_args(argv)
    if args.unstacked:
        projections_apart()
    batches = [int(b) for b in (args.batches or ("1,8,64" if args.libraries else "1,8"))
               .split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = args.shape or ("small" if device.type == "cpu" else "8b")
    if args.triton:
        from bench import quantized_triton

        quantized_triton.run(shape, args.layers, args.stage_layers,
                             QuantParams.checked(args.group_size, args.bits, "bench/quantized.py"),
                             DTYPES[args.dtype], args.repeats)
        return 0
    if args.stage:
        stage_decode(shape, args.stage_layers, batches, device, args.repeats)
        return 0
    dtype = DTYPES[args.dtype]
    params = QuantParams.checked(args.group_size, args.bits, "bench/quantized.py")
    if args.libraries:
        compare_libraries(shape, args.layers, params, dtype, device, batches, args.repeats,
                          args.bandwidth_gbs)
        return 0
    ways, _, _ = build(shape, args.layers, params, dtype, device,
                       {"dense": Affine.dense, "packed": Affine.ours})
    dense, packed = ways["dense"], ways["packed"]
    dense_bytes = sum(w.nbytes for w in dense)
    packed_bytes = sum(w.nbytes for w in packed)
    hidden = SHAPES[shape][0]
    rows = []
    for batch in batches:
        inputs = inputs_for(dense, torch.randn(batch, hidden, device=device, dtype=dtype))
        dense_ms = timed(dense, inputs, device, args.repeats) * 1e3
        packed_ms = timed(packed, inputs, device, args.repeats) * 1e3
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
