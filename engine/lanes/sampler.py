"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, bias, seeded.

Every temperature the API accepts gives a proper distribution: the logits are shifted so
the largest is 0 before they are divided, temperatures below `GREEDY_BELOW` mean greedy
(dividing by a subnormal makes every other token -inf and the head NaN), and a row that
is not finite is refused by name instead of turning into NaN probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Below this a temperature is greedy, as in vLLM: the draw would be the argmax anyway
# (a logit gap of 1e-3 at T = 1e-5 is e^-100), and dividing by less risks overflow.
GREEDY_BELOW = 1e-5


class SamplingError(ValueError):
    """This stream's row cannot be sampled (the model produced non-finite logits)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


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
        self.greedy = params.temperature < GREEDY_BELOW

    def choose(self, logits: np.ndarray, top_logprobs: int = 0) -> Choice:
        """logits: [vocab] float32."""
        if not np.isfinite(logits).all():
            bad = int(np.count_nonzero(~np.isfinite(logits)))
            raise SamplingError(f"the model produced {bad} non-finite logits for this stream")
        logprobs = log_softmax(logits)
        biased = self._biased(logits)
        if self.greedy:
            token = int(np.argmax(biased))
        else:
            token = self._draw((biased - biased.max()) / self.params.temperature)
        top: tuple[tuple[int, float], ...] = ()
        if top_logprobs:
            best = np.argpartition(-logprobs, top_logprobs - 1)[:top_logprobs]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = tuple((int(t), float(logprobs[t])) for t in best)
        return Choice(token, float(logprobs[token]), top)

    def _biased(self, logits: np.ndarray) -> np.ndarray:
        x = logits.astype(np.float64)
        for token_id, bias in self.params.logit_bias:
            x[token_id] += bias
        return x

    def _draw(self, scaled: np.ndarray) -> int:
        """scaled: [vocab] float64, finite, at most 0 (its largest is 0)."""
        order = np.argsort(-scaled, kind="stable")  # most likely first
        if self.params.top_k:
            order = order[: self.params.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])  # the head is exp(0) = 1: sum >= 1
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(np.cumsum(probs), self.params.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
