"""A prompt chunk's attention over its slot on CUDA, by cuDNN's fused attention.

A chunk of n rows at positions [p, p + n) attends to keys [0, p + n) under lower-right
causality. SDPA runs that as FlashAttention-2, whose kernels are Ampere's; cuDNN has
attention kernels written for Hopper (bench/prompt_attention.py measures both side by side),
but its causal mask is aligned top-left, which for a chunk after a prefix would hide the
wrong keys. So a chunk is two attentions: over the p keys before it, unmasked, and over its
own n keys, a square where top-left and lower-right causality are the same mask. Each
returns its log-sum-exp, and the two are merged by their share of the softmax's mass: the
split a flash-decoding kernel makes across its blocks of keys.

cuDNN's fused kernels take as many key heads as query heads, so grouped key and value
heads are repeated for the call (a copy of the chunk's keys, small beside its attention).
FLEET_PROMPT_ATTENTION=flash keeps SDPA's kernels (engine.env's switches).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (q, k, v, causal) -> (out [b, heads, n, d], log-sum-exp [b, heads, n] or [b, heads, n, 1])
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                  tuple[torch.Tensor, torch.Tensor]]


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention and its log-sum-exp (top-left causal where `causal`)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False)
    return out, lse


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attend: Attend = cudnn_attend) -> torch.Tensor:
    """q [1, heads, n, d] for the last n of the keys k, v [1, kv_heads, keys, d]; each row
    sees the keys up to its own position. Returns [1, heads, n, d] in q's dtype."""
    heads, n, keys = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != heads:
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    own, own_lse = attend(q, k[:, :, keys - n:], v[:, :, keys - n:], True)
    if keys == n:
        return own
    before, before_lse = attend(q, k[:, :, :keys - n], v[:, :, :keys - n], False)
    # The share of each part in the whole softmax: exp(lse_a) / (exp(lse_a) + exp(lse_b)).
    share = torch.sigmoid(before_lse.float().reshape(*q.shape[:3], 1)
                          - own_lse.float().reshape(*q.shape[:3], 1))
    return torch.lerp(own.float(), before.float(), share).to(q.dtype)
