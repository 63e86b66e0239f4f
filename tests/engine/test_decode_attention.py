"""Decode attention with grouped heads passed as rows (kv_cache.heads_as_rows, what a CUDA
stage runs) is the attention transformers computes: each query head attends over its key
head's keys, under its own row's mask. Checked on the CPU against a float64 softmax written
the long way, and against the CPU's own form (SDPA's grouped heads)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.pytorch.kv_cache import attend_one_row_each, heads_as_rows


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """q [n, heads, d], k, v [n, kv_heads, keys, d], mask [n, 1, 1, keys]: per row, per
    query head h, softmax over its key head h // group's visible keys, in float64."""
    n, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for row in range(n):
        visible = mask[row, 0, 0]
        for h in range(heads):
            keys, values = k[row, h // group].double(), v[row, h // group].double()
            scores = keys[visible] @ q[row, h].double() / d ** 0.5
            out[row, h] = torch.softmax(scores, dim=0) @ values[visible]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (6, 2, 24), (24, 4, 32)])
def test_heads_as_rows_is_grouped_query_attention(heads, kv_heads, head_dim, dtype):
    rows, keys = 3, 70
    generator = torch.Generator().manual_seed(heads)
    q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(rows, kv_heads, keys, head_dim, generator=generator).to(dtype)
    v = torch.randn(rows, kv_heads, keys, head_dim, generator=generator).to(dtype)
    live = torch.tensor([70, 9, 1])  # each row's own length: the mask differs by row
    mask = (torch.arange(keys)[None, :] < live[:, None])[:, None, None, :]
    got = heads_as_rows(q, k, v, mask)
    assert got.shape == q.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    want = reference(q, k, v, mask)
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(attend_one_row_each(q, k, v, mask).double(), want,
                               atol=tolerance, rtol=tolerance)
    # A row that sees one key returns that key's value for every head of its group.
    torch.testing.assert_close(got[2], v[2, :, 0].repeat_interleave(heads // kv_heads, 0))
