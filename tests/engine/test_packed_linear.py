"""Packed int4 linears (engine.backends.pytorch.packed_linear) against the dense dequantized
weight: random shapes, every group size and bit width, float32 and bfloat16, on the CPU and
(where there is one) on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.backends.pytorch import dequant, packed_linear
from engine.backends.pytorch.packed_linear import PackedWeight, pack_weight
from engine.checkpoint.quant_config import AFFINE_BITS, AFFINE_GROUP_SIZES, QuantParams
from engine.checkpoint.quantize import affine_quantize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def stored(out_features: int, in_features: int, params: QuantParams, dtype: torch.dtype,
           seed: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """A random weight as mlx-lm stores it: words, and scales and biases in `dtype`."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    words, scales, biases = affine_quantize(w, params.group_size, params.bits)
    return words, torch.from_numpy(scales).to(dtype), torch.from_numpy(biases).to(dtype)


def cases():
    """(out, in, group, bits): every group size and bit width, output widths that need
    padding (18, 100) and ones that do not, inputs of one group and of several."""
    shapes = [(18, 64), (32, 128), (100, 256), (48, 384)]
    for i, (bits, group) in enumerate((b, g) for b in AFFINE_BITS for g in AFFINE_GROUP_SIZES):
        out_features, in_features = shapes[i % len(shapes)]
        in_features = max(in_features, group) // group * group
        yield out_features, in_features, group, bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features", "group", "bits"), list(cases()))
def test_packed_matmul_is_the_dense_product(device, dtype, out_features, in_features, group,
                                            bits):
    if device == "cuda" and dtype != torch.bfloat16:
        pytest.skip("CUDA's int4 kernel takes bfloat16 only (the stage holds others dense)")
    params = QuantParams(group, bits)
    words, scales, biases = stored(out_features, in_features, params, dtype, seed=bits * group)
    dense = dequant.dequantize(words, scales, biases, params).double()  # [out, in]
    weight = pack_weight(words, scales.to(device), biases.to(device), params,
                         torch.device(device), matmul=True, lookup=False)
    x = torch.randn(8, in_features, generator=torch.Generator().manual_seed(bits)).to(dtype)
    for rows in (0, 1, 8):
        got = F.linear(x[:rows].to(device), weight).cpu()
        assert got.shape == (rows, out_features) and got.dtype == dtype
        if rows == 0:
            continue
        want = x[:rows].double() @ dense.T
        if dtype == torch.float32:
            # One rounding added to each zero (an ulp of the bias) and the kernel's own
            # summation order: float32 noise on outputs of size ~1.
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
        else:
            # bfloat16 keeps 8 bits: the kernel rounds weights, products or partial sums
            # to it (CUDA's more than the CPU's), and at 5 to 8 bits adds two rounded
            # passes. A dot product's rounding error scales with the sum of |x| * |w|, not
            # with its result (terms cancel): a few bfloat16 steps (2**-8) of that.
            magnitude = x[:rows].double().abs() @ dense.abs().T
            assert ((got.double() - want).abs() <= 2**-6 * magnitude + 1e-3).all()
    # The matmul is not a dense matrix in disguise: our Triton kernel (CUDA) holds the
    # stored bytes themselves; the int4 kernel about as many (a nibble a code, twice for 5
    # to 8 bits, and padding to 16 rows).
    if packed_linear.matmul_kernel(torch.device(device), bits) == "triton":
        assert weight.nbytes == words.nbytes + scales.nbytes + biases.nbytes
        return
    passes = 1 if bits <= 4 else 2
    padded = -(-out_features // 16) * 16
    codes_bytes = passes * padded * in_features // 2
    assert weight.nbytes == codes_bytes + passes * padded * (in_features // group) * 2 * \
        dtype.itemsize


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_is_dequantize_bit_for_bit(bits, dtype):
    params = QuantParams(32, bits)
    words, scales, biases = stored(40, 96, params, dtype, seed=bits)
    weight = pack_weight(words, scales, biases, params, torch.device("cpu"), matmul=False,
                         lookup=True)
    ids = torch.tensor([[3, 0], [39, 3]])  # a 2-D batch of ids, repeats included
    got = F.embedding(ids, weight)
    want = dequant.dequantize(words, scales, biases, params)[ids]
    assert got.shape == (2, 2, 96)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert F.embedding(torch.tensor([], dtype=torch.int64), weight).shape == (0, 96)
    with pytest.raises(TypeError, match="lookups only"):
        F.linear(torch.zeros(1, 96, dtype=dtype), weight)


def test_a_tied_table_serves_lookups_and_the_head_and_a_bias_adds():
    params = QuantParams(64, 4)
    words, scales, biases = stored(32, 128, params, torch.float32, seed=1)
    weight = pack_weight(words, scales, biases, params, torch.device("cpu"), matmul=True,
                         lookup=True)
    dense = dequant.dequantize(words, scales, biases, params)
    assert torch.equal(F.embedding(torch.tensor([5]), weight), dense[[5]])
    x, bias = torch.randn(3, 128), torch.randn(32)
    torch.testing.assert_close(F.linear(x, weight, bias), F.linear(x, dense, bias),
                               atol=2e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="not .*matmul"):
        torch.matmul(x, weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
def test_packing_in_chunks_of_rows_gives_the_bytes_of_packing_at_once(monkeypatch, device,
                                                                       bits):
    # 200 rows in chunks of 64 (the last, of 8, padded to 16): every chunk boundary and the
    # padding, against the whole weight's codes packed in one call. (CUDA packs whole: there
    # it checks the padding alone.)
    params = QuantParams(32, bits)
    words, scales, biases = stored(200, 128, params, torch.bfloat16, seed=bits)
    monkeypatch.setattr(packed_linear, "CHUNK_CODE_BYTES", 64 * 128 * 8)
    device = torch.device(device)
    chunked = pack_weight(words, scales.to(device), biases.to(device), params, device,
                          matmul=True, lookup=False, kernel="int4")
    raw = torch.from_numpy(words.view(np.uint8)).to(device)
    codes = F.pad(packed_linear.unpack_codes(raw, bits).to(torch.int32), (0, 0, 0, 8))
    nibbles = [codes] if bits == 4 else [codes & 15, codes >> 4]
    assert len(chunked.passes) == len(nibbles)
    for one, part in zip(chunked.passes, nibbles, strict=True):
        assert torch.equal(one.packed, packed_linear._pack_codes(part, device))


def test_a_lookup_only_weight_refuses_a_matmul_and_a_matmul_weight_a_lookup():
    params = QuantParams(32, 4)
    words, scales, biases = stored(16, 64, params, torch.float32, seed=2)
    matmul_only = pack_weight(words, scales, biases, params, torch.device("cpu"), matmul=True,
                              lookup=False)
    with pytest.raises(TypeError, match="matmuls only"):
        F.embedding(torch.tensor([0]), matmul_only)
    assert isinstance(matmul_only, PackedWeight) and matmul_only.shape == (16, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernel_check_accepts_what_runs_and_dense_is_always_honoured(device):
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if device == "cpu" \
        else [torch.bfloat16]
    for dtype in dtypes:
        assert packed_linear.kernel_refusal(device, dtype) is None, dtype
    assert packed_linear.holds_packed("dense", f"torch-{device}", torch.device(device),
                                      torch.bfloat16, None) is False


def test_dense_cost_names_what_dequantizing_costs():
    assert packed_linear.dense_cost(QuantParams(64, 4), torch.bfloat16) == pytest.approx(3.56,
                                                                                          abs=0.01)
    assert packed_linear.dense_cost(QuantParams(64, 8), torch.bfloat16) == pytest.approx(1.88,
                                                                                          abs=0.01)
