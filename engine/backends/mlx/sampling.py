"""Sampling a round's rows where the logits are, in MLX: engine.lanes.sampler's rule.

The same shape as the torch sampler: each kind of row (greedy, drawn from the whole
vocabulary, cut by top-k / top-p) as one batch over its own rows, evaluated once, and
two small arrays brought to the host. MLX's top-k is unordered, so candidates come from
an argpartition sorted afterwards; an inverse CDF counts the CDF entries at or below the
target (a searchsorted by one pass, which MLX runs vectorised).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.sampling import SampledRows, SamplingBatch


def sample(logits: mx.array, batch: SamplingBatch) -> SampledRows:
    """logits: [returned rows, vocab] (the stage's stream is the default one here)."""
    if not len(batch):
        return SampledRows.empty()
    every_row = np.array_equal(batch.rows, np.arange(logits.shape[0]))  # a decode round
    x = (logits if every_row else logits[mx.array(batch.rows)]).astype(mx.float32)
    high = mx.max(x, axis=-1)  # non-finite anywhere shows in max or min (NaN spreads)
    finite = mx.isfinite(high) & mx.isfinite(mx.min(x, axis=-1))
    biased = x
    if len(batch.bias_at):
        biased = x.at[mx.array(batch.bias_at), mx.array(batch.bias_token)].add(
            mx.array(batch.bias_value))
    order = np.concatenate([batch.greedy, batch.plain, batch.cut])  # batch positions
    parts = []
    if len(batch.greedy):
        every = len(batch.greedy) == len(batch)
        greedy_rows = biased if every else biased[mx.array(batch.greedy)]
        parts.append(mx.argmax(greedy_rows, axis=-1).astype(mx.int64))
    for kind, is_cut in ((batch.plain, False), (batch.cut, True)):
        if len(kind):
            scaled = biased[mx.array(kind)]
            top = mx.max(scaled, axis=-1) if len(batch.bias_at) else high[mx.array(kind)]
            scaled = (scaled - top[:, None]) \
                / mx.array(batch.temperature[kind].astype(np.float32))[:, None]
            uniform = mx.array(batch.uniform[kind].astype(np.float32))
            parts.append(_draw_cut(scaled, batch, kind, uniform) if is_cut
                         else _inverse_cdf(mx.exp(scaled), uniform))
    # Back to batch order: position order[j] holds drawn[j].
    tokens = mx.concatenate(parts)[mx.array(np.argsort(order, kind="stable"))]
    ints = [tokens[:, None], finite[:, None].astype(mx.int64)]
    floats = [mx.full((len(batch), 1), np.nan, dtype=mx.float32)]
    if batch.logprobs:
        lse = mx.logsumexp(x, axis=-1)  # [n]
        floats = [mx.take_along_axis(x, tokens[:, None], axis=-1) - lse[:, None]]
        if batch.max_top:
            top_ids = _top(x, batch.max_top)
            floats.append(mx.take_along_axis(x, top_ids, axis=-1) - lse[:, None])
            ints.append(top_ids)
    floats_out, ints_out = mx.concatenate(floats, axis=1), mx.concatenate(ints, axis=1)
    mx.eval(floats_out, ints_out)
    floats_host, ints_host = np.array(floats_out), np.array(ints_out)
    return SampledRows(ints_host[:, 0].copy(), floats_host[:, 0].copy(), ints_host[:, 2:],
                       floats_host[:, 1:], ints_host[:, 1].astype(bool))


def _top(x: mx.array, k: int) -> mx.array:
    """Indices [r, k] of each row's k largest, largest first."""
    if k >= x.shape[-1]:
        return mx.argsort(-x, axis=-1).astype(mx.int64)
    ids = mx.argpartition(-x, k - 1, axis=-1)[:, :k]
    ranked = mx.argsort(-mx.take_along_axis(x, ids, axis=-1), axis=-1)
    return mx.take_along_axis(ids, ranked, axis=-1).astype(mx.int64)


def _draw_cut(scaled: mx.array, batch: SamplingBatch, kind: np.ndarray,
              uniform: mx.array) -> mx.array:
    """Rows cut by top-k and/or top-p. scaled: [r, vocab], each row's largest 0."""
    vocab = scaled.shape[-1]
    candidates = batch.candidates(vocab, kind)
    ids = _top(scaled, candidates)  # [r, candidates], most likely first
    probs = mx.exp(mx.take_along_axis(scaled, ids, axis=-1))
    top_k_host = batch.top_k[kind]
    limit = mx.array(np.where(top_k_host > 0, top_k_host, vocab))[:, None]
    probs = mx.where(mx.arange(candidates)[None, :] < limit, probs, 0.0)
    top_p = mx.array(batch.top_p[kind])[:, None]
    # top-p's mass is within top-k when a row has one, else the whole vocabulary's.
    total = mx.where(mx.array(top_k_host > 0), probs.sum(-1),
                     mx.exp(scaled).sum(-1))[:, None]
    mass = mx.cumsum(probs, axis=-1) / total
    keep = (mass - probs / total < top_p) | (top_p >= 1.0)
    pick = _inverse_cdf(mx.where(keep, probs, 0.0), uniform)
    picked = mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]
    if candidates < vocab:
        beyond_mask = mx.array(top_k_host == 0) & (mass[:, -1] < top_p[:, 0])
        beyond = np.flatnonzero(np.array(beyond_mask))
        if len(beyond):  # the nucleus reaches past the candidates: sort those rows in full
            rows = mx.array(beyond)
            sub = scaled[rows]
            full = _top(sub, vocab)
            full_probs = mx.exp(mx.take_along_axis(sub, full, axis=-1))
            full_mass = mx.cumsum(full_probs, axis=-1) / full_probs.sum(-1, keepdims=True)
            full_keep = full_mass - full_probs / full_probs.sum(-1, keepdims=True) \
                < top_p[rows]
            pick = _inverse_cdf(mx.where(full_keep, full_probs, 0.0), uniform[rows])
            found = np.array(mx.take_along_axis(full, pick[:, None], axis=-1)[:, 0])
            host = np.array(picked)
            host[beyond] = found
            picked = mx.array(host)
    return picked


def _inverse_cdf(probs: mx.array, uniform: mx.array) -> mx.array:
    """Index drawn from each row of `probs` [r, m] (unnormalised, >= 0) by `uniform` [r]."""
    cdf = mx.cumsum(probs, axis=-1)
    total = cdf[:, -1:]
    pick = mx.sum(cdf <= uniform[:, None] * total, axis=-1)  # searchsorted, side right
    last = mx.sum(cdf < total, axis=-1)  # the last index with mass
    # The clamp only matters for a non-finite row, refused on the host but drawn with the rest.
    return mx.minimum(mx.minimum(pick, last), probs.shape[-1] - 1).astype(mx.int64)
