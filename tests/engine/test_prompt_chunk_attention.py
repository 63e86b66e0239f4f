"""Prompt chunks attend without a materialised mask, for the same bytes.

A chunk's rows are the last rows of the keys they read, so plain causality aligned to the
end of the keys (lower right) is their visibility: PyTorch's `causal_lower_right` (a flash
or memory-efficient kernel on CUDA) and MLX's fused "causal" mask. Each check runs the
same rows over the same random cache with the index's own (maskless) spans and with the
explicit boolean mask the spans carried before, and holds the outputs equal byte for byte;
a sliding window keeps its mask.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch

from engine.backends.mlx import kv_cache as mlx_kv
from engine.backends.pytorch import kv_cache as torch_kv
from tests.engine.conftest import layout_of

SLOTS, KV_HEADS, HEADS, HEAD_DIM, CONTEXT = 3, 2, 4, 16, 128


ROUNDS = {
    "first-chunk": ([], [(1, 0, 40)]),  # as many rows as keys
    "later-chunk": ([], [(2, 37, 90)]),  # fewer rows than keys
    "one-row-span": ([], [(0, 63, 64)]),
    "chunks-and-decode": ([(0, 70)], [(1, 20, 33), (2, 0, 9)]),
}
DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_name", ROUNDS)
def test_torch_chunks_without_a_mask_give_the_masked_bytes(round_name, dtype):
    layout = layout_of(*ROUNDS[round_name])
    gen = torch.Generator().manual_seed(5)
    cache = torch_kv.KVCache(1, SLOTS, KV_HEADS, CONTEXT, HEAD_DIM, getattr(torch, dtype),
                             torch.device("cpu"))
    cache.cover(layout)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(len(layout.positions), HEADS, HEAD_DIM, generator=gen).to(cache.k.dtype)
    masked = torch_kv.RoundIndex.build(layout, torch.device("cpu"), None)
    # The CPU keeps the explicit mask (see kv_cache's docstring); CUDA's path drops it.
    assert all(span.mask is not None for span in masked.spans)
    index = replace(masked, spans=[replace(s, mask=None) for s in masked.spans])
    got, want = cache.attend(0, index, q), cache.attend(0, masked, q)
    assert torch.isfinite(got).all()
    assert got.view(torch.uint8).numpy().tobytes() == want.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_name", ROUNDS)
def test_mlx_chunks_without_a_mask_give_the_masked_bytes(round_name, dtype):
    layout = layout_of(*ROUNDS[round_name])
    cache = mlx_kv.KVCache(1, SLOTS, KV_HEADS, CONTEXT, HEAD_DIM, getattr(mx, dtype))
    mx.random.seed(5)
    cache.k[0] = mx.random.normal(cache.k[0].shape).astype(cache.k[0].dtype)
    cache.v[0] = mx.random.normal(cache.v[0].shape).astype(cache.v[0].dtype)
    q = mx.random.normal((len(layout.positions), HEADS, HEAD_DIM)).astype(cache.k[0].dtype)
    index = mlx_kv.RoundIndex.build(layout, None)
    assert all(span.mask is None for span in index.spans)
    masked = replace(index, spans=[
        replace(s, mask=mlx_kv._visible(mx.arange(s.keys - (s.stop - s.start), s.keys)[:, None],
                                        s.keys, None))
        for s in index.spans])
    got, want = cache.attend(0, index, q, 0.25), cache.attend(0, masked, q, 0.25)
    got32, want32 = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.isfinite(got32).all()
    assert got32.tobytes() == want32.tobytes()


def test_a_sliding_window_keeps_its_mask():
    """Causality alone would let a chunk's rows see keys the window has dropped."""
    layout = layout_of([], [(0, 30, 50)])
    torch_span = torch_kv.RoundIndex.build(layout, torch.device("cpu"), 8).spans[0]
    mlx_span = mlx_kv.RoundIndex.build(layout, 8).spans[0]
    for mask in (torch_span.mask.numpy(), np.array(mlx_span.mask)):
        assert mask.shape == (20, 50)
        assert mask.sum(axis=1).tolist() == [8] * 20  # each row sees its window, no more
