"""What the benchmarks share: a checkpoint to measure, timing (a CUDA graph's replay, the
copy bandwidth a floor is set against, a CUDA profile), and printing a result table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from engine.checkpoint.maker import PRESETS, make_checkpoint
from engine.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def add_unstacked(parser: argparse.ArgumentParser) -> None:
    """--unstacked: the bench's stages keep each projection apart (`projections_apart`)."""
    parser.add_argument("--unstacked", action="store_true",
                        help="each projection a weight of its own (the baseline of stacking "
                             "q/k/v, gate/up and a DeltaNet layer's inputs into one matmul)")


def projections_apart() -> None:
    """PyTorch stages built after this call hold each projection as a weight of its own, as
    before engine/backends/pytorch/stacked.py: the baseline a bench's --unstacked times."""
    from engine.backends.pytorch import stacked

    stacked.stack_on = lambda device, layers: None


def checkpoint(model: Path | None, preset: str) -> Path:
    """`model` if given, else the preset, generated once under build/."""
    if model is not None:
        return model
    out = ROOT / "build" / f"bench-{preset}"
    if not (out / "config.json").exists():
        print(f"# making the {preset!r} checkpoint in {out}", flush=True)
        make_checkpoint(out, PRESETS[preset], overwrite=True)
    return out


def n_layers(model_dir: Path) -> int:
    # Through ModelConfig: a conditional-generation checkpoint nests it in text_config.
    raw = json.loads((model_dir / "config.json").read_text())
    return ModelConfig.from_dict(raw).num_hidden_layers


def median_s(action: Callable[[], object], *, repeats: int, warmup: int = 1,
             sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of `action` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        action()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    """A markdown table, so the output pastes into docs/benchmarks.md as it is."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row)
              + " |")


def copy_bandwidth_gbs(device: str, repeats: int = 5) -> float:
    """The device's memory bandwidth as a large copy sees it: bytes read + written / time
    (1 GiB on a GPU, 256 MiB on the CPU), the median of `repeats`."""
    import torch

    size = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    seconds = median_s(lambda: dst.copy_(src), repeats=repeats, warmup=2, sync=sync)
    return 2 * size / seconds / 1e9


def captured(step: Callable[[], object]) -> Callable[[], None]:
    """`step` captured in a CUDA graph (warmed up on a side stream first, as the engine's
    graphs.py does, which compiles kernels and settles the allocator): its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def cuda_profile(run: Callable[[], None]):
    """torch.profiler's kernel averages (CPU and CUDA) over one call of `run`, after warm-up
    work the caller has done, with the GPU idle at both ends."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages()
