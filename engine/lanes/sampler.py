"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float  # of the chosen token under the model's own distribution
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


class Sampler:
    """One per stream: its random generator makes a seeded request reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def choose(self, logits: np.ndarray, top_logprobs: int = 0) -> Choice:
        """logits: [vocab] float32."""
        logprobs = log_softmax(logits)
        p = self.params
        if p.temperature == 0:
            token = int(np.argmax(logits))
        else:
            token = self._draw(logprobs / p.temperature)
        top: tuple[tuple[int, float], ...] = ()
        if top_logprobs:
            best = np.argpartition(-logprobs, top_logprobs - 1)[:top_logprobs]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = tuple((int(t), float(logprobs[t])) for t in best)
        return Choice(token, float(logprobs[token]), top)

    def _draw(self, scaled: np.ndarray) -> int:
        order = np.argsort(-scaled, kind="stable")  # most likely first
        if self.params.top_k:
            order = order[: self.params.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(np.cumsum(probs), self.params.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
