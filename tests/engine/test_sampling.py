"""Sampling where the logits are: torch and MLX draw what the float64 host reference draws,
greedy keeps its rule, cold / extreme / non-finite rows are handled by name, and a seeded
stream draws the same tokens alone or beside other streams (a real model, a real lane host)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.lanes.host import Done, GenerationRequest, LaneHost, Token
from engine.lanes.sampler import sample_on_host
from engine.lanes.text import TextCodec
from engine.pipeline.runner import LocalRunner
from engine.sampling import (
    NUCLEUS_CANDIDATES,
    RowDraw,
    SampledRows,
    SamplingBatch,
    SamplingError,
    SamplingParams,
    row_uniform,
)
from tests.engine.conftest import whole_stage
from tests.requirements import require


def sample_with(impl: str, logits: np.ndarray, batch: SamplingBatch) -> SampledRows:
    """The batch's draws by one implementation: the host reference, torch or MLX."""
    if impl == "host":
        return sample_on_host(logits, batch)
    if impl.startswith("torch"):
        import torch

        from engine.backends.pytorch.sampling import sample

        return sample(torch.from_numpy(logits).to("cuda" if impl == "torch-cuda" else "cpu"),
                      batch)
    mx = require("mlx.core")
    from engine.backends.mlx.sampling import sample

    return sample(mx.array(logits), batch)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


DEVICES = ["torch", "mlx", pytest.param("torch-cuda", marks=pytest.mark.skipif(
    not _has_cuda(), reason="no CUDA device"))]
IMPLS = ["host", *DEVICES]


def one_row(impl: str, logits: np.ndarray, params: SamplingParams, uniform: float = 0.5,
            top: int = 0):
    sampled = sample_with(impl, logits[None, :], SamplingBatch.of([RowDraw(0, params, uniform, top)]))
    return sampled.choice(0, top)


MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
         SamplingParams(temperature=1.3, top_k=7), SamplingParams(temperature=1.0, top_p=0.85),
         SamplingParams(temperature=0.6, top_k=40, top_p=0.5),
         SamplingParams(temperature=1.0, logit_bias=((3, 4.0), (9, -50.0))),
         SamplingParams(temperature=0.0, logit_bias=((11, 9.0),)),
         SamplingParams(temperature=2.0, top_p=0.999)]


@pytest.mark.parametrize("impl", DEVICES)
def test_device_samplers_draw_what_the_float64_reference_draws(impl):
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(12, 2000)) * 3).astype(np.float32)  # peaked, as a model's are
    draws = [RowDraw(int(rng.integers(12)), MIXED[i % len(MIXED)], row_uniform(9, i), i % 4)
             for i in range(64)]
    batch = SamplingBatch.of(draws)
    want, got = sample_on_host(logits, batch), sample_with(impl, logits, batch)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-4)
    assert got.top_ids.tolist() == want.top_ids.tolist()
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-4)
    assert got.finite.all()


@pytest.mark.parametrize("impl", DEVICES)
def test_logprobs_are_computed_only_when_a_row_asks(impl):
    logits = (np.random.default_rng(8).normal(size=(4, 500)) * 3).astype(np.float32)
    draws = [RowDraw(i, MIXED[i], row_uniform(2, i), None) for i in range(4)]
    silent = sample_with(impl, logits, SamplingBatch.of(draws))
    asked = sample_with(impl, logits, SamplingBatch.of([*draws[:3], RowDraw(3, MIXED[3],
                                                                            draws[3].uniform, 2)]))
    assert silent.token_ids.tolist() == asked.token_ids.tolist()
    assert np.isnan(silent.logprobs).all() and np.isfinite(asked.logprobs).all()
    assert asked.choice(3, 2).top[0][0] == int(np.argmax(logits[3]))


@pytest.mark.parametrize("impl", DEVICES)
def test_a_nucleus_reaching_past_the_candidates_is_cut_exactly(impl):
    # Flat logits: top_p 0.9 of 5,000 tokens needs ~4,500 of them, past NUCLEUS_CANDIDATES.
    rng = np.random.default_rng(2)
    logits = rng.normal(scale=0.1, size=(3, 5000)).astype(np.float32)
    draws = [RowDraw(i % 3, SamplingParams(top_p=0.9), row_uniform(4, i), 0) for i in range(30)]
    draws.append(RowDraw(0, SamplingParams(top_p=0.9, top_k=3), 0.99, 0))  # beside a top-k row
    batch = SamplingBatch.of(draws)
    want = sample_on_host(logits, batch)
    assert (np.argsort(-logits, axis=1).argsort(axis=1)[batch.rows, want.token_ids[None, :]]
            >= NUCLEUS_CANDIDATES).any()  # some draw really came from past the candidates
    assert sample_with(impl, logits, batch).token_ids.tolist() == want.token_ids.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_takes_the_first_argmax_with_its_logprob(impl):
    logits = np.array([0.1, 3.0, -1.0, 3.0, 2.5], dtype=np.float32)
    choice = one_row(impl, logits, SamplingParams(temperature=0), top=2)
    assert choice.token_id == 1 == int(np.argmax(logits))  # ties: the lowest id, as numpy's
    assert choice.logprob == pytest.approx(np.log(np.exp(3.0) / np.exp(logits).sum()), rel=1e-6)
    assert {t for t, _ in choice.top} == {1, 3}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-9, 9.99e-6, 1e-5, 1e-3])
def test_every_accepted_temperature_draws_without_nan(impl, temperature):
    logits = np.random.default_rng(1).normal(scale=30, size=300).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=50)
    choices = {one_row(impl, logits, params, row_uniform(0, i)).token_id for i in range(20)}
    assert choices == {int(np.argmax(logits))}  # this cold, the draw is the argmax


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits_sample_without_nan(impl):
    logits = np.full(300, -3e38, dtype=np.float32)
    logits[7] = 3e38
    for temperature in (2.0, 1e-5, 0.5):
        assert one_row(impl, logits, SamplingParams(temperature=temperature), 0.999).token_id == 7


@pytest.mark.parametrize("impl", IMPLS)
def test_a_non_finite_row_is_refused_by_name_and_its_neighbours_still_draw(impl):
    logits = np.zeros((2, 10), dtype=np.float32)
    logits[0, 3] = np.nan
    logits[1, 4] = 5.0
    batch = SamplingBatch.of([RowDraw(0, SamplingParams(temperature=0.7), 0.5, 2),
                              RowDraw(1, SamplingParams(temperature=0.0), 0.5, 2)])
    sampled = sample_with(impl, logits, batch)
    with pytest.raises(SamplingError, match="non-finite logits"):
        sampled.choice(0, 2)
    assert sampled.choice(1, 2).token_id == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_logit_bias_moves_the_draw_but_not_the_reported_logprob(impl):
    logits = np.array([5.0, 1.0, 0.0, -1.0], dtype=np.float32)
    biased = one_row(impl, logits, SamplingParams(temperature=0, logit_bias=((2, 100.0),)))
    assert biased.token_id == 2
    assert biased.logprob == pytest.approx(float(np.log(np.exp(0) / np.exp(logits).sum())),
                                           rel=1e-5)
    banned = SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))
    assert 0 not in {one_row(impl, logits, banned, row_uniform(4, i)).token_id
                     for i in range(200)}


def test_a_draws_uniform_depends_on_the_seed_and_the_token_index_only():
    assert row_uniform(3, 10) == row_uniform(3, 10)
    values = [row_uniform(seed, i) for seed in range(20) for i in range(50)]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)


# A seeded stream alone and beside others -------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)


def generate(model_dir, requests: list[GenerationRequest], backend: str) -> list[list[int]]:
    """Every request's tokens, all submitted at once to one lane host."""
    from engine.backends.base import StageSpec, load_stage
    from engine.harness.local_pipeline import model_config

    if backend == "torch-cpu":
        stage = whole_stage(model_dir, parallel=4, context=64, chunk=8)
    else:
        require("mlx.core")
        layers = (0, model_config(model_dir).num_hidden_layers)
        stage = load_stage(StageSpec(model_dir, layers, backend, 4, 64, 8))
    host = LaneHost(LocalRunner(stage), TextCodec(model_dir), chunk=8, max_waiting=4)

    async def go() -> list[list[int]]:
        streams = [host.submit(r) for r in requests]
        task = asyncio.create_task(host.run())
        tokens: list[list[int]] = []
        for stream in streams:
            got: list[int] = []
            while not isinstance(event := await asyncio.wait_for(stream.events.get(), 60), Done):
                assert isinstance(event, Token), event
                got.append(event.token_id)
            tokens.append(got)
        task.cancel()
        return tokens

    try:
        return asyncio.run(go())
    finally:
        host.close()


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_a_seeded_stream_draws_the_same_tokens_alone_and_beside_other_streams(
        make_model, backend):
    model_dir = make_model("llama", seed=41)
    mine = GenerationRequest((5, 6, 7, 8, 9), max_tokens=12, sampling=SEEDED)
    others = [GenerationRequest(tuple(range(10, 10 + n)), max_tokens=6 + n,
                                sampling=SamplingParams(temperature=1.2, seed=n))
              for n in (3, 11, 17)]
    alone = generate(model_dir, [mine], backend)[0]
    # Beside others: a different slot, prompt chunks and decode rows of other streams in
    # its rounds, and streams ending around it.
    beside = generate(model_dir, [*others, mine], backend)[3]
    again = generate(model_dir, [others[0], mine], backend)[1]
    assert len(alone) == 12 and alone == beside == again


def test_the_drivers_device_greedy_round_draws_each_streams_argmax(make_model):
    """`RoundDriver.greedy_round` (serving's path, which bench/decode.py times: the draw on
    the stage's device, ids to the host) takes the tokens the logits' argmax does, stream
    by stream, over a prompt round and decode rounds of three streams."""
    from tests.engine.conftest import stage_driver

    model_dir = make_model("llama", seed=42)
    by_logits = stage_driver(whole_stage(model_dir, parallel=3, context=64, chunk=16))
    on_device = stage_driver(whole_stage(model_dir, parallel=3, context=64, chunk=16))
    feeds = {0: [5, 6, 7], 1: [9] * 11, 2: [40, 3]}
    steps = []
    for _ in range(8):
        expected = {s: int(np.argmax(row)) for s, row in by_logits.round(feeds).items()}
        got = on_device.greedy_round(feeds)
        assert got == expected
        steps.append(got)
        feeds = {s: [t] for s, t in got.items()}
    assert len({tuple(s.values()) for s in steps}) > 1  # not one token over and over
