"""mlx-lm's affine-quantized weights on MLX: the packed matmul and lookup (format: checkpoint.quantize).

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

from dataclasses import dataclass

import mlx.core as mx


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
