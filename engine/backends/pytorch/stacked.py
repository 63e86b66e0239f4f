"""Projections that read one input, stacked by output into one weight as a PyTorch stage
loads: one matmul where a layer ran two to four.

A decode round's matmuls are one row a stream against each weight, so each is a separate
pass over its weight and a separate launch (two, where cuBLAS or our packed kernel splits
the inputs and adds the parts). An attention layer's q, k and v read the same normed row,
as do an MLP's gate and up and a DeltaNet layer's qkv, z, b and a: stacked, each group is
one pass and one launch, and the narrow projections (k and v; b and a, a row of heads
each) stop being launches that cannot fill the GPU. The anchor (bench/anchor.py) stacks
q, k and v the same way.

Stacking concatenates whole output rows, so each output is the same dot product over the
same inputs; a stacked product may still round differently from the separate ones (the
matmul's kernel is chosen by the stacked shape), and every stage of a ring stacks alike,
so a ring and one process stay byte-equal (RFC section 5). The bytes held do not change:
the parts are dropped once stacked (their fields set to None), and placement counts the
same tensors either way.

Only where the stage's device holds its own copy of the weights (CUDA, MPS). On the CPU a
dense weight is the checkpoint's own file pages, mapped: a stacked copy would hold the
layers twice in the resident set (SmolLM2-135M: 951 MB against 431 MB apart), and
stacking measured no faster there (docs/benchmarks.md, "Projections stacked at load").

Stacked: dense weights of one dtype and device; packed weights whose stored words the
Triton kernels read (their rows concatenate as the dense ones do). Not stacked: a group
mixing dense and packed weights (mlx-lm leaves some narrow projections unquantized), and
PyTorch's int4 passes (whose layout pads the outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.backends.pytorch.packed_linear import PackedWeight
from engine.family import DeltaNetWeights, LayerWeights


def stack_on(device: torch.device, layers: Sequence[LayerWeights | DeltaNetWeights]) -> None:
    """Stack every layer's groups of projections where `device` holds its own copy of the
    weights: not on the CPU (module docstring)."""
    if device.type == "cpu":
        return
    for layer in layers:
        stack(layer)
    if device.type == "cuda":  # the parts' blocks, back to the device
        torch.cuda.empty_cache()


def stack(layer: LayerWeights | DeltaNetWeights) -> None:
    """Stack `layer`'s groups of projections in place, where their weights allow."""
    if isinstance(layer, LayerWeights):
        biases = (layer.q_bias, layer.k_bias, layer.v_bias)
        if all(b is None for b in biases) or all(b is not None for b in biases):
            qkv = _stacked((layer.q, layer.k, layer.v))
            if qkv is not None:
                layer.qkv, layer.q, layer.k, layer.v = qkv, None, None, None
                if biases[0] is not None:
                    layer.qkv_bias = torch.cat(biases)
                    layer.q_bias = layer.k_bias = layer.v_bias = None
    else:
        inputs = _stacked((layer.qkv, layer.z, layer.b, layer.a))
        if inputs is not None:
            layer.inputs, layer.qkv, layer.z, layer.b, layer.a = inputs, None, None, None, None
    gate_up = _stacked((layer.gate, layer.up))
    if gate_up is not None:
        layer.gate_up, layer.gate, layer.up = gate_up, None, None


def _stacked(parts: Sequence[Any]) -> torch.Tensor | PackedWeight | None:
    """The parts' rows in one weight, or None where they cannot be one."""
    first = parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        if all(p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
            return torch.cat(parts)
        return None
    if not all(isinstance(p, PackedWeight) and p.words is not None and not p.passes
               and p.params == first.params and p.dtype == first.dtype
               and p.in_features == first.in_features for p in parts):
        return None
    words, scales, biases = (torch.cat([p.words[i] for p in parts]) for i in range(3))
    return PackedWeight(sum(p.out_features for p in parts), first.in_features, first.params,
                        first.dtype, words=(words, scales, biases))


def projections(x: torch.Tensor, stacked: Any, bias: Any, widths: Sequence[int],
                parts: Sequence[Any], biases: Sequence[Any] | None = None
                ) -> tuple[torch.Tensor, ...]:
    """x's projections by each of `parts`: one matmul by `stacked` (its outputs `widths`
    wide, in order) where the stage stacked them, else one matmul a part."""
    if stacked is not None:
        return F.linear(x, stacked, bias).split(list(widths), dim=-1)
    return tuple(F.linear(x, w, b) for w, b in zip(parts, biases or [None] * len(parts),
                                                    strict=True))
