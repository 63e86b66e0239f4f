"""Sampling a round's rows where the logits are, in torch (CPU, CUDA, MPS): engine.lanes.sampler's rule.

Every kind of row (greedy, drawn from the whole vocabulary, cut by top-k / top-p) runs
as one batch over its own rows; the kinds are known on the host. The rows' numbers go to
the device in one copy, and one copy of ids (one more of logprobs, when a row asks) comes
back; the only decision taken on the device's answer is the rare cut row whose nucleus
reaches past `NUCLEUS_CANDIDATES` tokens, sorted again in full after that copy. float32 throughout (MPS has no float64), so draws match the float64 reference
except where a uniform lands within float32 rounding of a boundary.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling import SampledRows, SamplingBatch


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampledRows:
    """logits: [returned rows, vocab] on the stage's device."""
    if not len(batch):
        return SampledRows.empty()
    device = logits.device
    # The rows' numbers go to the device in one copy: [n, 4] temperature, top-p, uniform,
    # top-k; greedy rows need none. The copy does not wait for the device (a blocking one
    # would wait for the round's layers and head, and the draw's kernels would then launch
    # one by one onto an idle GPU); only the ids' copy back at the end does.
    per_row = None if len(batch.greedy) == len(batch) else on_device(device, np.stack([
        batch.temperature.astype(np.float32), batch.top_p, batch.uniform.astype(np.float32),
        batch.top_k.astype(np.float32)], 1))
    every_row = np.array_equal(batch.rows, np.arange(len(logits)))  # a decode round
    x = (logits if every_row else logits.index_select(0, on_device(device, batch.rows))).float()
    low, high = torch.aminmax(x, dim=-1)  # non-finite anywhere shows in one (NaN spreads)
    finite = torch.isfinite(low) & torch.isfinite(high)
    biased = x
    if len(batch.bias_at):
        biased = x.clone()
        biased.index_put_((on_device(device, batch.bias_at), on_device(device, batch.bias_token)),
                          on_device(device, batch.bias_value), accumulate=True)
    tokens = torch.empty(len(batch), dtype=torch.int64, device=device)
    beyond = torch.zeros(len(batch), dtype=torch.bool, device=device)
    for kind, draw in ((batch.greedy, None), (batch.plain, False), (batch.cut, True)):
        if not len(kind):
            continue
        rows = slice(None) if len(kind) == len(batch) else on_device(device, kind)
        if draw is None:
            tokens[rows] = biased[rows].argmax(-1)
            continue
        probs = _probs(biased, high, per_row, rows, bool(len(batch.bias_at)))
        uniform = per_row[rows, 2]
        if draw:
            tokens[rows], beyond[rows] = _draw_cut(probs, per_row[rows], batch.candidates(
                probs.shape[-1], kind))
        else:
            tokens[rows] = _inverse_cdf(probs, uniform)
    sampled, wide = _to_host(x, tokens, finite, beyond, batch)
    if len(wide):  # a nucleus reached past the candidates: sort those rows in full
        rows = on_device(device, wide)
        probs = _probs(biased, high, per_row, rows, bool(len(batch.bias_at)))
        tokens[rows] = _draw_full_sort(probs, per_row[rows, 1:2], per_row[rows, 2])
        sampled, _ = _to_host(x, tokens, finite, torch.zeros_like(beyond), batch)
    return sampled


def on_device(device: torch.device, values: np.ndarray) -> torch.Tensor:
    """Host values on `device`, the copy queued without waiting: a blocking copy to a GPU
    first waits for everything queued there, which would hold the host's next launches
    behind the device's last kernels."""
    return torch.from_numpy(values).to(device, non_blocking=True)


def _probs(biased: torch.Tensor, high: torch.Tensor, per_row: torch.Tensor, rows: object,
           biased_max: bool) -> torch.Tensor:
    """exp((logit - max) / temperature) of `rows`: [r, vocab], each row's largest 1."""
    probs = biased[rows]  # an index tensor copies; a slice is a view, so copy it
    if isinstance(rows, slice):
        probs = probs.clone()  # the in-place steps below touch only this copy
    top = probs.amax(-1) if biased_max else high[rows]
    return probs.sub_(top[:, None]).div_(per_row[rows, 0:1]).exp_()


def _to_host(x: torch.Tensor, tokens: torch.Tensor, finite: torch.Tensor,
             beyond: torch.Tensor, batch: SamplingBatch) -> tuple[SampledRows, np.ndarray]:
    """One copy of ids (and one of logprobs, when asked) to the host; and the batch
    positions whose nucleus reached past the candidates."""
    ints = [tokens[:, None], finite[:, None].long(), beyond[:, None].long()]
    floats_host = np.full((len(batch), 1), np.nan, dtype=np.float32)
    if batch.logprobs:
        lse = torch.logsumexp(x, -1)  # [n]
        floats = [x.gather(-1, tokens[:, None]) - lse[:, None]]
        if batch.max_top:
            top_values, top_ids = x.topk(batch.max_top, -1)
            floats.append(top_values - lse[:, None])
            ints.append(top_ids)
        floats_host = torch.cat(floats, 1).cpu().numpy()
    ints_host = torch.cat(ints, 1).cpu().numpy()
    sampled = SampledRows(ints_host[:, 0].copy(), floats_host[:, 0].copy(), ints_host[:, 3:],
                          floats_host[:, 1:], ints_host[:, 1].astype(bool))
    return sampled, np.flatnonzero(ints_host[:, 2])


def _draw_cut(probs: torch.Tensor, per_row: torch.Tensor,
              candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows cut by top-k and/or top-p: (tokens, rows whose nucleus reaches past the
    candidates). probs: [r, vocab] unnormalised, each row's largest 1; per_row: [r, 4]."""
    vocab = probs.shape[-1]
    values, ids = probs.topk(candidates, -1)  # [r, candidates], most likely first
    top_k, top_p = per_row[:, 3], per_row[:, 1:2]
    limit = torch.where(top_k > 0, top_k, vocab)[:, None]
    values = torch.where(torch.arange(candidates, device=probs.device) < limit, values, 0.0)
    # top-p's mass is within top-k when a row has one, else the whole vocabulary's.
    total = torch.where(top_k > 0, values.sum(-1), probs.sum(-1))[:, None]
    mass = values.cumsum(-1) / total
    keep = (mass - values / total < top_p) | (top_p >= 1.0)
    picked = ids.gather(-1, _inverse_cdf(torch.where(keep, values, 0.0),
                                         per_row[:, 2])[:, None])[:, 0]
    beyond = (top_k == 0) & (mass[:, -1] < top_p[:, 0]) & (candidates < vocab)
    return picked, beyond


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
