"""Our Triton packed matmul against dense and PyTorch's int4 kernel on CUDA, in one run
(`python bench/quantized.py --device cuda --shape 8b --triton`; see there).

Three tables, every ratio from ways measured in this run:

1. Matmuls alone: each linear shape of the layer (q and o, k and v, gate and up, down) at
   1, 8, 32 and 64 rows, each way's weights for `--layers` layers (so they overflow L2, as
   a stage's do), replayed as a CUDA graph; the packed floor is the stored bytes over the
   copy bandwidth measured here. Our kernel runs the launch `plan` picks (the tuning bench,
   bench/packed_tuning.py, times the others).
2. A prompt chunk (2048 rows) through one layer's linears: dense, int4, ours (dequantize to
   bfloat16 tile-wise, then cuBLAS: what a stage runs above DOT_ROWS_MAX rows) and our dot
   kernel fused over those rows (what it would run instead).
3. Whole decode rounds of a torch stage of `--stage-layers` layers (the serving path:
   load_stage, CUDA graphs, the compiled step where it applies) at 1 and 8 streams, dense
   against packed with each kernel, and a prompt chunk through the same stages. The
   checkpoints are random weights of the layer range only (no embeddings or head), written
   once under build/: the packed one's words drawn at random as mlx-lm stores them (no
   quantizing: a kernel's time does not depend on the values).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import ROOT, captured, copy_bandwidth_gbs, median_s, table
from engine.backends.pytorch import packed_linear
from engine.backends.pytorch import packed_matmul_triton as kernels
from engine.checkpoint.quant_config import QuantParams

PROMPT_ROWS = 2048


def lean_step(weights: list, inputs: dict[int, torch.Tensor]) -> None:
    """Every linear once: a graph runs each kernel whether its output is read or not."""
    for w in weights:
        F.linear(inputs[w.shape[1]], w)


def graph_s(weights: list, inputs: dict[int, torch.Tensor], repeats: int) -> float:
    """Median seconds of one CUDA graph replay of `lean_step`."""
    with torch.inference_mode():
        replay = captured(lambda: lean_step(weights, inputs))
    return median_s(replay, repeats=repeats, warmup=3, sync=torch.cuda.synchronize)


def eager_s(action, repeats: int) -> float:
    with torch.inference_mode():
        return median_s(action, repeats=repeats, warmup=2, sync=torch.cuda.synchronize)


def matmul_tables(shape: str, layers: int, params: QuantParams, dtype: torch.dtype,
                  device: torch.device, repeats: int, copy_gbs: float) -> None:
    from bench.quantized import SHAPES, Affine, build, inputs_for, layer_linears

    makers = {"dense": Affine.dense, "int4": lambda a: a.ours("int4"),
              "triton": lambda a: a.ours("triton")}
    ways, failed, _ = build(shape, layers, params, dtype, device, makers)
    for way, why in failed.items():
        print(f"# {way} could not pack these weights: {why}", flush=True)
    names = ["q", "k", "v", "o", "gate", "up", "down"]
    kinds = {}  # (out, in) -> the linears of that shape
    for name, (out_features, in_features) in zip(names, layer_linears(shape), strict=True):
        kinds.setdefault((out_features, in_features), []).append(name)
    stored = {(out, inp): out * inp * params.bits // 8
              + 2 * out * (inp // params.group_size) * dtype.itemsize for out, inp in kinds}
    rows_out = []
    hidden = SHAPES[shape][0]
    for rows in (1, 8, 32, 64):
        inputs = inputs_for(ways["dense"], torch.randn(rows, hidden, device=device, dtype=dtype))
        for key, linear_names in [*kinds.items(), ("layer", names)]:
            ms = {}
            for way in ways:
                chosen = [w for w in ways[way] if key == "layer" or tuple(w.shape) == key]
                ms[way] = graph_s(chosen, inputs, repeats) * 1e3 / (
                    len(chosen) if key != "layer" else layers)
            nbytes = (sum(stored[k] * len(v) for k, v in kinds.items()) if key == "layer"
                      else stored[key])
            floor_ms = nbytes / (copy_gbs * 1e9) * 1e3
            label = "/".join(linear_names) if key != "layer" else "one layer, all 7"
            size = f" {key[0]}x{key[1]}" if key != "layer" else ""
            rows_out.append([rows, label + size, ms["dense"] * 1e3, ms.get("int4", 0) * 1e3,
                             ms["triton"] * 1e3, ms["dense"] / ms["triton"],
                             ms.get("int4", float("nan")) / ms["triton"],
                             f"{100 * floor_ms / ms['triton']:.0f} %"])
    table(f"matmuls alone, {shape} linears x {layers} layers, {params.bits}-bit group "
          f"{params.group_size}, one CUDA graph per way (us per linear; 'layer': per layer); "
          f"floor: stored bytes over the measured copy bandwidth {copy_gbs:.0f} GB/s",
          ["rows", "linear", "dense us", "int4 us", "triton us", "dense / triton",
           "int4 / triton", "triton of floor"], rows_out)

    # A prompt chunk through one layer's linears.
    one = len(names)
    inputs = inputs_for(ways["dense"], torch.randn(PROMPT_ROWS, hidden, device=device,
                                                   dtype=dtype))
    fused = kernels.Launch(64, 128, max(128, params.group_size), 1, 8, 3)

    def fused_step() -> None:
        for w in ways["triton"][:one]:
            kernels.packed_matmul(inputs[w.shape[1]], *w.words, params.bits, params.group_size,
                                  launch=fused)

    prompt = {way: eager_s(lambda ws=ways[way][:one]: lean_step(ws, inputs), repeats) * 1e3
              for way in ways}
    prompt["triton dot, fused"] = eager_s(fused_step, repeats) * 1e3
    table(f"a prompt chunk of {PROMPT_ROWS} rows through one {shape} layer's linears, launched "
          f"eagerly (ours: dequantize + cuBLAS above {kernels.DOT_ROWS_MAX} rows)",
          ["way", "ms", "dense / way"],
          [[way, ms, prompt["dense"] / ms] for way, ms in prompt.items()])


def range_config(shape: str, layers: int, params: QuantParams | None) -> dict:
    """config.json of a qwen3 model of `shape` cut to the range [1, 1 + layers)."""
    from agent.stage_timer import cut_config
    from bench.quantized import SHAPES
    from engine.checkpoint.maker import CheckpointSpec, config_json

    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    raw = config_json(CheckpointSpec(
        family="qwen3", hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=layers + 2,
        vocab_size=16000, dtype="bfloat16", seed=0))
    raw = cut_config(raw, "full_attention", layers, "bfloat16")
    if params is not None:
        raw["quantization"] = {"group_size": params.group_size, "bits": params.bits}
    return raw


def write_random_packed_range(out_dir: Path, raw: dict, layers: int) -> None:
    """Layers [1, 1 + layers) of `raw` with every packed weight's words, scales and biases
    drawn at random, as mlx-lm stores them (engine.checkpoint.synthetic, minus quantizing)."""
    from safetensors.numpy import save_file

    from engine.checkpoint.quant_config import QuantConfig, packed_params
    from engine.checkpoint.synthetic import FILE_NAME
    from engine.config import ModelConfig
    from engine.family import layer_tensor_shapes

    config, quant = ModelConfig.from_dict(raw), QuantConfig.from_config(raw)
    rng = np.random.default_rng(0)
    words_block = rng.integers(0, 2**32, 1 << 22, dtype=np.uint32)
    dense_block = (rng.standard_normal(1 << 20) * 0.02).astype(np.float16)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(1, 1 + layers):
        for name, shape in layer_tensor_shapes(config, layer).items():
            params = packed_params(quant, name, shape)
            if name.endswith("norm.weight"):
                tensors[name] = np.ones(shape, np.float16)
            elif params is None:
                tensors[name] = np.resize(dense_block, shape)
            else:
                out_features, in_features = shape
                groups = (out_features, in_features // params.group_size)
                path = name.removesuffix(".weight")
                tensors[name] = np.resize(words_block,
                                          (out_features, in_features * params.bits // 32))
                tensors[path + ".scales"] = np.resize(
                    rng.uniform(1e-3, 4e-3, 1 << 16).astype(np.float16), groups)
                tensors[path + ".biases"] = np.resize(
                    rng.uniform(-0.03, 0.0, 1 << 16).astype(np.float16), groups)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / FILE_NAME), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw, indent=1))


def range_checkpoint(where: Path):
    """A range's checkpoint as written above (no tokenizer: the stage holds no embeddings)."""
    from safetensors import safe_open

    from engine.checkpoint.reader import Checkpoint
    from engine.checkpoint.synthetic import FILE_NAME

    with safe_open(str(where / FILE_NAME), "np") as stored:
        names = list(stored.keys())
    raw = json.loads((where / "config.json").read_text())
    return Checkpoint(where, raw, {name: FILE_NAME for name in names})


def stage_checkpoints(shape: str, layers: int, params: QuantParams) -> dict[str, Path]:
    """{"dense": dir, "packed": dir}: random layer ranges of `shape`, written once under build/."""
    from engine.checkpoint.synthetic import write_range

    out = ROOT / "build" / f"bench-triton-{shape}-{layers}-{params.bits}-{params.group_size}"
    dirs = {"dense": out / "dense", "packed": out / "packed"}
    if not (dirs["dense"] / "config.json").exists():
        print(f"# writing a dense {shape} range of {layers} layers in {dirs['dense']}",
              flush=True)
        write_range(dirs["dense"], range_config(shape, layers, None), (1, 1 + layers))
    if not (dirs["packed"] / "config.json").exists():
        print(f"# writing a packed one in {dirs['packed']}", flush=True)
        write_random_packed_range(dirs["packed"], range_config(shape, layers, params), layers)
    return dirs


def stage_tables(shape: str, layers: int, params: QuantParams, device: torch.device,
                 repeats: int, copy_gbs: float) -> None:
    """Decode rounds (1 and 8 streams) and a prompt chunk of a dense stage and of packed
    stages running each kernel, one process, the stages timed in turn."""
    from agent.stage_timer import decode_layout, prefill_layout, random_row_bytes
    from engine.backends.base import StageSpec, load_stage

    dirs = stage_checkpoints(shape, layers, params)
    checkpoints = {kind: range_checkpoint(where) for kind, where in dirs.items()}
    context = PROMPT_ROWS
    stages, held = {}, {}
    for way in ("dense", "packed triton", "packed int4"):
        before = os.environ.get(packed_linear.KERNEL_ENV)
        os.environ[packed_linear.KERNEL_ENV] = way.removeprefix("packed ")
        try:
            started = time.perf_counter()
            kind = way.split()[0]
            stage = load_stage(StageSpec(dirs[kind], (1, 1 + layers), "torch-cuda", 8, context,
                                         PROMPT_ROWS, quant="dense" if kind == "dense"
                                         else "auto"), checkpoint=checkpoints[kind])
        finally:
            if before is None:
                del os.environ[packed_linear.KERNEL_ENV]
            else:
                os.environ[packed_linear.KERNEL_ENV] = before
        weights = [w for layer in stage.model.layers for w in vars(layer).values()
                   if isinstance(w, torch.Tensor | packed_linear.PackedWeight)]
        held[way] = sum(int(w.nbytes) for w in weights)
        stages[way] = stage
        print(f"# {way}: loaded in {time.perf_counter() - started:.1f} s, weights "
              f"{held[way] / 1e9:.2f} GB", flush=True)
    floor_ms = held["packed triton"] / (copy_gbs * 1e9) * 1e3
    rounds = []
    for kind, rows, keys in (("decode", 1, 512), ("decode", 8, 512),
                             ("prefill", PROMPT_ROWS, PROMPT_ROWS)):
        layout = (decode_layout if kind == "decode" else prefill_layout)(keys, rows)
        ms = {}
        runs = {}
        for way, stage in stages.items():
            x = stage.rows_from_bytes(random_row_bytes(rows, stage.config.hidden_size,
                                                       stage.row_format.name), rows)
            runs[way] = (lambda s=stage, x=x, lay=layout: s.run_layers_again(x, lay))
            for _ in range(3):  # captures its graphs, compiles
                runs[way]()
        times: dict[str, list[float]] = {way: [] for way in runs}
        for _ in range(repeats):  # the stages in turn: a burst of load lands on all
            for way, run in runs.items():
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                times[way].append(time.perf_counter() - start)
        ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
        label = f"{rows} stream{'s' if rows > 1 else ''}" if kind == "decode" \
            else f"prompt chunk of {rows}"
        rounds.append([label, ms["dense"], ms["packed triton"], ms["packed int4"],
                       ms["dense"] / ms["packed triton"], ms["dense"] / ms["packed int4"],
                       f"{100 * floor_ms / ms['packed triton']:.0f} %" if kind == "decode"
                       else ""])
    table(f"torch stage rounds, qwen3 {shape} x {layers} layers (no embeddings or head), "
          f"{params.bits}-bit group {params.group_size}, bfloat16, decode rows over 512 keys: "
          f"weights dense "
          f"{held['dense'] / 1e9:.2f} GB, packed triton {held['packed triton'] / 1e9:.2f} GB, "
          f"packed int4 {held['packed int4'] / 1e9:.2f} GB; packed floor {floor_ms:.3g} ms "
          f"(their bytes over {copy_gbs:.0f} GB/s)",
          ["round", "dense ms", "packed triton ms", "packed int4 ms", "dense / triton",
           "dense / int4", "triton of floor"], rounds)


def run(shape: str, layers: int, stage_layers: int, params: QuantParams, dtype: torch.dtype,
        repeats: int) -> None:
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device.type)
    print(f"# {torch.cuda.get_device_name(device)}: copy bandwidth {copy_gbs:.0f} GB/s",
          flush=True)
    matmul_tables(shape, layers, params, dtype, device, repeats, copy_gbs)
    torch.cuda.empty_cache()
    stage_tables(shape, stage_layers, params, device, repeats, copy_gbs)
