"""Our Triton packed matmul (engine.backends.pytorch.packed_matmul_triton) on the CPU, through
triton's interpreter, against the float32 product of the dense dequantized weights: 4 and 8
bits, every group size, decode rows (GEMV and dot kernels), split-K and prompt chunks.

triton's interpreter is chosen as each kernel is decorated, its own library's (tl.zeros)
included, so these cases run in a pytest of their own with TRITON_INTERPRET=1 set before
triton is first imported (test_packed_matmul_triton.py starts it): set in the suite's own
process, it would turn every later Triton compile there into the interpreter's. Where there
is a GPU the CUDA tests run the same kernels compiled (test_packed_triton_cuda.py).
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

from engine.backends.pytorch import dequant
from engine.backends.pytorch.packed_linear import PackedWeight
from engine.checkpoint.quant_config import QuantParams
from engine.checkpoint.quantize import affine_quantize

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_packed_matmul_triton.py"
    return importlib.import_module("engine.backends.pytorch.packed_matmul_triton")


def stored(out_features: int, in_features: int, params: QuantParams, dtype: torch.dtype,
           seed: int):
    """A random weight as mlx-lm stores it: int32 words, scales, biases; and it dense."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    words, scales, biases = affine_quantize(w, params.group_size, params.bits)
    scales, biases = torch.from_numpy(scales).to(dtype), torch.from_numpy(biases).to(dtype)
    dense = dequant.dequantize(words, scales, biases, params).double()
    return torch.from_numpy(words.view(np.int32)), scales, biases, dense


def assert_is_the_dense_product(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor):
    want = x.double() @ dense.T
    assert got.shape == want.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    else:
        # The weights are dequantized in float32 and, for tl.dot, rounded once to the
        # activation dtype; the sum is float32. The error scales with sum |x| * |w|.
        magnitude = x.double().abs() @ dense.abs().T
        assert ((got.double() - want).abs() <= 2**-7 * magnitude + 1e-3).all()


def activation_dtype(rows: int, kernels) -> torch.dtype:
    # The interpreter's tl.dot multiplies bfloat16's raw uint16 bits (triton 3.5), so its
    # dot path is checked in float16 here and in bfloat16 on CUDA.
    return torch.bfloat16 if rows == 1 else torch.float16


@pytest.mark.parametrize(("bits", "group", "out_features"),
                         [(4, 32, 72), (4, 64, 200), (4, 128, 72), (8, 32, 200), (8, 64, 72),
                          (8, 128, 200)])
def test_decode_rows_are_the_dense_product(kernels, bits, group, out_features):
    params = QuantParams(group, bits)
    words, scales, biases, dense = stored(out_features, 128, params, torch.float32, bits + group)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(group))
    for rows in (1, 3, 16, 40):
        dtype = activation_dtype(rows, kernels)
        got = kernels.packed_matmul(x[:rows].to(dtype), words, scales.to(dtype),
                                    biases.to(dtype), bits, group)
        assert_is_the_dense_product(got, x[:rows].to(dtype),
                                    dequant.dequantize(words.numpy().view(np.uint32),
                                                       scales.to(dtype), biases.to(dtype),
                                                       params).double())
    got = kernels.packed_matmul(x[:3], words, scales, biases, bits, group)  # float32
    assert_is_the_dense_product(got, x[:3], dense)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_split_k_adds_its_chunks_in_a_fixed_order(kernels, bits):
    params = QuantParams(32, bits)
    words, scales, biases, dense = stored(40, 256, params, torch.bfloat16, 5)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    # One row through the planes kernel, three through the dot kernel, two chunks each.
    for rows, launch, dtype in ((1, kernels.Launch(1, 4, 128, 2, 1, 2), torch.bfloat16),
                                (3, kernels.Launch(16, 32, 128, 2, 4, 3), torch.float16)):
        args = (x[:rows].to(dtype), words, scales.to(dtype), biases.to(dtype), bits, 32)
        got = kernels.packed_matmul(*args, launch=launch)
        assert_is_the_dense_product(got, x[:rows].to(dtype), dense)
        assert torch.equal(got, kernels.packed_matmul(*args, launch=launch))


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 128), (8, 64)])
def test_a_few_rows_by_planes_are_the_dense_product(kernels, bits, group):
    """The planes kernel's rows form (bfloat16, rows a power of two or not, split-K or not)
    and the dot kernel a plane at a time (float16 here: the interpreter's bfloat16 tl.dot)."""
    params = QuantParams(group, bits)
    words, scales, biases, _ = stored(40, 512, params, torch.float32, bits + group)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(group))
    for rows in (2, 3, 8):
        for dtype, launch in ((torch.bfloat16, kernels.Launch(1, 4, 256, 2, 1, 2)),
                              (torch.bfloat16, kernels.Launch(1, 2, 256, 1, 1, 1)),
                              (torch.float16, kernels.Launch(16, 32, 256, 2, 4, 2,
                                                             by_plane=True))):
            args = (x[:rows].to(dtype), words, scales.to(dtype), biases.to(dtype), bits, group)
            got = kernels.packed_matmul(*args, launch=launch)
            assert_is_the_dense_product(got, x[:rows].to(dtype),
                                        dequant.dequantize(words.numpy().view(np.uint32),
                                                           scales.to(dtype), biases.to(dtype),
                                                           params).double())
            assert torch.equal(got, kernels.packed_matmul(*args, launch=launch))
    with pytest.raises(ValueError, match="1 to 16 bfloat16 rows"):
        kernels.packed_matmul(x[:2].half(), words, scales.half(), biases.half(), bits, group,
                              launch=kernels.Launch(1, 4, 256, 1, 1, 1))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_one_row_kernel_by_tensor_descriptor_is_the_dense_product(kernels, bits):
    """Tiles brought by tensor descriptor (TMA on Hopper), steps loaded ahead, split-K: the
    same sums as the pointer loads, in the same order."""
    params = QuantParams(32, bits)
    words, scales, biases, dense = stored(40, 1024, params, torch.bfloat16, 6)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for splits in (1, 2):
        by_pointer = kernels.packed_matmul(x, words, scales, biases, bits, 32,
                                           launch=kernels.Launch(1, 4, 256, splits, 1, 2))
        got = kernels.packed_matmul(x, words, scales, biases, bits, 32,
                                    launch=kernels.Launch(1, 16, 256, splits, 1, 3, tma=True))
        assert_is_the_dense_product(got, x, dense)
        assert torch.equal(got, by_pointer)


def test_a_weight_descriptors_cannot_take_is_read_by_pointer(kernels):
    """TMA wants 16-byte aligned rows: a view whose row stride is not (a weight cut out of a
    wider one) runs the pointer loads instead, with the same sums."""
    params = QuantParams(32, 4)
    words, scales, biases, dense = stored(40, 1056, params, torch.bfloat16, 7)
    cut = (words[:, :128], scales[:, :32], biases[:, :32])  # 1,024 inputs, rows 33 groups apart
    launch = kernels.Launch(1, 16, 256, 1, 1, 3, tma=True)
    assert not kernels._descriptors_fit(launch, *cut, 4, 32)
    assert kernels._descriptors_fit(launch, *(t.contiguous() for t in cut), 4, 32)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    got = kernels.packed_matmul(x, *cut, 4, 32, launch=launch)
    assert torch.equal(got, kernels.packed_matmul(x, *(t.contiguous() for t in cut), 4, 32,
                                                  launch=launch))
    assert_is_the_dense_product(got, x, dense[:, :1024])


def test_prompt_chunks_dequantize_then_multiply(kernels):
    params = QuantParams(64, 8)
    words, scales, biases, dense = stored(24, 128, params, torch.bfloat16, 9)
    w = kernels.dequantize(words, scales, biases, 8, 64, torch.bfloat16)
    # Each weight is q * scale + bias in float32, rounded once; MLX's rule rounds the
    # product (|q * scale| <= |w| + |bias|) and then the sum: half an ulp each.
    bias = biases.double().repeat_interleave(64, dim=1)
    assert ((w.double() - dense).abs() <= 2**-8 * (2 * dense.abs() + bias.abs())).all()
    rows = kernels.DOT_ROWS_MAX + 1
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert_is_the_dense_product(kernels.packed_matmul(x, words, scales, biases, 8, 64), x,
                                dense)


def test_a_packed_weight_runs_the_stored_words_and_holds_their_bytes_once(kernels):
    params = QuantParams(32, 4)
    words, scales, biases, dense = stored(72, 128, params, torch.float16, 3)
    raw = words.view(torch.uint8)
    weight = PackedWeight(72, 128, params, torch.float16, rows=(raw, scales, biases),
                          words=(words, scales, biases))  # a tied table: one copy
    assert weight.nbytes == raw.nbytes + scales.nbytes + biases.nbytes
    x = torch.randn(2, 1, 128, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    got = torch.nn.functional.linear(x, weight)
    assert got.shape == (2, 1, 72)
    assert_is_the_dense_product(got.view(2, 72), x.view(2, 128), dense)


def test_stacked_packed_projections_compute_each_part(kernels):
    """q, k and v packed (as a 4-bit checkpoint's are) stacked into one packed weight by a
    torch stage (engine/backends/pytorch/stacked.py): each part's outputs are its dense
    product, through the kernels on the stacked shape; gate and up likewise."""
    from engine.backends.pytorch import stacked
    from engine.family import LayerWeights

    params = QuantParams(32, 4)

    def packed(out_features: int, seed: int) -> tuple[PackedWeight, torch.Tensor]:
        words, scales, biases, dense = stored(out_features, 128, params, torch.bfloat16, seed)
        return PackedWeight(out_features, 128, params, torch.bfloat16,
                            words=(words, scales, biases)), dense

    (q, dq), (k, dk), (v, dv), (o, _), (gate, dg), (up, du), (down, _) = (
        packed(n, seed) for seed, n in enumerate((96, 24, 24, 128, 72, 72, 128)))
    layer = LayerWeights(torch.ones(128), q, k, v, o, torch.ones(128), gate, up, down)
    stacked.stack(layer)
    assert isinstance(layer.qkv, PackedWeight) and layer.qkv.out_features == 144
    assert layer.q is None and layer.gate is None and layer.gate_up.out_features == 144
    assert layer.qkv.nbytes == q.nbytes + k.nbytes + v.nbytes
    # One bfloat16 row, a decode step's (the interpreter's bfloat16 tl.dot is not checked).
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for whole, widths, denses in ((layer.qkv, (96, 24, 24), (dq, dk, dv)),
                                  (layer.gate_up, (72, 72), (dg, du))):
        parts = torch.nn.functional.linear(x, whole).split(widths, dim=-1)
        for got, dense in zip(parts, denses, strict=True):
            assert_is_the_dense_product(got, x, dense)


def test_the_compiled_decode_step_takes_packed_weights(kernels, make_model):
    """torch.compile traces the decode layer over packed weights whole (fullgraph): their
    matmul is an operator Inductor keeps, and the compiled layer computes what the eager
    one does, over a cache of three slots with keys written at unequal positions."""
    from engine.backends.pytorch.compiled_step import compiled_decode_block
    from engine.backends.pytorch.llama import Rope, decode_block
    from engine.family import LayerWeights
    from engine.harness.local_pipeline import model_config

    config = model_config(make_model("qwen3", hidden_size=64, intermediate_size=128,
                                     head_dim=32, num_attention_heads=4, num_key_value_heads=2))
    params = QuantParams(32, 4)
    generator = torch.Generator().manual_seed(8)

    def packed(out_features: int, in_features: int) -> PackedWeight:
        words, scales, biases, _ = stored(out_features, in_features, params, torch.float32,
                                          out_features + in_features)
        return PackedWeight(out_features, in_features, params, torch.float32,
                            words=(words, scales, biases))

    def norm(width: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(width, generator=generator)

    h, q_width, kv_width, inter = 64, 128, 64, 128
    w = LayerWeights(norm(h), packed(q_width, h), packed(kv_width, h), packed(kv_width, h),
                     packed(h, q_width), norm(h), packed(inter, h), packed(inter, h),
                     packed(h, inter), q_norm=norm(32), k_norm=norm(32))
    rope = Rope(config, 64, torch.device("cpu"), torch.float32)
    positions = torch.tensor([5, 17, 0])
    x = torch.randn(3, h, generator=generator)
    # k, v: [pages, kv, page, dim], two tensors as KVCache holds them (the compiled layer
    # cannot prove two views of one tensor apart); each slot's one page, out of order.
    cache = [torch.randn(4, 2, 64, 32, generator=generator) for _ in "kv"]
    pages = torch.tensor([[2], [0], [3]])
    step = compiled_decode_block()
    with torch.inference_mode():
        want = decode_block(x, w, config, rope.cos, rope.sin,
                            *(c.clone() for c in cache), pages, positions)
        got = step(x, w, config, rope.cos, rope.sin, *(c.clone() for c in cache), pages,
                   positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
