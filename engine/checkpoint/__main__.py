"""Command line: `python -m engine.checkpoint make OUT_DIR …` and `… info DIR`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.checkpoint.maker import (
    DTYPES,
    FAMILIES,
    PRESETS,
    CheckpointExistsError,
    CheckpointSpec,
    Llama3RopeScaling,
    SpecError,
    WriteProgress,
    make_checkpoint,
)
from engine.checkpoint.quant_config import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    QuantConfigError,
)
from engine.checkpoint.quantize import quantize_checkpoint
from engine.checkpoint.reader import CheckpointError, open_checkpoint

# Bytes per element for the safetensors dtype tags `info` may meet (quantized files included).
_TAG_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U32": 4,
              "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}

# flag -> CheckpointSpec field, for the shape overrides that apply on top of a preset.
_OVERRIDES: dict[str, str] = {
    "family": "family",
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
    "dtype": "dtype",
    "tie": "tie_word_embeddings",
    "shards": "shards",
    "seed": "seed",
    "rope_theta": "rope_theta",
    "sliding_window": "sliding_window",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "multimodal": "multimodal",
    "mtp": "mtp",
    "full_attention_interval": "full_attention_interval",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint",
                                     description="Make or inspect Hugging Face checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make", help="write a seeded random checkpoint")
    make.add_argument("out_dir", type=Path)
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                      help="the shape to start from (default: tiny); flags below override it")
    make.add_argument("--family", choices=FAMILIES)
    make.add_argument("--layers", type=int)
    make.add_argument("--hidden", type=int)
    make.add_argument("--intermediate", type=int)
    make.add_argument("--heads", type=int)
    make.add_argument("--kv-heads", type=int)
    make.add_argument("--head-dim", type=int)
    make.add_argument("--vocab", type=int)
    make.add_argument("--dtype", choices=sorted(DTYPES))
    make.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                      help="tie the head to the embeddings (--no-tie: a separate lm_head)")
    make.add_argument("--shards", type=int)
    make.add_argument("--seed", type=int)
    make.add_argument("--rope-theta", type=float)
    make.add_argument("--llama3-rope-scaling", action=argparse.BooleanOptionalAction,
                      default=None, help="Llama 3.1 rope scaling (factor 8, original 8192)")
    make.add_argument("--sliding-window", type=int, help="mistral only")
    make.add_argument("--max-position-embeddings", type=int)
    make.add_argument("--rms-norm-eps", type=float)
    make.add_argument("--multimodal", action=argparse.BooleanOptionalAction, default=None,
                      help="qwen3_5 only: the conditional-generation layout (text weights "
                           "under model.language_model., a tiny vision tower, MTP tensors)")
    make.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                      help="qwen3_5 only: a whole MTP head (mtp.*), which `drafter: mtp` "
                           "drafts with")
    make.add_argument("--full-attention-interval", type=int,
                      help="qwen3_5 only: every n-th layer is full attention (default 4)")
    make.add_argument("--quantize", type=int, choices=AFFINE_BITS,
                      help="write mlx-lm's affine format at this many bits (e.g. 4 or 8)")
    make.add_argument("--group-size", type=int, choices=AFFINE_GROUP_SIZES,
                      help="values sharing a scale and bias when quantizing (default 64)")
    make.add_argument("--force", action="store_true",
                      help="replace the checkpoint files in a non-empty OUT_DIR")

    info = commands.add_parser("info", help="summarise a checkpoint's config and tensors")
    info.add_argument("dir", type=Path)
    return parser


def spec_from_args(args: argparse.Namespace) -> CheckpointSpec:
    """The preset with every given flag applied on top (SpecError names a bad field)."""
    changes = {field_name: getattr(args, flag) for flag, field_name in _OVERRIDES.items()
               if getattr(args, flag) is not None}
    if args.llama3_rope_scaling is not None:
        changes["rope_scaling"] = Llama3RopeScaling() if args.llama3_rope_scaling else None
    return dataclasses.replace(PRESETS[args.preset], **changes)


def _human_bytes(size: int) -> str:
    exponent = min(3, int(math.log(size, 1024))) if size > 0 else 0
    return f"{size / 1024 ** exponent:.1f} {('B', 'KiB', 'MiB', 'GiB')[exponent]}"


def _make(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    try:
        spec = spec_from_args(args)
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir: Path = args.out_dir
    if args.group_size and not args.quantize:
        print("error: --group-size needs --quantize", file=sys.stderr)
        return 2
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        print(f"error: {out_dir} is not empty; pass --force to replace its checkpoint files",
              file=sys.stderr)
        return 2
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("weights", total=None)

        def report(event: WriteProgress) -> None:
            progress.update(task, completed=event.bytes_done, total=event.bytes_total,
                            description=event.file_name)

        try:
            if args.quantize:
                _make_quantized(out_dir, spec, args, report)
            else:
                make_checkpoint(out_dir, spec, overwrite=args.force, progress=report)
        except (CheckpointExistsError, NotADirectoryError, SpecError, CheckpointError,
                QuantConfigError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    quantized = f", {args.quantize}-bit affine" if args.quantize else ""
    print(f"wrote {out_dir}: {spec.family} {spec.num_hidden_layers} layers, hidden "
          f"{spec.hidden_size}, {spec.dtype}{quantized}, {spec.shards} shard(s)")
    return 0


def _make_quantized(out_dir: Path, spec: CheckpointSpec, args: argparse.Namespace,
                    report) -> None:
    """Write the dense checkpoint beside OUT_DIR, then quantize it into OUT_DIR."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".dense-") as dense:
        make_checkpoint(Path(dense), spec, overwrite=True, progress=report)
        if out_dir.exists() and args.force:
            shutil.rmtree(out_dir)
        quantize_checkpoint(dense, out_dir, args.quantize, args.group_size or 64)


def _info(args: argparse.Namespace) -> int:
    try:
        checkpoint = open_checkpoint(args.dir)
        names = checkpoint.tensor_names()
        total_bytes = 0
        for name in names:
            shape, tag = checkpoint.tensor_shape(name), checkpoint.tensor_dtype(name)
            total_bytes += math.prod(shape) * _TAG_BYTES.get(tag, 0)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    config = checkpoint.config
    keys = ("model_type", "architectures", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "dtype", "torch_dtype", "tie_word_embeddings", "rope_theta",
            "rope_scaling", "max_position_embeddings", "rms_norm_eps", "sliding_window")
    print(f"checkpoint {checkpoint.dir}")
    for key in keys:
        if key in config:
            print(f"  {key}: {config[key]}")
    files = checkpoint.safetensors_files()
    print(f"  files: {len(files)} ({', '.join(path.name for path in files)})")
    print(f"  tensors: {len(names)}")
    print(f"  tensor bytes: {total_bytes} ({_human_bytes(total_bytes)})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _make(args) if args.command == "make" else _info(args)


if __name__ == "__main__":
    sys.exit(main())
