"""Make seeded random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen3.5), streamed to disk."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from engine.checkpoint import qwen3_5_layout
from engine.checkpoint.reader import INDEX_FILE, SINGLE_FILE
from engine.checkpoint.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    MIN_VOCAB_SIZE,
    PAD_TOKEN_ID,
    write_tokenizer,
)
from engine.config import ModelConfig
from engine.families import Tensor, tensor_name

Family = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_5"]
DType = Literal["float32", "bfloat16", "float16"]

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5")
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# safetensors dtype tag and bytes per element.
DTYPES: dict[str, tuple[str, int]] = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}

# Every file the maker writes; `overwrite=True` removes only these names.
_MADE_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "model*.safetensors", INDEX_FILE, "*.partial")

# Random numbers are drawn in blocks of this many elements so an 8B tensor never sits in RAM
# as float32 (the embedding alone would be 2 GB); the size is fixed so bytes never depend on it.
_DRAW_BLOCK_ELEMENTS = 1 << 24
NORM_NOISE_STD = 0.05
BIAS_NOISE_STD = 0.05


class SpecError(ValueError):
    """A CheckpointSpec field holds a value the maker cannot write."""

    def __init__(self, field_name: str, value: object, reason: str) -> None:
        super().__init__(f"CheckpointSpec.{field_name} = {value!r}: {reason}")
        self.field_name = field_name
        self.value = value


class CheckpointExistsError(FileExistsError):
    """The output directory already holds files and overwriting was not asked for."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling, written as config.json's `rope_scaling`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def as_config(self) -> dict:
        return {
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "rope_type": "llama3",
        }


@dataclass(frozen=True)
class CheckpointSpec:
    """The shape, precision, layout and seed of a checkpoint to make."""

    family: Family = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 24
    vocab_size: int = 512
    dtype: DType = "float32"
    tie_word_embeddings: bool = False
    shards: int = 1
    seed: int = 0
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None
    # The qwen3_5 hybrid only: its Gated DeltaNet layers, layer pattern, rotary share, layout.
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4  # every n-th layer is full attention, the rest DeltaNet
    partial_rotary_factor: float = 0.25
    multimodal: bool = False  # the conditional-generation layout (vision tower, MTP tensors)
    # qwen3_5 only: a whole MTP head (`mtp.*`, one decoder layer), which a drafter reads.
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise SpecError("family", self.family, f"supported families are {list(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise SpecError("dtype", self.dtype, f"supported dtypes are {list(DTYPES)}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(name, value, "must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError("num_key_value_heads", self.num_key_value_heads,
                            f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.family == "llama" and self.hidden_size % self.num_attention_heads:
            # transformers' LlamaConfig refuses this even when head_dim is given explicitly.
            raise SpecError("hidden_size", self.hidden_size,
                            f"llama needs a multiple of num_attention_heads "
                            f"({self.num_attention_heads}), even with an explicit head_dim")
        if self.head_dim % 2:
            raise SpecError("head_dim", self.head_dim, "rotary embeddings need an even head_dim")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise SpecError("vocab_size", self.vocab_size,
                            f"must be at least {MIN_VOCAB_SIZE} (256 byte tokens + 3 special)")
        if not self.rope_theta > 0:
            raise SpecError("rope_theta", self.rope_theta, "must be positive")
        if not self.rms_norm_eps > 0:
            raise SpecError("rms_norm_eps", self.rms_norm_eps, "must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise SpecError("rope_scaling", self.rope_scaling, "must be None or Llama3RopeScaling")
        if self.sliding_window is not None:
            if self.family != "mistral":
                raise SpecError("sliding_window", self.sliding_window,
                                f"only the mistral family takes a sliding window, not {self.family}")
            if self.sliding_window < 1:
                raise SpecError("sliding_window", self.sliding_window, "must be positive or None")
        self._check_hybrid()
        tensor_count = len(tensor_plan(self))
        if self.shards > tensor_count:
            raise SpecError("shards", self.shards, f"more shards than tensors ({tensor_count})")


    def _check_hybrid(self) -> None:
        if self.family != "qwen3_5":
            if self.multimodal:
                raise SpecError("multimodal", self.multimodal,
                                f"only the qwen3_5 family has that layout, not {self.family}")
            if self.mtp:
                raise SpecError("mtp", self.mtp,
                                f"only the qwen3_5 family has an MTP head, not {self.family}")
            return
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim",
                     "full_attention_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(name, value, "must be a positive integer")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise SpecError("linear_num_value_heads", self.linear_num_value_heads,
                            f"must be a multiple of linear_num_key_heads "
                            f"({self.linear_num_key_heads})")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or rotary % 2:
            raise SpecError("partial_rotary_factor", self.partial_rotary_factor,
                            f"must rotate an even number of head_dim {self.head_dim}'s channels")


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its Hugging Face name, shape, and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    random_sign: bool = False  # multiply each value by +1 or -1 (drawn after the values)
    offset: float = 0.0  # added last, after the sign

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WriteProgress:
    """How far the weight writing has got, reported after every block of bytes."""

    file_name: str
    tensor_name: str
    bytes_done: int
    bytes_total: int


ProgressCallback = Callable[[WriteProgress], None]


def config_json(spec: CheckpointSpec) -> dict:
    """config.json as transformers writes it for the family (legacy rope keys, both dtype keys)."""
    if spec.family == "qwen3_5":
        return qwen3_5_layout.config_json(spec)
    config: dict = {
        "architectures": [ARCHITECTURES[spec.family]],
        "model_type": spec.family,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        # Hub checkpoints still carry rope_theta / rope_scaling; transformers 5 folds them
        # into `rope_parameters` on load, and older readers only know these names.
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling.as_config() if spec.rope_scaling else None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        # transformers 5 reads `dtype`; older readers and most hub files use `torch_dtype`.
        "dtype": spec.dtype,
        "torch_dtype": spec.dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        # Qwen2 always has q/k/v biases (its modeling code ignores this key); saying so here
        # lets every reader decide from config.json alone.
        "attention_bias": spec.family == "qwen2",
    }
    if spec.family == "llama":
        config |= {"mlp_bias": False, "pretraining_tp": 1}
    elif spec.family == "mistral":
        config["sliding_window"] = spec.sliding_window
    else:
        config |= {"use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": spec.num_hidden_layers}
    return config


def generation_config_json() -> dict:
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID}


def tensor_plan(spec: CheckpointSpec) -> list[TensorPlan]:
    """Every tensor in Hugging Face order (embeddings, layer by layer, final norm, head).

    Which tensors, named and shaped how, is the family's description's to say
    (`engine.families`, read through the config.json this spec writes); how each is drawn
    is the maker's. Linear weights have std 1/sqrt(fan_in) so each projection keeps unit
    scale; the ones that write into the residual stream (o_proj, down_proj, a DeltaNet's
    out_proj) are further divided by sqrt(2 * layers) so the residual stays O(1) however
    deep the model. Embeddings are 1/sqrt(hidden), the same scale as the sublayer outputs,
    so the current token stays visible through the layers.
    """
    config = ModelConfig.from_dict(config_json(spec))
    family = config.family
    ends = {t.field: t for t in family.end_tensors(config)}
    hidden = config.hidden_size
    plan = [TensorPlan(tensor_name(config, ends["embed"]), ends["embed"].shape,
                       1 / math.sqrt(hidden))]
    residual_scale = 1.0 / math.sqrt(2 * spec.num_hidden_layers)
    for layer in range(config.num_hidden_layers):
        plan += [_layer_tensor_plan(config, t, tensor_name(config, t, layer), residual_scale)
                 for t in family.layer_tensors(config, layer)]
    plan.append(_final_norm_plan(config, tensor_name(config, ends["norm"])))
    if "head" in ends:
        plan.append(_linear_plan(tensor_name(config, ends["head"]), ends["head"].shape))
    if spec.family == "qwen3_5" and spec.multimodal:
        plan += qwen3_5_layout.beside_text_plan(spec, TensorPlan)
    if spec.mtp:
        plan += _draft_head_plan(config, residual_scale)
    return plan


def _draft_head_plan(config: ModelConfig, residual_scale: float) -> list[TensorPlan]:
    """The MTP head (the family description's `draft_head_tensors`): its decoder layer drawn
    as the model's own, its fc as a projection, its norms as the (1 + weight) norms are."""
    plan = []
    for t in config.family.draft_head_tensors(config):
        if t.field == "fc":
            plan.append(_linear_plan(t.name, t.shape))
        elif "." in t.field:  # layerN.<field>: a full-attention layer's tensor
            field_ = t.field.split(".", 1)[1]
            plan.append(_layer_tensor_plan(config, replace(t, field=field_), t.name,
                                           residual_scale))
        else:  # embed_norm, hidden_norm, norm
            plan.append(TensorPlan(t.name, t.shape, NORM_NOISE_STD,
                                   mean=0.0 if config.norm_adds_one else 1.0))
    return plan


# A layer's weights by how they are drawn: projections (those writing into the residual
# stream scaled down further), biases, norms, and the DeltaNet's own terms.
_PROJECTIONS = frozenset({"q", "k", "v", "o", "gate", "up", "down", "qkv", "z", "b", "a", "out"})
_RESIDUAL_WRITERS = frozenset({"o", "down", "out"})
_BIASES = frozenset({"q_bias", "k_bias", "v_bias"})
_NORMS = frozenset({"input_norm", "post_norm", "q_norm", "k_norm"})


def _linear_plan(name: str, shape: tuple[int, ...], scale: float = 1.0) -> TensorPlan:
    return TensorPlan(name, shape, scale / math.sqrt(shape[1]))


def _layer_tensor_plan(config: ModelConfig, tensor: Tensor, name: str,
                       residual_scale: float) -> TensorPlan:
    f = tensor.field
    if f in _PROJECTIONS:
        return _linear_plan(name, tensor.shape, residual_scale if f in _RESIDUAL_WRITERS else 1.0)
    if f in _BIASES:
        return TensorPlan(name, tensor.shape, BIAS_NOISE_STD)
    if f in _NORMS:
        # A (1 + weight) norm's weights are offsets from one, so they are drawn around zero.
        return TensorPlan(name, tensor.shape, NORM_NOISE_STD,
                          mean=0.0 if config.norm_adds_one else 1.0)
    if f == "conv":
        return TensorPlan(name, tensor.shape, 1 / math.sqrt(tensor.shape[-1]))
    if f in ("dt_bias", "norm"):  # the gated RMSNorm scales by its plain weight
        return TensorPlan(name, tensor.shape, NORM_NOISE_STD, mean=1.0)
    if f == "a_log":
        return TensorPlan(name, tensor.shape, 0.5)
    raise ValueError(f"the maker has no way to draw {name} (field {f!r})")


def _final_norm_plan(config: ModelConfig, name: str) -> TensorPlan:
    """A tied head scores the current token's own embedding highly (its residual still holds
    it), so greedy decoding echoes one token forever. Random signs on the final norm's scale
    make that self-score average zero; the magnitudes stay 1 + noise. A (1 + weight) norm
    then stores weight = sign x (1 + noise) - 1."""
    shape = (config.hidden_size,)
    tied = config.tie_word_embeddings
    if not config.norm_adds_one:
        return TensorPlan(name, shape, NORM_NOISE_STD, mean=1.0, random_sign=tied)
    if tied:
        return TensorPlan(name, shape, NORM_NOISE_STD, mean=1.0, random_sign=True, offset=-1.0)
    return TensorPlan(name, shape, NORM_NOISE_STD)


def shard_file_names(shard_count: int) -> list[str]:
    if shard_count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{shard_count:05d}.safetensors" for i in range(1, shard_count + 1)]


def split_into_shards(plan: list[TensorPlan], shard_count: int,
                      bytes_per_element: int) -> list[list[TensorPlan]]:
    """Cut the plan into `shard_count` contiguous, non-empty runs of about equal bytes."""
    sizes = [t.element_count * bytes_per_element for t in plan]
    total = sum(sizes)
    starts = list(itertools.accumulate(sizes[:-1], initial=0))  # byte offset of each tensor
    boundaries: list[int] = []
    previous = 0
    for k in range(1, shard_count):
        target = total * k / shard_count
        boundary = next((i for i, start in enumerate(starts) if start >= target), len(plan))
        # Every shard keeps at least one tensor, whatever the byte sizes say.
        boundary = min(max(boundary, previous + 1), len(plan) - (shard_count - k))
        boundaries.append(boundary)
        previous = boundary
    edges = [0, *boundaries, len(plan)]
    return [plan[edges[i]:edges[i + 1]] for i in range(shard_count)]


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # One stream per tensor name: values do not depend on order, sharding or which tensors exist.
    name_words = np.frombuffer(hashlib.sha256(name.encode()).digest(), dtype="<u4")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *name_words.tolist()])))


def _to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    """`values` (float32, consumed: bfloat16 rounds it in place) as little-endian `dtype`."""
    if dtype == "float32":
        return values.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    # bfloat16 by round-to-nearest-even on the top 16 bits (the values are finite normals),
    # in place because this runs over every element of an 8B checkpoint.
    bits = values.astype("<f4", copy=False).view("<u4")
    lowest_kept_bit = (bits >> np.uint32(16)) & np.uint32(1)
    bits += np.uint32(0x7FFF)
    bits += lowest_kept_bit
    bits >>= np.uint32(16)
    return bits.astype("<u2").tobytes()


def tensor_blocks(spec: CheckpointSpec, tensor: TensorPlan) -> Iterator[bytes]:
    """The tensor's bytes in the spec's dtype, drawn block by block from its own stream."""
    rng = _tensor_rng(spec.seed, tensor.name)
    remaining = tensor.element_count
    while remaining:
        count = min(remaining, _DRAW_BLOCK_ELEMENTS)
        values = rng.standard_normal(count, dtype=np.float32)  # [count]
        values *= np.float32(tensor.std)
        values += np.float32(tensor.mean)
        if tensor.random_sign:
            values *= rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=count)
        if tensor.offset:
            values += np.float32(tensor.offset)
        yield _to_dtype_bytes(values, spec.dtype)
        remaining -= count


def _safetensors_header(tensors: list[TensorPlan], dtype: str) -> bytes:
    tag, bytes_per_element = DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        size = tensor.element_count * bytes_per_element
        header[tensor.name] = {"dtype": tag, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # safetensors pads the header with spaces so the data starts 8-byte aligned.
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class _WriteStopped(Exception):
    """Another shard's writer failed or was interrupted: this one stops at its next block."""


class _SharedProgress:
    """The bytes written so far over every shard, which are written at once by several threads."""

    def __init__(self, bytes_total: int, progress: ProgressCallback | None) -> None:
        self._bytes_total = bytes_total
        self._progress = progress
        self._bytes_done = 0
        self._lock = threading.Lock()
        self.stop = threading.Event()

    def wrote(self, file_name: str, tensor_name: str, count: int) -> None:
        if self.stop.is_set():
            raise _WriteStopped
        with self._lock:
            self._bytes_done += count
            if self._progress is not None:
                self._progress(WriteProgress(file_name, tensor_name, self._bytes_done,
                                             self._bytes_total))


def _write_shard(path: Path, spec: CheckpointSpec, tensors: list[TensorPlan],
                 progress: _SharedProgress) -> None:
    """Write one safetensors file tensor by tensor."""
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as out:
            out.write(_safetensors_header(tensors, spec.dtype))
            for tensor in tensors:
                for block in tensor_blocks(spec, tensor):
                    out.write(block)
                    progress.wrote(path.name, tensor.name, len(block))
    except BaseException:
        progress.stop.set()  # the other shards' writers stop at their next block
        raise
    # Renamed only once complete, so an interrupted write never looks like a checkpoint.
    os.replace(partial, path)


PRESETS: dict[str, CheckpointSpec] = {
    # Odd on purpose: head_dim 24 is not hidden / heads, and GQA is 2:1.
    "tiny": CheckpointSpec(),
    "demo": CheckpointSpec(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=1024, dtype="bfloat16", shards=2,
    ),
    # Llama-3.1-8B's shape: about 16 GB of bfloat16 in five shards of about 3.2 GB.
    "8b": CheckpointSpec(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, dtype="bfloat16", shards=5,
        rope_theta=500000.0, rope_scaling=Llama3RopeScaling(), max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
}


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointExistsError(f"{out_dir}: directory is not empty (pass overwrite)")
        for pattern in _MADE_PATTERNS:
            for stale in out_dir.glob(pattern):
                stale.unlink()


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def make_checkpoint(out_dir: Path | str, spec: CheckpointSpec, *, overwrite: bool = False,
                    progress: ProgressCallback | None = None) -> Path:
    """Write config, tokenizer and seeded weights for `spec` into `out_dir`; returns the dir.

    Memory stays bounded by one block of random numbers, whatever the model size.
    """
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, overwrite)
    tokenizer_files = write_tokenizer(out_dir, spec.vocab_size)
    if tokenizer_files.vocab_size > spec.vocab_size:
        raise SpecError("vocab_size", spec.vocab_size,
                        f"smaller than the tokenizer's {tokenizer_files.vocab_size} tokens")
    _write_json(out_dir / "config.json", config_json(spec))
    _write_json(out_dir / "generation_config.json", generation_config_json())

    bytes_per_element = DTYPES[spec.dtype][1]
    plan = tensor_plan(spec)
    bytes_total = sum(t.element_count for t in plan) * bytes_per_element
    shards = split_into_shards(plan, spec.shards, bytes_per_element)
    file_names = shard_file_names(spec.shards)
    shared_progress = _SharedProgress(bytes_total, progress)
    # Each shard draws from its tensors' own streams, so shards can be written at once: numpy
    # drops the GIL while it draws, rounds and writes, so threads use the cores.
    with ThreadPoolExecutor(max_workers=min(spec.shards, os.cpu_count() or 1)) as pool:
        written = [pool.submit(_write_shard, out_dir / file_name, spec, tensors, shared_progress)
                   for file_name, tensors in zip(file_names, shards, strict=True)]
        try:
            wait(written, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C here: the writers stop at their next block
            shared_progress.stop.set()
            raise
    # A failed shard's .partial file never becomes one; raise what failed first, not the
    # other writers' stopping because of it.
    errors = (shard.exception() for shard in written)
    cause = next((e for e in errors if e is not None and not isinstance(e, _WriteStopped)), None)
    if cause is not None:
        raise cause
    if spec.shards > 1:
        weight_map = {t.name: name for name, ts in zip(file_names, shards, strict=True) for t in ts}
        _write_json(out_dir / INDEX_FILE,
                    {"metadata": {"total_size": bytes_total}, "weight_map": weight_map})
    return out_dir


__all__ = [
    "PRESETS",
    "CheckpointExistsError",
    "CheckpointSpec",
    "Llama3RopeScaling",
    "SpecError",
    "TensorPlan",
    "WriteProgress",
    "config_json",
    "make_checkpoint",
    "tensor_plan",
]
