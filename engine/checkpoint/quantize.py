"""mlx-lm's affine-quantized checkpoint format in numpy: which layers are packed, and a writer.

mlx-lm (`mlx_lm.convert -q`) stores a quantized linear or embedding `p` as three tensors:
`p.weight` (uint32: the values' `bits`-wide codes as one little-endian bit stream,
[out, in * bits / 32]), `p.scales` and `p.biases` ([out, in / group_size], the model's
float dtype), with `w = scales * q + biases` per group of `group_size` inputs, and writes
`"quantization": {"group_size", "bits", "mode": "affine", <path>: {...} | false}` (and the
same dict again as `"quantization_config"`) into config.json. A layer whose input width the
group size does not divide stays dense, as do norms and biases.

Everything here is framework-free, so both backends can read the format and a checkpoint
can be quantized on a machine without MLX: `QuantConfig` (engine.checkpoint.quant_config) decides how each layer is stored,
`affine_quantize` / `pack_bits` / `unpack_bits` are MLX's CPU arithmetic in numpy (the
tests check them bit for bit against `mx.quantize`), and `quantize_checkpoint` rewrites a
dense checkpoint file by file, streaming, so memory stays bounded by one block of rows.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.quant_config import (
    AFFINE_BITS,
    QuantConfigError,
    QuantParams,
)
from engine.checkpoint.reader import INDEX_FILE, CheckpointError, open_checkpoint

# safetensors dtype tag -> (numpy dtype of the stored bits, bytes per value). numpy has no
# bfloat16: its values are read as raw 16-bit patterns and widened to float32 exactly.
FLOAT_TAGS = {"F32": ("<f4", 4), "BF16": ("<u2", 2), "F16": ("<f2", 2)}
# Rows are quantized in blocks of about this many values, so an 8B model's embedding never
# sits in memory as float32 whole; the result does not depend on the block size.
_BLOCK_VALUES = 1 << 24


def affine_quantize(w: np.ndarray, group_size: int,
                    bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [rows, in] float32 -> (packed uint32 [rows, in * bits / 32], scales, biases float32).

    MLX's CPU `quantize`, step for step in float32 (so the codes are those `mx.quantize`
    gives for the same values): each group's scale spans its range over 2**bits - 1 steps
    and is signed so that the edge of larger magnitude is the bias and lands exactly on a
    code. Scales and biases come back in float32; the caller rounds them to the model dtype.
    """
    rows, width = w.shape
    groups = w.astype(np.float32, copy=False).reshape(rows, width // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = groups.max(axis=-1), groups.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    moved = q0 != 0
    scale = np.where(moved, edge / np.where(moved, q0, np.float32(1)), scale)
    bias = np.where(moved, edge, np.float32(0))
    codes = np.rint((groups - bias[..., None]) / scale[..., None])
    codes = np.clip(codes, np.float32(0), n_bins).astype(np.uint8).reshape(rows, width)
    return pack_bits(codes, bits), scale.astype(np.float32), bias.astype(np.float32)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [rows, in] (each < 2**bits) -> uint32 [rows, in * bits / 32].

    MLX lays the codes out as one little-endian bit stream (code i at bits [i*bits, (i+1)*bits)):
    for 2, 4 and 8 bits within each uint32, for 3, 5 and 6 across bytes. Either way eight
    codes fill exactly `bits` bytes, which is how this packs and `unpack_bits` reads.
    """
    rows, width = codes.shape
    eights = codes.reshape(rows, width // 8, 8).astype(np.uint64)
    word = np.zeros(eights.shape[:2], dtype=np.uint64)  # [rows, in / 8], 8 * bits bits used
    for k in range(8):
        word |= eights[..., k] << np.uint64(k * bits)
    stream = word.astype("<u8").view(np.uint8).reshape(rows, width // 8, 8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(rows, width * bits // 8).view("<u4")


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [rows, in * bits / 32] -> codes uint8 [rows, in]: the inverse of `pack_bits`."""
    if bits not in AFFINE_BITS:
        raise QuantConfigError(f"bits {bits!r} is not one of {AFFINE_BITS}")
    rows, words = packed.shape
    width = words * 32 // bits
    stream = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8).reshape(rows, width // 8, bits)
    word = np.zeros((rows, width // 8), dtype=np.uint64)
    for byte in range(bits):
        word |= stream[..., byte].astype(np.uint64) << np.uint64(8 * byte)
    mask = np.uint64((1 << bits) - 1)
    codes = np.empty((rows, width // 8, 8), dtype=np.uint8)
    for k in range(8):
        codes[..., k] = (word >> np.uint64(k * bits)) & mask
    return codes.reshape(rows, width)


# --- the writer ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Stored:
    """One tensor in a safetensors file: where its bytes are, as its header says."""

    name: str
    tag: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class _Out:
    """One tensor to write: copied bytes, or a part (weight, scales, biases) of a packed one."""

    name: str
    tag: str
    shape: tuple[int, ...]
    source: _Stored
    part: str  # "copy", "weight", "scales" or "biases"

    @property
    def nbytes(self) -> int:
        per_value = 4 if self.tag == "U32" else FLOAT_TAGS[self.tag][1]
        return int(np.prod(self.shape, dtype=np.int64)) * per_value


def _read_header(path: Path) -> list[_Stored]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    stored = [_Stored(name, entry["dtype"], tuple(entry["shape"]),
                      start + entry["data_offsets"][0], start + entry["data_offsets"][1])
              for name, entry in header.items() if name != "__metadata__"]
    return sorted(stored, key=lambda t: t.begin)


def _rows_float32(path: Path, tensor: _Stored) -> Iterator[np.ndarray]:
    """The stored [out, in] tensor as float32 (exactly its values), a block of rows at a time."""
    raw_dtype, _ = FLOAT_TAGS[tensor.tag]
    rows, width = tensor.shape
    values = np.memmap(path, dtype=raw_dtype, mode="r", offset=tensor.begin, shape=(rows, width))
    step = max(1, _BLOCK_VALUES // width)
    for first in range(0, rows, step):
        block = np.asarray(values[first:first + step])
        if tensor.tag == "BF16":
            block = (block.astype(np.uint32) << np.uint32(16)).view(np.float32)
        yield block.astype(np.float32, copy=False)


def _float_bytes(values: np.ndarray, tag: str) -> bytes:
    """float32 values rounded to nearest-even in the tagged dtype, as MLX's casts round."""
    if tag == "F32":
        return values.astype("<f4").tobytes()
    if tag == "F16":
        return values.astype("<f2").tobytes()
    bits = values.astype("<f4").view("<u4")  # finite: scales and biases of finite weights
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _plan_file(path: Path, params: QuantParams) -> list[_Out]:
    """What one file becomes; 4-byte tensors first so every tensor stays naturally aligned."""
    out: list[_Out] = []
    for t in _read_header(path):
        if t.tag not in FLOAT_TAGS:
            raise CheckpointError(f"{path}: tensor {t.name} has dtype {t.tag} (known: "
                                  f"{', '.join(FLOAT_TAGS)}); quantize a dense checkpoint")
        if len(t.shape) == 2 and t.name.endswith(".weight") and params.packs(t.shape[1]):
            layer = t.name.removesuffix(".weight")
            shapes = params.packed_shapes(layer, *t.shape)
            out.append(_Out(t.name, "U32", shapes[t.name], t, "weight"))
            out.append(_Out(layer + ".scales", t.tag, shapes[layer + ".scales"], t, "scales"))
            out.append(_Out(layer + ".biases", t.tag, shapes[layer + ".biases"], t, "biases"))
        else:
            out.append(_Out(t.name, t.tag, t.shape, t, "copy"))
    return sorted(out, key=lambda o: 4 if o.tag in ("U32", "F32") else 2, reverse=True)


def _write_file(src: Path, dst: Path, plan: list[_Out], params: QuantParams) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}  # as mlx-lm writes it
    offset = 0
    for o in plan:
        header[o.name] = {"dtype": o.tag, "shape": list(o.shape),
                          "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    # A packed weight's scales and biases are written after every 4-byte tensor (bfloat16
    # and float16 models), so they wait here: 2 / group_size of the weight's values.
    waiting: dict[str, bytes] = {}
    partial = dst.with_name(dst.name + ".partial")
    with partial.open("wb") as f, src.open("rb") as source:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for o in plan:
            if o.part == "copy":
                source.seek(o.source.begin)
                remaining = o.source.end - o.source.begin
                while remaining:
                    chunk = source.read(min(remaining, _BLOCK_VALUES))
                    f.write(chunk)
                    remaining -= len(chunk)
            elif o.part == "weight":
                scales, biases = [], []
                for block in _rows_float32(src, o.source):
                    packed, s, b = affine_quantize(block, params.group_size, params.bits)
                    f.write(packed.tobytes())
                    scales.append(_float_bytes(s, o.source.tag))
                    biases.append(_float_bytes(b, o.source.tag))
                layer = o.name.removesuffix(".weight")
                waiting[layer + ".scales"] = b"".join(scales)
                waiting[layer + ".biases"] = b"".join(biases)
            else:
                f.write(waiting.pop(o.name))
    os.replace(partial, dst)  # renamed only once complete


def quantize_checkpoint(src_dir: Path | str, out_dir: Path | str, bits: int,
                        group_size: int) -> Path:
    """Rewrite the dense checkpoint in `src_dir` into mlx-lm's affine format in `out_dir`.

    Every linear weight, the embeddings and an untied head are packed when the group size
    divides their input width (as mlx-lm does); norms, biases and the rest are copied byte
    for byte. Shards keep their file names, so a range still reads only its own files.
    Returns `out_dir`.
    """
    params = QuantParams.checked(group_size, bits, "quantize:")
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    checkpoint = open_checkpoint(src_dir)
    if "quantization" in checkpoint.config or "quantization_config" in checkpoint.config:
        raise CheckpointError(f"{src_dir / 'config.json'}: already quantized; "
                              "quantize a dense checkpoint")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir}: directory is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)

    weight_map: dict[str, str] = {}
    total_bytes = 0
    for file_name in sorted(set(checkpoint.weight_map.values())):
        plan = _plan_file(src_dir / file_name, params)
        _write_file(src_dir / file_name, out_dir / file_name, plan, params)
        weight_map |= {o.name: file_name for o in plan}
        total_bytes += sum(o.nbytes for o in plan)
    if (src_dir / INDEX_FILE).exists():
        _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total_bytes},
                                           "weight_map": dict(sorted(weight_map.items()))})
    for path in sorted(src_dir.iterdir()):  # tokenizer, generation config, ...
        if path.is_file() and path.name != "config.json" and path.name != INDEX_FILE \
                and not path.name.endswith(".safetensors"):
            shutil.copy2(path, out_dir / path.name)
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
    # mlx-lm writes the dict twice: `quantization` for itself, `quantization_config` for
    # Hugging Face tooling that only knows that name.
    config = dict(checkpoint.config, quantization=quantization,
                  quantization_config=dict(quantization))
    _write_json(out_dir / "config.json", config)  # last: a half-written dir has no config
    return out_dir


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")
