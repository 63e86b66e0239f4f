"""The gated delta rule on PyTorch: one step for decode rows, chunked for a prompt chunk.

The state S of a value head is a [k_dim, v_dim] matrix. Each token t decays it by
exp(g_t), reads what it predicts for its key, and writes back the correction, scaled by the
write strength beta_t (the delta rule): S <- exp(g_t) S + k_t (beta_t (v_t - k_t^T exp(g_t) S)),
and its output is q_t^T S. A chunk of tokens gets the same result from a few matmuls per
64 tokens (the UT transform of DeltaNet), instead of one small update per token.
Everything runs in float32, as the references do, whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked form


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare(q: torch.Tensor, k: torch.Tensor, v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., k_heads, k_dim] -> float32, unit length, one per value head; q also scaled
    by 1/sqrt(k_dim). Each key head serves v_heads // k_heads consecutive value heads."""
    repeat = v_heads // q.shape[-2]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=-2)
        k = k.repeat_interleave(repeat, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q / (q.shape[-1] ** 0.5), k


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of n streams.

    q, k: [n, heads, k_dim] (prepared); v: [n, heads, v_dim]; g, beta: [n, heads] float32;
    state: [n, heads, k_dim, v_dim] float32. Returns (out [n, heads, v_dim], new state).
    """
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(dim=-2)  # [n, heads, v_dim]
    delta = (v.float() - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L consecutive tokens of one stream, from `state`.

    q, k: [L, heads, k_dim] (prepared); v: [L, heads, v_dim]; g, beta: [L, heads] float32;
    state: [heads, k_dim, v_dim] float32. Returns (out [L, heads, v_dim], final state).
    """
    length = q.shape[0]
    pad = -length % CHUNK
    # [heads, chunks, CHUNK, ...]: padding rows have g = 0 and beta = 0, so they change nothing.
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, CHUNK), beta.reshape(heads, -1, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    decay = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each token
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    # between[..., i, j]: the decay from token j to token i of a chunk (0 where j > i)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    # Solving (I + strictly-lower(beta K K^T)) turns the chunk's writes into independent ones.
    system = (k_beta @ k.transpose(-1, -2)) * between
    writes = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                          unitriangular=True)
    inside = (q @ k.transpose(-1, -2)) * between  # attention within the chunk
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [heads, chunks, 1, 1]

    out = torch.empty_like(writes)
    for c in range(q.shape[1]):
        correction = writes[:, c] - reads[:, c] @ state  # [heads, CHUNK, v_dim]
        out[:, c] = q_decayed[:, c] @ state + inside[:, c] @ correction
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ correction
    out = out.reshape(heads, -1, out.shape[-1])[:, :length]
    return out.transpose(0, 1), state
