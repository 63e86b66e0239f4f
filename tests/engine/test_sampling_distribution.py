"""Sampled tokens follow the exact softmax: a chi-square test on a small vocabulary, per
implementation (host reference, torch, MLX), with temperature, top-k and top-p.

Fixed seeds, so each case is deterministic; the threshold is the 0.1 % tail of the chi-square
law, and each case also checks that the same draws reject a deliberately wrong distribution
(the temperature ignored, the cut ignored), so the test has the power to fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.sampling import RowDraw, SamplingBatch, SamplingParams, row_uniform
from tests.engine.test_sampling import IMPLS, sample_with

DRAWS = 10_000
HOST_DRAWS = 5_000  # the float64 reference samples row by row in Python: fewer, same power
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.6, 0.5, 0.0, -0.3, -0.8, -1.0, -2.0, -3.5],
                  dtype=np.float32)


def exact(params: SamplingParams) -> np.ndarray:
    """The distribution the rule defines, in float64, written out independently."""
    scaled = LOGITS.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    kept = order[:params.top_k] if params.top_k else order
    mass = 0.0
    within = probs[kept].sum()
    for token in kept:  # the smallest head whose mass reaches top_p
        keep[token] = True
        mass += probs[token] / within
        if mass >= params.top_p:
            break
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens the distribution allows; a draw of a
    token it forbids makes the statistic infinite."""
    allowed = probs > 0
    if counts[~allowed].any():
        return math.inf, int(allowed.sum()) - 1
    expected = probs[allowed] * counts.sum()
    return float(((counts[allowed] - expected) ** 2 / expected).sum()), int(allowed.sum()) - 1


def critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - 0.001 (z: the normal's), by Wilson-Hilferty."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


CASES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.6": SamplingParams(temperature=0.6),
    "temperature 1.7, top-k 5": SamplingParams(temperature=1.7, top_k=5),
    "top-p 0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "temperature 0.9, top-k 8, top-p 0.7": SamplingParams(temperature=0.9, top_k=8, top_p=0.7),
}


def wrong(params: SamplingParams) -> SamplingParams:
    """A plausible bug: the temperature a quarter off, and any cut ignored."""
    return SamplingParams(temperature=params.temperature * 1.25)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_follow_the_exact_softmax(impl, case):
    params = CASES[case]
    seed = 1000 + list(CASES).index(case)
    draws = [RowDraw(0, params, row_uniform(seed, i))
             for i in range(HOST_DRAWS if impl == "host" else DRAWS)]
    tokens = sample_with(impl, LOGITS[None, :], SamplingBatch.of(draws)).token_ids
    counts = np.bincount(tokens, minlength=len(LOGITS))
    statistic, dof = chi_square(counts, exact(params))
    assert statistic < critical(dof), f"{case}: chi-square {statistic:.1f} on {dof} dof"
    wrong_statistic, wrong_dof = chi_square(counts, exact(wrong(params)))
    assert wrong_statistic > critical(wrong_dof), "the test could not tell a wrong distribution"
