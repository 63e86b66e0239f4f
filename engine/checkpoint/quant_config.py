"""How an mlx-lm affine-quantized checkpoint stores each layer, read from config.json: the
format's description alone, pure Python, so placement (the supervisor) can charge packed
bytes without numpy or safetensors. The arithmetic and the writer are
engine.checkpoint.quantize."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


class QuantConfigError(ValueError):
    """config.json's `quantization` (or a quantize request) names a mode, bit width or group
    size that is not mlx-lm's affine format."""


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
                                   "supported (ringfleet reads mlx-lm's affine mode only)")
        group_size = entry.get("group_size", default.group_size if default else None)
        bits = entry.get("bits", default.bits if default else None)
        return cls.checked(group_size, bits, f"config.json: quantization{where}")

    @classmethod
    def checked(cls, group_size: Any, bits: Any, where: str) -> QuantParams:
        if bits not in AFFINE_BITS:
            raise QuantConfigError(f"{where} bits {bits!r} is not one of {AFFINE_BITS}")
        if group_size not in AFFINE_GROUP_SIZES:
            raise QuantConfigError(f"{where} group_size {group_size!r} is not one of "
                                   f"{AFFINE_GROUP_SIZES}")
        return cls(group_size, bits)

    def packs(self, in_features: int) -> bool:
        """Whether mlx-lm packs a weight this wide (else it leaves the layer dense)."""
        return in_features % self.group_size == 0 and (in_features * self.bits) % 32 == 0

    def packed_shapes(self, path: str, out_features: int,
                      in_features: int) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of the three tensors a packed [out, in] weight becomes."""
        if not self.packs(in_features):
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
                                       "is not supported (ringfleet reads mlx-lm's affine)")
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
        """How the layer at `path` is stored; `packed`: the checkpoint holds it as uint32.

        mlx-lm's loader decides the same way: a per-path entry wins, otherwise a layer is
        packed exactly when the checkpoint stores it packed.
        """
        if path in self.per_path:
            return self.per_path[path]
        return self.default if packed else None


def packed_params(quant: QuantConfig | None, name: str,
                  shape: tuple[int, ...]) -> QuantParams | None:
    """How mlx-lm would pack weight `name` of `shape` (its loader's rule: a per-path entry
    wins, else a 2-D weight whose input width packs), None where it stays dense. For shapes
    known only from config.json (the supervisor, calibration's random weights)."""
    if quant is None or len(shape) != 2 or not name.endswith(".weight"):
        return None
    params = quant.params(name.removesuffix(".weight"), quant.default.packs(shape[1]))
    return params if params is not None and params.packs(shape[1]) else None
