"""Rank 0's side of sampling: each stream's sampler (its seed and draws so far) and
`sample_on_host`, the rule (engine.sampling) in float64 numpy, one row at a time: the
reference the device samplers are tested against, and the host path the bench measures
them beside."""

from __future__ import annotations

import secrets

import numpy as np

from engine.sampling import (
    GREEDY_BELOW,
    Choice,
    RowDraw,
    SampledRows,
    SamplingBatch,
    SamplingParams,
    row_uniform,
)


class Sampler:
    """One per stream: its seed and how many tokens it has drawn fix each next draw."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # An unseeded stream still draws from a seed, a fresh one: the same machinery.
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.drawn = 0

    def draw(self, row: int, top_logprobs: int | None, ahead: int = 0) -> RowDraw:
        """This stream's next draw (or the one `ahead` draws later, for a verify round's
        later rows), from returned row `row` of the round."""
        return RowDraw(row, self.params, row_uniform(self.seed, self.drawn + ahead),
                       top_logprobs)

    def take(self, sampled: SampledRows, i: int, top_logprobs: int | None) -> Choice:
        """The choice made for this stream's draw at batch position `i`."""
        choice = sampled.choice(i, top_logprobs or 0)
        self.drawn += 1
        return choice


# The host reference ---------------------------------------------------------------------

def sample_on_host(logits: np.ndarray, batch: SamplingBatch) -> SampledRows:
    """The rule in float64 numpy, one row at a time. logits: [returned rows, vocab]."""
    n, k = len(batch), batch.max_top
    out = SampledRows(np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros((n, k), np.int64),
                      np.zeros((n, k), np.float32), np.zeros(n, bool))
    for i, row in enumerate(batch.rows):
        x = logits[row].astype(np.float64)
        out.finite[i] = np.isfinite(x).all()
        if not out.finite[i]:
            continue
        logprobs = x - x.max()
        logprobs -= np.log(np.exp(logprobs).sum())
        biased = x.copy()
        at = batch.bias_at == i
        np.add.at(biased, batch.bias_token[at], batch.bias_value[at].astype(np.float64))
        if batch.temperature[i] < GREEDY_BELOW:
            token = int(np.argmax(biased))
        else:
            scaled = (biased - biased.max()) / float(batch.temperature[i])
            token = _draw_on_host(scaled, int(batch.top_k[i]), float(batch.top_p[i]),
                                  float(batch.uniform[i]))
        out.token_ids[i], out.logprobs[i] = token, logprobs[token]
        if k:
            best = np.argsort(-logprobs, kind="stable")[:k]
            out.top_ids[i], out.top_logprobs[i] = best, logprobs[best]
    return out


def _draw_on_host(scaled: np.ndarray, top_k: int, top_p: float, uniform: float) -> int:
    """scaled: [vocab] float64, finite, its largest 0."""
    if not top_k and top_p >= 1.0:
        order = None  # the whole vocabulary in its own order: no sort
        probs = np.exp(scaled)
    else:
        order = np.argsort(-scaled, kind="stable")  # most likely first, lower id on ties
        if top_k:
            order = order[:top_k]
        probs = np.exp(scaled[order])
        if top_p < 1.0:
            mass = np.cumsum(probs) / probs.sum()
            probs = np.where(mass - probs / probs.sum() < top_p, probs, 0.0)
    return int(_inverse_cdf(probs, uniform) if order is None
               else order[_inverse_cdf(probs, uniform)])


def _inverse_cdf(probs: np.ndarray, uniform: float) -> int:
    cdf = np.cumsum(probs)
    pick = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return min(pick, int(np.searchsorted(cdf, cdf[-1], side="left")))  # last with mass
