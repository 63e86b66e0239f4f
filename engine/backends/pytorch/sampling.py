"""Sampling a round's rows where the logits are, in torch (CPU, CUDA, MPS): engine.lanes.sampler's rule.

Every kind of row (greedy, drawn from the whole vocabulary, cut by top-k / top-p) runs
as one batch over its own rows; the kinds are known on the host, so the only decision
taken on the device's answer is the rare cut row whose nucleus reaches past
`NUCLEUS_CANDIDATES` tokens (sorted again in full). Two small tensors come back: ids and
logprobs. float32 throughout (MPS has no float64), so draws match the float64 reference
except where a uniform lands within float32 rounding of a boundary.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.lanes.sampler import SampledRows, SamplingBatch


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampledRows:
    """logits: [returned rows, vocab] on the stage's device."""
    if not len(batch):
        return SampledRows.empty()
    device = logits.device

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device, non_blocking=True)

    every_row = np.array_equal(batch.rows, np.arange(len(logits)))  # a decode round
    x = (logits if every_row else logits.index_select(0, on_device(batch.rows))).float()
    low, high = torch.aminmax(x, dim=-1)  # non-finite anywhere shows in one (NaN spreads)
    finite = torch.isfinite(low) & torch.isfinite(high)
    biased = x
    if len(batch.bias_at):
        biased = x.clone()
        biased.index_put_((on_device(batch.bias_at), on_device(batch.bias_token)),
                          on_device(batch.bias_value), accumulate=True)
    order = np.concatenate([batch.greedy, batch.plain, batch.cut])  # batch positions
    parts = []
    if len(batch.greedy):
        every = len(batch.greedy) == len(batch)
        parts.append((biased if every else biased[on_device(batch.greedy)]).argmax(-1))
    for kind, is_cut in ((batch.plain, False), (batch.cut, True)):
        if len(kind):
            # Advanced indexing copies, so the in-place steps below touch only this copy.
            probs = biased[on_device(kind)]
            top = probs.amax(-1) if len(batch.bias_at) else high[on_device(kind)]
            temperature = on_device(batch.temperature[kind].astype(np.float32))
            probs.sub_(top[:, None]).div_(temperature[:, None]).exp_()  # head: exp(0) = 1
            uniform = on_device(batch.uniform[kind].astype(np.float32))
            parts.append(_draw_cut(probs, batch, kind, uniform) if is_cut
                         else _inverse_cdf(probs, uniform))
    tokens = torch.empty(len(batch), dtype=torch.int64, device=device)
    tokens[on_device(order)] = torch.cat(parts)
    ints = [tokens[:, None], finite[:, None].long()]
    if batch.logprobs:
        lse = torch.logsumexp(x, -1)  # [n]
        floats = [x.gather(-1, tokens[:, None]) - lse[:, None]]
        if batch.max_top:
            top_values, top_ids = x.topk(batch.max_top, -1)
            floats.append(top_values - lse[:, None])
            ints.append(top_ids)
        floats_host = torch.cat(floats, 1).cpu().numpy()
    else:
        floats_host = np.full((len(batch), 1), np.nan, dtype=np.float32)
    ints_host = torch.cat(ints, 1).cpu().numpy()
    return SampledRows(ints_host[:, 0].copy(), floats_host[:, 0].copy(), ints_host[:, 2:],
                       floats_host[:, 1:], ints_host[:, 1].astype(bool))


def _draw_cut(probs: torch.Tensor, batch: SamplingBatch, kind: np.ndarray,
              uniform: torch.Tensor) -> torch.Tensor:
    """Rows cut by top-k and/or top-p. probs: [r, vocab] unnormalised, each row's largest 1."""
    vocab = probs.shape[-1]
    device = probs.device
    candidates = batch.candidates(vocab, kind)
    values, ids = probs.topk(candidates, -1)  # [r, candidates], most likely first
    top_k = torch.from_numpy(batch.top_k[kind]).to(device)
    top_p = torch.from_numpy(batch.top_p[kind]).to(device)[:, None]
    limit = torch.where(top_k > 0, top_k, vocab)[:, None]
    values = torch.where(torch.arange(candidates, device=device) < limit, values, 0.0)
    # top-p's mass is within top-k when a row has one, else the whole vocabulary's.
    total = torch.where(top_k > 0, values.sum(-1), probs.sum(-1))[:, None]
    mass = values.cumsum(-1) / total
    keep = (mass - values / total < top_p) | (top_p >= 1.0)
    picked = ids.gather(-1, _inverse_cdf(torch.where(keep, values, 0.0), uniform)[:, None])[:, 0]
    if candidates < vocab:
        beyond = ((top_k == 0) & (mass[:, -1] < top_p[:, 0])).nonzero()[:, 0].cpu().numpy()
        if len(beyond):  # the nucleus reaches past the candidates: sort those rows in full
            rows = torch.from_numpy(beyond).to(device)
            picked[rows] = _draw_full_sort(probs[rows], top_p[rows], uniform[rows])
    return picked


def _draw_full_sort(probs: torch.Tensor, top_p: torch.Tensor,
                    uniform: torch.Tensor) -> torch.Tensor:
    values, ids = probs.sort(dim=-1, descending=True, stable=True)
    total = values.sum(-1, keepdim=True)
    mass = values.cumsum(-1) / total
    keep = mass - values / total < top_p
    return ids.gather(-1, _inverse_cdf(torch.where(keep, values, 0.0), uniform)[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of `probs` [r, m] (unnormalised, >= 0) by `uniform` [r]."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    pick = torch.searchsorted(cdf, uniform[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last index with mass
    # The clamp only matters for a non-finite row, refused on the host but drawn with the rest.
    return torch.minimum(pick, last)[:, 0].clamp_(max=probs.shape[-1] - 1)
