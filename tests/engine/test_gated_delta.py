"""The chunked gated delta rule against its one-step form, token by token, from a given state."""

from __future__ import annotations

import pytest
import torch

from engine.backends.pytorch import gated_delta


def inputs(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k_heads, v_heads, k_dim, v_dim = 2, 4, 8, 6
    q = torch.randn(length, k_heads, k_dim, generator=g)
    k = torch.randn(length, k_heads, k_dim, generator=g)
    v = torch.randn(length, v_heads, v_dim, generator=g)
    decay = -torch.rand(length, v_heads, generator=g) * 2  # log decays, <= 0
    beta = torch.rand(length, v_heads, generator=g)
    state = torch.randn(v_heads, k_dim, v_dim, generator=g) * 0.1
    q, k = gated_delta.prepare(q, k, v_heads)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_equals_step_by_step(length):
    q, k, v, decay, beta, state = inputs(length, length)
    out, final = gated_delta.chunked(q, k, v, decay, beta, state)
    s = state[None]
    for t in range(length):
        want, s = gated_delta.step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1],
                                   beta[t:t + 1], s)
        torch.testing.assert_close(out[t], want[0], atol=1e-5, rtol=1e-5, msg=f"token {t}")
    torch.testing.assert_close(final, s[0], atol=1e-5, rtol=1e-5)


def test_a_split_chunk_continues_from_the_state_it_left():
    q, k, v, decay, beta, state = inputs(100, 1)
    whole, final = gated_delta.chunked(q, k, v, decay, beta, state)
    first, middle = gated_delta.chunked(q[:37], k[:37], v[:37], decay[:37], beta[:37], state)
    second, end = gated_delta.chunked(q[37:], k[37:], v[37:], decay[37:], beta[37:], middle)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)
