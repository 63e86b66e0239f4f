"""PyTorch reads mlx-lm's affine-quantized checkpoints: packed (the default) or dequantized.

Packed, each packed weight of the range becomes a `PackedWeight` (packed_linear.py): PyTorch's
int4 kernels run the matmuls on the codes, and the embeddings are looked up from the stored
bytes, so the range holds about the checkpoint's own bytes and decode reads them, not a dense
copy. Its values are not bit-equal to MLX's (docs/exactness.md holds both to mlx-lm).

Dequantized (`FLEET_QUANT=dense`, or a device whose int4 kernel refuses the dtype), the stage
unpacks each packed weight once, at load, into a dense tensor in the model's dtype and runs
the dense code path unchanged. The values are exactly those of `mx.dequantize` on the same
tensors: MLX computes `scales * q` and then `+ biases`, each rounded to the model dtype (two
roundings in bfloat16 and float16, not one fused multiply-add), and so does this. What
differs from an MLX stage is the matmul: MLX's `quantized_matmul` forms each weight in
float32 inside the kernel and never rounds it to the model dtype, so the two backends'
logits are close, not equal (docs/exactness.md). Memory: a 4-bit bfloat16 checkpoint at
group size 64 takes 3.6x its packed bytes this way (16 bits a weight against 4 + 2 * 16 / 64),
8-bit 1.9x; docs/quantized.md has the table.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.backends.pytorch.packed_linear import PackedWeight, pack_weight
from engine.checkpoint.quant_config import QuantConfig, QuantParams
from engine.checkpoint.quantize import unpack_bits


def dequantize(packed: Any, scales: torch.Tensor, biases: torch.Tensor,
               params: QuantParams) -> torch.Tensor:
    """packed uint32 [out, in * bits / 32] (numpy) -> [out, in] in `scales`' dtype and device.

    `scales` and `biases`: [out, in / group_size], already in the model dtype.
    """
    codes = torch.from_numpy(unpack_bits(packed, params.bits))  # [out, in] uint8
    out_features, groups = scales.shape
    # Every code (< 256) is exact in bfloat16, float16 and float32.
    w = codes.to(scales.device).to(scales.dtype).view(out_features, groups, params.group_size)
    w = w * scales[..., None]  # rounded to the dtype, as MLX rounds its multiply
    w = w + biases[..., None]  # then its add
    return w.view(out_features, groups * params.group_size)


def load_range_tensors(checkpoint: Any, shapes: dict[str, tuple[int, ...]], quant: QuantConfig,
                       dtype: torch.dtype, device: torch.device, *, packed: bool = False,
                       lookups: dict[str, bool] | None = None,
                       ) -> dict[str, torch.Tensor | PackedWeight]:
    """The named tensors of a quantized checkpoint, shape-checked, in `dtype`.

    A weight stored packed (or named by a per-path entry) is read as its three tensors and,
    with `packed`, kept packed (a PackedWeight), else dequantized; everything else is read as
    the dense path reads it. `lookups`: weight name -> whether it is also a matmul's (a tied
    head), for the weights looked up by row (the embeddings); every other packed weight is
    packed for matmuls only. Which layers are packed follows mlx-lm's loader
    (`QuantConfig.params`), and every shape is checked from the safetensors headers before
    any data is read.
    """
    dense: list[str] = []
    packing: dict[str, QuantParams] = {}  # weight name -> how it is packed
    for name, shape in shapes.items():
        layer = name.removesuffix(".weight")
        stored_packed = len(shape) == 2 and checkpoint.tensor_dtype(name) == "U32"
        params = quant.params(layer, stored_packed)
        if params is None:
            checkpoint.check_shape(name, shape)
            dense.append(name)
            continue
        for packed_name, packed_shape in params.packed_shapes(layer, *shape).items():
            checkpoint.check_shape(packed_name, packed_shape)
        packing[name] = params
    out: dict[str, torch.Tensor | PackedWeight] = {
        n: t.to(dtype) for n, t in checkpoint.load_tensors(dense, "pt", str(device)).items()}
    if not packing:
        return out
    # numpy reads the packed words (torch's uint32 lacks shifts on some devices), one weight
    # at a time, so a range's words are never all in memory beside what is packed from them;
    # scales and biases go through torch, which reads bfloat16.
    groups = checkpoint.load_tensors([n.removesuffix(".weight") + part for n in packing
                                      for part in (".scales", ".biases")], "pt", str(device))
    lookups = lookups or {}
    for name, params in packing.items():
        layer = name.removesuffix(".weight")
        scales, biases = groups[layer + ".scales"].to(dtype), groups[layer + ".biases"].to(dtype)
        words = checkpoint.load_tensors([name], "numpy")[name]
        if packed:
            out[name] = pack_weight(words, scales, biases, params, device,
                                    matmul=lookups.get(name, True), lookup=name in lookups)
        else:
            out[name] = dequantize(words, scales, biases, params)
    return out
