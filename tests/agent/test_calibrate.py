"""Calibration: positive numbers, ordered as physics says (B rows cost no less than one row,
a longer context no less than a shorter one), cached on disk, and run by the agent."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.calibrate import (
    HOP,
    ROUND,
    CalibrationCache,
    CalibrationError,
    CalibrationRequest,
    calibrate,
    calibrate_cached,
)
from tests.agent.conftest import agent_config, client, serving
from tests.waiting import wait_until_async

# Attention-heavy on purpose (many KV heads, small MLP) so the cost of rows and of context
# stands well clear of timing noise on a busy two-core machine.
SHAPE = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=512)
SHORT, LONG, B = 256, 4096, 8


def request(backend: str = "torch-cpu", **fields) -> CalibrationRequest:
    return CalibrationRequest(**dict(dict(config=SHAPE, backend=backend, contexts=(SHORT, LONG),
                                          batch_rows=B, chunk_rows=128, runs=3, warmup=1,
                                          budget_s=8.0, threads=1), **fields))


async def finished_job(session, url: str, job: dict, within_s: float = 120) -> dict:
    """The calibration job's view once it no longer runs (done or failed)."""
    async def ended() -> dict | None:
        nonlocal job
        if job.get("state") == "running":
            async with session.get(f"{url}/v1/calibrations/jobs/{job['job_id']}") as r:
                job = await r.json()
        return job if job.get("state") != "running" else None

    return await wait_until_async(ended, within_s=within_s, poll_s=0.2,
                                  what=f"calibration job {job.get('job_id')} ended")


def check_ordered(result) -> None:
    host = [t for t in result.timings if t.kind in (ROUND, HOP)]
    assert all(t.ms_per_layer > 0 and t.runs >= 1 for t in result.timings if t not in host)
    # the host work beyond the layers: a serving round's and a loopback hop's, each timed
    # once (a round's may be 0: a difference under the noise of its layers)
    assert sorted(t.kind for t in host) == [HOP, ROUND]
    assert all(t.ms_per_layer >= 0 and t.runs >= 1 for t in host)
    for context in (SHORT, LONG):
        assert result.decode_ms(context, B) >= result.decode_ms(context, 1)
    for rows in (1, B):
        assert result.decode_ms(LONG, rows) >= result.decode_ms(SHORT, rows)
    assert result.prefill_ms > 0
    # rank 0's final norm, head and sampling, at 1 row and at B
    assert result.head_ms(1) > 0 and result.head_ms(B) > 0


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_calibration_is_positive_and_ordered(backend):
    steps = []
    result = calibrate(request(backend), "0.1.0", lambda d, t, what: steps.append((d, t)))
    check_ordered(result)
    total = 3 + 2  # building, built, one step per timed round (3), done
    assert steps[0] == (0, total) and steps[-1] == (total, total)
    assert (result.family, result.backend, result.dtype) == ("qwen3", backend, "float32")
    assert result.elapsed_s < 60


def test_calibration_is_cached_by_shape_dtype_backend_and_engine_version(tmp_path):
    cache = CalibrationCache(tmp_path)
    first = calibrate_cached(request(), cache, "0.1.0")
    assert not first.cached and cache.path(first.key).is_file()
    started = time.monotonic()
    again = calibrate_cached(request(), cache, "0.1.0")
    assert again.cached and again.timings == first.timings
    assert time.monotonic() - started < 1.0
    keys = {request().key("0.1.0"), request().key("0.2.0"), request(dtype="bfloat16").key("0.1.0"),
            request("mlx-cpu").key("0.1.0"),
            request(config=dict(SHAPE, hidden_size=128)).key("0.1.0")}
    assert len(keys) == 5
    # Layer count and vocabulary are not part of a layer's shape.
    assert request(config=dict(SHAPE, num_hidden_layers=40)).key("0.1.0") == first.key


def test_bad_calibration_requests_say_why():
    with pytest.raises(CalibrationError, match="not supported"):
        calibrate(request(config=dict(SHAPE, model_type="gpt2")), "0.1.0")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(CalibrationError, match="(?i)no cuda device"):
            calibrate(request("torch-cuda"), "0.1.0")
    with pytest.raises(CalibrationError, match="batch_rows"):
        request(batch_rows=0)
    with pytest.raises(CalibrationError, match="unknown backend"):
        request("torch-tpu")


def test_the_agent_calibrates_in_a_child_and_serves_the_cache(fleet, tmp_path):
    config = agent_config(fleet, tmp_path)
    body = dict(config=SHAPE, backend="torch-cpu", contexts=[SHORT, LONG], batch_rows=B,
                chunk_rows=128, runs=3, warmup=1, budget_s=8.0, threads=1)

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            async with session.post(url + "/v1/calibrations", json=body) as r:
                assert r.status == 202, await r.text()
                job = await r.json()
            job = await finished_job(session, url, job)
            assert job["state"] == "done", job
            assert job["done"] == job["total"] == 5
            from agent.calibrate import Calibration

            check_ordered(Calibration.from_dict(job["result"]))
            async with session.post(url + "/v1/calibrations", json=body) as r:
                assert r.status == 200
                assert (await r.json())["result"]["cached"] is True
            # Forced: measured again by a child, not answered from the cache by it either.
            async with session.post(url + "/v1/calibrations", json=dict(body, force=True)) as r:
                assert r.status == 202, await r.text()
                forced = await finished_job(session, url, await r.json())
            assert forced["state"] == "done" and not forced["result"].get("cached"), forced
            assert forced["result"]["measured_at"] > job["result"]["measured_at"]
            async with session.post(url + "/v1/calibrations", json=dict(body, backend="nope")) as r:
                assert r.status == 422
                assert "unknown backend 'nope'" in (await r.json())["error"]["message"]
            import mlx.core as mx

            absent = "torch-cuda" if mx.metal.is_available() else "mlx-metal"
            async with session.post(url + "/v1/calibrations",
                                    json=dict(body, backend=absent)) as r:
                assert r.status == 202
                bad = await r.json()
            bad = await finished_job(session, url, bad, within_s=60)
            assert bad["state"] == "failed" and "sees no" in bad["error"]

    asyncio.run(scenario())


HYBRID = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"])


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_a_hybrid_is_calibrated_per_layer_type(backend):
    result = calibrate(request(backend, config=HYBRID, contexts=(64,), batch_rows=4,
                               chunk_rows=32, runs=2, budget_s=6.0), "0.1.0")
    points = {(t.layer_type, t.kind, t.rows) for t in result.timings}
    assert points == {(layer_type, kind, rows) for layer_type in ("linear_attention",
                                                                  "full_attention")
                      for kind, rows in (("decode", 1), ("decode", 4), ("prefill", 32))} | {
        ("head", "head", 1), ("head", "head", 4),
        ("linear_attention", ROUND, 1), (HOP, HOP, 1)}  # the host work: the first type's
    assert all(t.ms_per_layer > 0 for t in result.timings if t.kind not in (ROUND, HOP))
    assert result.decode_ms(64, 1, "full_attention") != result.decode_ms(64, 1,
                                                                         "linear_attention")
    assert result.shape["layer_types"] == ["linear_attention", "full_attention"]
    # The hybrid's own fields are part of its key; a dense shape's key does not carry them.
    assert request(config=dict(HYBRID, linear_key_head_dim=32)).key("0.1.0") != \
        request(config=HYBRID).key("0.1.0")
    assert "layer_types" not in request().shape()


def test_the_threads_that_decide_the_engines_decide_the_calibration(monkeypatch):
    """The thread setting is part of the key (a layer on one thread and on every shared core
    costs 2-3x apart), read as the engine reads it: the request's, else OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = request(threads=0).key("0.1.0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = request(threads=0)
    assert one.thread_setting() == "OMP_NUM_THREADS=1"
    assert len({default, one.key("0.1.0"), request(threads=1).key("0.1.0"),
                request(threads=2).key("0.1.0")}) == 4
    import torch

    before = torch.get_num_threads()
    try:
        result = calibrate(request(threads=1, contexts=(SHORT,), runs=1), "0.1.0")
        assert result.threads == 1 == torch.get_num_threads()
        assert calibrate(request("mlx-cpu", contexts=(SHORT,), runs=1), "0.1.0").threads == 0
    finally:
        torch.set_num_threads(before)


def test_a_calibration_times_the_kernels_its_request_names(monkeypatch):
    """The stage options reach the stage, and the two CUDA switches the environment the
    stage reads them from, while it loads and while each round is built; the key tells
    every setting apart, and one at the defaults is the key it always was."""
    import os

    import agent.calibrate as calibration

    monkeypatch.setenv("FLEET_DECODE_ATTENTION", "triton")  # the agent's own, to be replaced
    monkeypatch.delenv("FLEET_PACKED_KERNEL", raising=False)
    seen = []

    class Timer:
        threads = 1

        def __init__(self, options):
            self.options = options
            seen.append(("load", os.environ.get("FLEET_DECODE_ATTENTION"),
                         os.environ.get("FLEET_PACKED_KERNEL")))

        def make_round(self, *point):
            def run():
                seen.append(("round", os.environ.get("FLEET_DECODE_ATTENTION"),
                             os.environ.get("FLEET_PACKED_KERNEL")))
            return run

    made = []
    monkeypatch.setattr(calibration, "make_timer", lambda request, layer_type, workdir,
                        head=False: made.append(Timer(request.stage_options())) or made[-1])
    monkeypatch.setattr(calibration, "hop_timer", lambda timer, rows: None)  # no stage to send
    asked = CalibrationRequest.from_dict(dict(
        config=SHAPE, backend="torch-cuda", runs=1, warmup=0, quant_mode="dense",
        compile="off", delta_kernel="torch", cuda_graphs=False, decode_attention="sdpa",
        packed_kernel="int4"))
    calibrate(asked, "0.1.0")
    assert made[0].options == {"quant": "dense", "compile": "off", "delta_kernel": "torch",
                               "cuda_graphs": False}
    assert seen and set(seen) == {(what, "sdpa", "int4") for what in ("load", "round")}
    # and the environment as it was before
    assert os.environ["FLEET_DECODE_ATTENTION"] == "triton"
    assert "FLEET_PACKED_KERNEL" not in os.environ

    defaults = request(decode_attention="triton", packed_kernel="triton")
    assert defaults.key("0.1.0") == request().key("0.1.0")
    keys = {request(**{name: value}).key("0.1.0") for name, value in (
        ("quant_mode", "dense"), ("compile", "on"), ("delta_kernel", "fla"),
        ("cuda_graphs", False), ("decode_attention", "sdpa"), ("packed_kernel", "int4"),
        ("prompt_attention", "cudnn"))}
    assert len(keys | {request().key("0.1.0")}) == 8
    with pytest.raises(CalibrationError, match=r"^decode_attention='flash': expected one of "
                                               r"triton, sdpa$"):
        request(decode_attention="flash")
    with pytest.raises(CalibrationError, match=r"^packed_kernel='int8': expected one of "
                                               r"triton, int4$"):
        request(packed_kernel="int8")
    with pytest.raises(CalibrationError, match=r"^quant_mode='int8': expected one of "
                                               r"auto, packed, dense$"):
        request(quant_mode="int8")


def test_the_prompt_chunk_is_timed_where_the_request_says(monkeypatch):
    """`prefill_end` moves the timed chunk (kept within [chunk, the stage's positions]); none
    times it at the context's end, under the key a calibration always had."""
    import agent.calibrate as calibration

    timed = []

    class Timer:
        threads = 1

        def make_round(self, kind, context, rows):
            timed.append((kind, context, rows))
            return lambda: None

    monkeypatch.setattr(calibration, "make_timer", lambda *_, **__: Timer())
    monkeypatch.setattr(calibration, "hop_timer", lambda timer, rows: None)  # no stage to send
    for end, expected in ((0, LONG), (1000, 1000), (10, 128), (10**6, LONG)):
        timed.clear()
        calibrate(request(prefill_end=end, runs=1, warmup=0), "0.1.0")
        assert next(p for p in timed if p[0] == "prefill") == ("prefill", expected, 128)
    assert request(prefill_end=0).key("0.1.0") == request().key("0.1.0")
    assert len({request(prefill_end=end).key("0.1.0") for end in (0, 1000, 2000)}) == 3
    with pytest.raises(CalibrationError, match="prefill_end=-1"):
        request(prefill_end=-1)
