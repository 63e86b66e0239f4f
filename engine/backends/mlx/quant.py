"""mlx-lm's affine-quantized weights: which tensors are packed, their shapes, and the ops on them.

mlx-lm (`mlx_lm.convert -q`) stores a quantized linear or embedding `p` as three tensors:
`p.weight` (uint32, `bits` values packed per 32 bits: [out, in * bits / 32]), `p.scales`
and `p.biases` ([out, in / group_size], the model's float dtype), and writes
`"quantization": {"group_size", "bits", "mode", <path>: {...} or false, ...}` into
config.json. A layer is packed when its `p.scales` exists (mlx-lm leaves alone any layer
whose input width the group size does not divide, and any a recipe skipped); per-path
entries override the defaults. Norms are never packed. Only the affine mode is read here;
the float4/float8 modes (mxfp4, nvfp4, mxfp8) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


class QuantConfigError(ValueError):
    """config.json's `quantization` names a mode, bit width or group size we cannot run."""


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int

    @classmethod
    def from_entry(cls, where: str, entry: Mapping[str, Any],
                   default: QuantParams | None = None) -> QuantParams:
        mode = entry.get("mode", "affine")
        if mode != "affine":
            raise QuantConfigError(f"config.json: quantization{where} mode {mode!r} is not "
                                   "supported (the MLX backend reads affine only)")
        group_size = entry.get("group_size", default.group_size if default else None)
        bits = entry.get("bits", default.bits if default else None)
        if bits not in AFFINE_BITS:
            raise QuantConfigError(f"config.json: quantization{where} bits {bits!r} is not one "
                                   f"of {AFFINE_BITS}")
        if group_size not in AFFINE_GROUP_SIZES:
            raise QuantConfigError(f"config.json: quantization{where} group_size {group_size!r} "
                                   f"is not one of {AFFINE_GROUP_SIZES}")
        return cls(group_size, bits)

    def packed_shapes(self, path: str, out_features: int,
                      in_features: int) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of the three tensors a packed [out, in] weight becomes."""
        if in_features % self.group_size or (in_features * self.bits) % 32:
            raise QuantConfigError(f"{path}: input width {in_features} cannot be packed in "
                                   f"groups of {self.group_size} at {self.bits} bits")
        groups = in_features // self.group_size
        return {
            f"{path}.weight": (out_features, in_features * self.bits // 32),
            f"{path}.scales": (out_features, groups),
            f"{path}.biases": (out_features, groups),
        }


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's defaults and its per-path overrides (None: left unpacked)."""

    default: QuantParams
    per_path: Mapping[str, QuantParams | None] = field(default_factory=dict)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> QuantConfig | None:
        """From config.json's dict; None for a checkpoint that is not quantized."""
        entry = raw.get("quantization")
        if entry is None:
            legacy = raw.get("quantization_config")
            if legacy is None:
                return None
            if "group_size" not in legacy or "bits" not in legacy:
                method = legacy.get("quant_method", "?")
                raise QuantConfigError(f"config.json: quantization_config method {method!r} "
                                       "is not supported (the MLX backend reads mlx-lm's affine)")
            entry = legacy
        default = QuantParams.from_entry("", entry)
        per_path: dict[str, QuantParams | None] = {}
        for key, value in entry.items():
            if isinstance(value, Mapping):
                per_path[key] = QuantParams.from_entry(f"[{key!r}]", value, default)
            elif value is False:
                per_path[key] = None
        return cls(default, per_path)

    def params(self, path: str, packed: bool) -> QuantParams | None:
        """How the layer at `path` is stored; `packed`: the checkpoint holds `path.scales`."""
        if path in self.per_path:
            return self.per_path[path]
        return self.default if packed else None


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed [out, in] weight, used as mlx.nn.QuantizedLinear / QuantizedEmbedding do."""

    weight: mx.array  # [out, in * bits / 32] uint32
    scales: mx.array  # [out, in / group_size]
    biases: mx.array  # [out, in / group_size]
    group_size: int
    bits: int

    def matmul(self, x: mx.array) -> mx.array:
        """x [rows, in] -> [rows, out], as x @ weight.T."""
        if x.size == 0:  # MLX 0.32's CPU quantized_matmul dies of SIGFPE on zero rows
            return mx.zeros((*x.shape[:-1], self.weight.shape[0]), dtype=self.scales.dtype)
        return mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.biases,
                                   transpose=True, group_size=self.group_size, bits=self.bits)

    def rows(self, ids: mx.array) -> mx.array:
        """Dequantized rows `ids` of the weight (an embedding lookup): [len(ids), in]."""
        if ids.size == 0:  # dequantize cannot reshape an empty selection
            width = self.weight.shape[1] * 32 // self.bits
            return mx.zeros((*ids.shape, width), dtype=self.scales.dtype)
        return mx.dequantize(self.weight[ids], scales=self.scales[ids], biases=self.biases[ids],
                             group_size=self.group_size, bits=self.bits)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


Weight = mx.array | QuantizedWeight
