"""What a round's draws are and what comes back: the sampling rule, its parameters, the
per-row draw and its uniform, shared by every part that samples.

The lane host (engine.lanes) describes a round's draws as one `SamplingBatch` (per-row
parameters as arrays); the stage that holds the head samples every row at once where the
logits are (`engine.backends.pytorch.sampling`, `engine.backends.mlx.sampling`), and only
token ids and the logprobs asked for come back, as `SampledRows`. These types sit below
the backends, the pipeline and the lanes so that each imports them without importing the
others. `engine.lanes.sampler` keeps the per-stream sampler and `sample_on_host`, the same
rule in float64 numpy: the reference the device samplers are tested against.

The rule every implementation follows:
- logprobs are the model's own distribution: raw logits, no bias, no temperature;
- `logit_bias` is added to the logits; a temperature below `GREEDY_BELOW` (0 included) takes
  the argmax of the biased logits (the first on ties);
- otherwise the biased logits are shifted so the largest is 0 and divided by the
  temperature (every temperature the API accepts then gives a proper distribution);
  `top_k` keeps the k most likely tokens, `top_p` then keeps the smallest head whose mass
  (renormalised within top-k) reaches top_p, always at least one token;
- the token is drawn by inverse CDF (kept tokens most likely first when a row is cut, in
  vocabulary order when not) with ONE uniform per row, `row_uniform(seed, token index)`.
  So a stream's draws depend only on its seed and how many tokens it has drawn, never on
  which streams share its round or how rows are batched, and a seeded request repeats.
A row whose logits are not all finite is refused by name (`SamplingError`) instead of
turning into NaN probabilities; it ends that stream alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Below this a temperature is greedy, as in vLLM: the draw would be the argmax anyway
# (a logit gap of 1e-3 at T = 1e-5 is e^-100), and dividing by less risks overflow.
GREEDY_BELOW = 1e-5
# A row cut by top-p alone looks for its nucleus among this many most likely tokens first
# (a full sort of a 152k vocabulary costs far more than a top-k); a row whose nucleus
# reaches past them is sorted in full, so the cut stays exact.
NUCLEUS_CANDIDATES = 1024

_U64 = (1 << 64) - 1


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


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def row_uniform(seed: int, token_index: int) -> float:
    """The uniform in [0, 1) that draws token `token_index` of a stream seeded `seed`.

    A counter-based draw (SplitMix64 of the seed, then of the index): no generator state
    to carry, so any placement that samples the row gets the same number."""
    return (_splitmix64(_splitmix64(seed & _U64) ^ token_index) >> 11) * 2.0**-53


@dataclass(frozen=True)
class RowDraw:
    """One row to sample: which returned row, its parameters, its uniform, logprobs wanted."""

    row: int  # index among the round's returned rows
    params: SamplingParams
    uniform: float
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen one's and n more


@dataclass(frozen=True)
class SamplingBatch:
    """A round's draws as per-row arrays, positions in the batch order.

    Which rows are greedy, drawn from the whole vocabulary or cut by top-k / top-p is known
    here on the host, so a sampler runs each kind over its own rows with no decision on
    the device."""

    rows: np.ndarray  # [n] int64: returned-row index of each draw
    temperature: np.ndarray  # [n] float64 (a device takes it as float32)
    top_k: np.ndarray  # [n] int64, 0 = no limit
    top_p: np.ndarray  # [n] float32
    uniform: np.ndarray  # [n] float64
    top_logprobs: np.ndarray  # [n] int64
    logprobs: bool  # some row wants logprobs (else the chosen one's is not computed: NaN)
    bias_at: np.ndarray  # [m] int64: batch position of each bias entry
    bias_token: np.ndarray  # [m] int64
    bias_value: np.ndarray  # [m] float32
    keep_logits: bool = False  # also bring every returned row's logits to the host
    # Also keep every row of the round as the draft head reads them (engine.draft_head),
    # for rank 0's drafter: they stay on the head's device.
    keep_hidden: bool = False
    greedy: np.ndarray = field(init=False)  # batch positions, each kind ascending
    plain: np.ndarray = field(init=False)
    cut: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        greedy = self.temperature < GREEDY_BELOW
        cut = ~greedy & ((self.top_k > 0) | (self.top_p < 1.0))
        object.__setattr__(self, "greedy", np.flatnonzero(greedy))
        object.__setattr__(self, "plain", np.flatnonzero(~greedy & ~cut))
        object.__setattr__(self, "cut", np.flatnonzero(cut))

    @classmethod
    def of(cls, draws: Sequence[RowDraw], *, keep_logits: bool = False,
           keep_hidden: bool = False) -> SamplingBatch:
        bias = [(i, t, b) for i, d in enumerate(draws) for t, b in d.params.logit_bias]
        return cls(
            rows=np.array([d.row for d in draws], dtype=np.int64),
            temperature=np.array([d.params.temperature for d in draws], dtype=np.float64),
            top_k=np.array([d.params.top_k for d in draws], dtype=np.int64),
            top_p=np.array([d.params.top_p for d in draws], dtype=np.float32),
            uniform=np.array([d.uniform for d in draws], dtype=np.float64),
            top_logprobs=np.array([d.top_logprobs or 0 for d in draws], dtype=np.int64),
            logprobs=any(d.top_logprobs is not None for d in draws),
            bias_at=np.array([b[0] for b in bias], dtype=np.int64),
            bias_token=np.array([b[1] for b in bias], dtype=np.int64),
            bias_value=np.array([b[2] for b in bias], dtype=np.float32),
            keep_logits=keep_logits, keep_hidden=keep_hidden)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def max_top(self) -> int:
        return int(self.top_logprobs.max()) if len(self) else 0

    def candidates(self, vocab: int, positions: np.ndarray) -> int:
        """How many most likely tokens the cut rows at `positions` look among first."""
        return min(vocab, max(NUCLEUS_CANDIDATES, int(self.top_k[positions].max())))


@dataclass(frozen=True)
class SampledRows:
    """What comes back to the host for a round: per draw, in the batch's order."""

    token_ids: np.ndarray  # [n] int64
    logprobs: np.ndarray  # [n] float32: of the chosen token, model's own distribution (NaN
    # when no row of the batch asked for logprobs)
    top_ids: np.ndarray  # [n, max_top] int64, most likely first
    top_logprobs: np.ndarray  # [n, max_top] float32
    finite: np.ndarray  # [n] bool: the row's logits were all finite
    logits: np.ndarray | None = None  # [returned rows, vocab] float32, when the batch asked
    # [the round's rows, hidden], the draft head's input, on the device, when the batch asked
    hidden: Any = None

    @classmethod
    def empty(cls, logits: np.ndarray | None = None) -> SampledRows:
        return cls(np.empty(0, np.int64), np.empty(0, np.float32), np.empty((0, 0), np.int64),
                   np.empty((0, 0), np.float32), np.empty(0, bool), logits)

    def choice(self, i: int, top_logprobs: int) -> Choice:
        if not self.finite[i]:
            raise SamplingError("the model produced non-finite logits for this stream")
        top = tuple((int(t), float(lp)) for t, lp in
                    zip(self.top_ids[i, :top_logprobs], self.top_logprobs[i, :top_logprobs]))
        return Choice(int(self.token_ids[i]), float(self.logprobs[i]), top)
