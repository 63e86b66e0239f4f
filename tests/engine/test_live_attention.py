"""Attention reads the keys a round's rows can see, not the whole configured context.

A step's cost must follow the conversation, not FLEET_CONTEXT; and the context a fleet
configures must not change a short conversation's bytes. The probe for "never read" is a
fault injected into the cache: NaN in every position past what the conversation reaches.
A NaN that is read, even under a mask, poisons the output (0 x NaN is NaN), so finite,
unchanged logits show those positions were never read.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.backends.base import StageSpec, load_stage
from engine.backends.pytorch.kv_cache import (
    KEY_BUCKET_FLOOR,
    KVCache,
    RoundIndex,
    decode_index,
    key_bucket,
)
from engine.harness.local_pipeline import model_config
from engine.rounds import Op, RoundPlan, RowLayout, StreamEntry
from tests.engine.conftest import poison_torch_kv_past, stage_driver

BACKENDS = ["torch-cpu", "mlx-cpu"]
# Prompts of unequal lengths, so batched decode rows read past a shorter slot's end.
PROMPTS = {0: [5, 17, 9, 250, 3, 77, 41], 1: [8, 8, 120, 64], 2: [33] * 13}
STEPS = 12
REACHED = max(len(p) for p in PROMPTS.values()) + STEPS  # positions any slot ever holds


def bucket_by_enumeration(keys: int, context: int) -> int:
    """The smallest of 256 and every o x (1 + j / 4), o a power of two >= 256, j in 1..4,
    that holds `keys`, capped at the context: the rule written the long way."""
    sizes = {KEY_BUCKET_FLOOR}
    octave = KEY_BUCKET_FLOOR
    while octave < 2 * context:
        sizes.update(octave + j * octave // 4 for j in range(1, 5))
        octave *= 2
    return min(min(s for s in sizes if s >= keys), context)


@pytest.mark.parametrize("context", [64, 256, 300, 4096, 32768])
def test_key_bucket_is_the_quarter_octave_holding_the_live_keys(context):
    buckets = set()
    for keys in range(1, context + 1):
        bucket = key_bucket(keys, context)
        assert bucket == bucket_by_enumeration(keys, context), keys
        assert keys <= bucket <= context
        if keys > KEY_BUCKET_FLOOR and bucket < context:
            assert bucket % 64 == 0 and bucket < 1.25 * keys
        buckets.add(bucket)
    if context == 32768:  # what bounds the graphs one run of slots can need
        assert len(buckets) == 1 + 4 * int(math.log2(32768 // KEY_BUCKET_FLOOR)) == 29


def decode_layout(positions: list[int]) -> RowLayout:
    entries = tuple(StreamEntry(slot, Op.CONTINUE, pos, 1, pos, 0, 0)
                    for slot, pos in enumerate(positions))
    return RowLayout.of(RoundPlan(1, entries))


def test_a_bucket_reads_the_same_attention_as_the_live_length():
    """A captured step's index (keys up to a bucket, or the whole context, under a mask)
    gives the eager index's attention (keys up to the live length): within float32 noise
    across key counts, since the reduction runs over more (masked) keys."""
    gen = torch.Generator().manual_seed(3)
    context, slots, kv_heads, heads, head_dim = 1024, 3, 2, 4, 16
    cache = KVCache(1, slots, kv_heads, context, head_dim, torch.float32, torch.device("cpu"))
    positions = [90, 200, 37]
    cache.cover(decode_layout(positions))
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    q = torch.randn(slots, heads, head_dim, generator=gen)
    eager = cache.attend(0, RoundIndex.build(decode_layout(positions), torch.device("cpu"),
                                             None), q)
    live = max(positions) + 1
    for keys in (live, key_bucket(live, context), 512, context):
        index = decode_index(torch.tensor(positions), (0, slots), keys, None)
        got = cache.attend(0, index, q)
        if keys == live:
            assert torch.equal(got, eager)  # the same keys: the same bits
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=0)


def make_stage(backend: str, model_dir, context: int):
    layers = model_config(model_dir).num_hidden_layers
    return load_stage(StageSpec(model_dir, (0, layers), backend, 3, context, 64))


def poison_past(stage, start: int) -> None:
    """NaN in every slot's K and V at positions [start, context) (an injected fault)."""
    cache = stage.model.cache.kv if stage.config.is_hybrid else stage.model.cache
    if stage.spec.backend.startswith("torch"):
        poison_torch_kv_past(cache, start)
        return
    import mlx.core as mx

    for layer in range(len(cache.k)):
        cache.k[layer][:, :, start:] = mx.nan
        cache.v[layer][:, :, start:] = mx.nan
    mx.eval(cache.arrays())


def conversation(stage) -> tuple[dict[int, list[int]], dict[int, np.ndarray]]:
    driver = stage_driver(stage)
    tokens = driver.greedy(PROMPTS, STEPS)
    return tokens, driver.round({s: [t[-1]] for s, t in tokens.items()})


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_short_conversation_gives_the_same_bytes_under_any_configured_context(
        make_model, backend, family):
    """The dense family and the hybrid's gated attention layers, on both backends."""
    model_dir = make_model(family, seed=41)
    small_tokens, small_logits = conversation(make_stage(backend, model_dir, REACHED + 8))
    large = make_stage(backend, model_dir, 32768)
    poison_past(large, REACHED + 1)
    large_tokens, large_logits = conversation(large)
    assert large_tokens == small_tokens
    for slot, row in small_logits.items():
        assert np.isfinite(large_logits[slot]).all()
        assert large_logits[slot].tobytes() == row.tobytes(), slot


def test_the_probe_bites_when_the_whole_context_is_read(make_model):
    """The NaN probe is able to fail: the same decode round read over the whole context
    (the captured path before live-length buckets) comes out NaN, while the round read up
    to its bucket (which reads masked keys past the live length, up to 256) does not."""
    model_dir = make_model("qwen3", seed=41)
    stage = make_stage("torch-cpu", model_dir, 1024)
    conversation(stage)
    bucket = key_bucket(REACHED, 1024)
    poison_past(stage, bucket)
    positions = torch.tensor([REACHED - 1] * 3)
    rows = torch.randn(3, stage.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = stage.model.run_layers(rows, decode_index(positions, (0, 3), 1024, None))
        bucketed = stage.model.run_layers(rows, decode_index(positions, (0, 3), bucket, None))
    assert torch.isnan(whole).all() and torch.isfinite(bucketed).all()
