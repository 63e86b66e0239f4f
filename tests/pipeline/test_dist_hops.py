"""Hops on torch.distributed: gloo between CPU stages (the same code NCCL runs between CUDA
stages), chosen per hop, falling back to TCP on both ends when the group will not form,
and failing fast like any broken link."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from engine.env import EngineEnv, EnvError
from engine.harness.launch import launch, log_records
from engine.harness.local_pipeline import whole_runner
from engine.hop_choice import choose, hop_plan, placement_backends
from engine.pipeline import hop_transport
from tests.pipeline.conftest import greedy_trace, pipeline
from tests.waiting import rank0_health, wait_until

CHUNK = 64
STEPS = 24
# Rows over gloo; a broken hop fails its round within a minute rather than the default five.
DIST = {"FLEET_HOP_TRANSPORT": "dist", "FLEET_ROUND_DEADLINE_S": "60"}


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 300, 150 - 9 * i).tolist() for i in range(count)]


def test_choice_per_hop():
    placement = "0-2@torch-cuda,2-4@torch-cuda,4-5@mlx-metal"
    assert placement_backends(placement, 3) == ["torch-cuda", "torch-cuda", "mlx-metal"]
    # auto keeps TCP until NCCL hops have run on two GPUs; dist asks for them.
    assert [kind for kind, _ in hop_plan("auto", placement, 3)] == ["tcp", "tcp", "tcp"]
    assert [kind for kind, _ in hop_plan("dist", placement, 3)] == ["nccl", "tcp", "tcp"]
    assert [kind for kind, _ in hop_plan("tcp", placement, 3)] == ["tcp"] * 3
    assert [kind for kind, _ in hop_plan("dist", "0-1@torch-cpu,1-2@torch-cpu", 2)] == \
        ["gloo", "gloo"]
    assert choose("auto", "torch-cpu", "torch-cpu")[0] == "tcp"
    assert choose("dist", "torch-cpu", "mlx-cpu")[0] == "tcp"
    assert choose("dist", "torch-cuda", "torch-cpu")[0] == "tcp"
    # A standalone engine's placement names no backends: nothing to agree on, TCP.
    assert hop_plan("dist", "local", 2) == [choose("dist", None, None)] * 2
    assert choose("dist", None, None)[0] == "tcp"


def test_the_setting_is_checked_and_written_back(tmp_path):
    base = {"FLEET_MODEL": str(tmp_path)}
    assert EngineEnv.from_environ(base).hop_transport == "auto"
    env = EngineEnv.from_environ({**base, "FLEET_HOP_TRANSPORT": "dist"})
    assert env.to_environ()["FLEET_HOP_TRANSPORT"] == "dist"
    assert "FLEET_HOP_TRANSPORT" not in EngineEnv.from_environ(base).to_environ()
    with pytest.raises(EnvError) as refused:
        EngineEnv.from_environ({**base, "FLEET_HOP_TRANSPORT": "nccl"})
    assert refused.value.variable == "FLEET_HOP_TRANSPORT"


@pytest.mark.parametrize("stages", [[(0, 4), (4, 5)], [(0, 1), (1, 4), (4, 5)]],
                         ids=["2-stages", "3-stages"])
def test_dist_hops_give_the_bits_of_one_process(make_model, tmp_path, stages):
    model_dir = make_model("qwen3", num_hidden_layers=5, seed=17)
    whole = whole_runner(model_dir, chunk=CHUNK, depth=len(stages))
    expected = greedy_trace(whole, model_dir, prompts(3), steps=STEPS, chunk=CHUNK)
    with pipeline(model_dir, stages, tmp_path, chunk=CHUNK,
                  extra_env=DIST) as runner:
        assert runner.ring.hops.transports == ("gloo",) * len(stages)
        assert runner.ring.hops.out is not None and runner.ring.hops.into is not None
        got = greedy_trace(runner, model_dir, prompts(3), steps=STEPS, chunk=CHUNK)
    assert [plan for plan, _ in got] == [plan for plan, _ in expected]
    for (plan, logits), (_, want) in zip(got, expected, strict=True):
        assert logits == want, f"round {plan.round_no} differs"
    for rank in range(1, len(stages)):
        chosen = [e for e in log_records(tmp_path / "run" / f"rank{rank}.log")
                  if e.get("event") == "hop on torch.distributed"]
        assert len(chosen) == 2, f"rank {rank} did not put both its hops on gloo"


def test_auto_on_cpu_keeps_tcp(make_model, tmp_path):
    model_dir = make_model("qwen3", num_hidden_layers=2, seed=18)
    with pipeline(model_dir, [(0, 1), (1, 2)], tmp_path, chunk=CHUNK) as runner:
        assert runner.ring.hops.transports == ("tcp", "tcp")
        assert runner.ring.hops.out is None and runner.ring.hops.into is None
        assert len(greedy_trace(runner, model_dir, prompts(1), steps=4, chunk=CHUNK)) > 4
    events = log_records(tmp_path / "run" / "rank1.log")
    assert not [e for e in events if "hop" in e.get("event", "") and e["event"] != "hop transports"]
    assert [e["hops"] for e in events if e.get("event") == "hop transports"] == [["tcp", "tcp"]]


def test_a_failed_rendezvous_falls_back_to_tcp_on_both_ends(make_model, tmp_path, monkeypatch):
    """Rank 0 offers a store port nobody listens on: its outgoing hop's group never forms,
    both its ends say so and use TCP; the other hop is still on gloo; rounds stay exact."""
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    monkeypatch.setattr(hop_transport, "store_address_for_offer",
                        lambda store, host: (host, dead_port))
    model_dir = make_model("qwen3", num_hidden_layers=2, seed=19)
    whole = whole_runner(model_dir, chunk=CHUNK, depth=2)
    expected = greedy_trace(whole, model_dir, prompts(2), steps=8, chunk=CHUNK)
    with pipeline(model_dir, [(0, 1), (1, 2)], tmp_path, chunk=CHUNK,
                  extra_env=DIST) as runner:
        assert runner.ring.hops.transports == ("tcp", "gloo")
        assert runner.ring.hops.out is None and runner.ring.hops.into is not None
        got = greedy_trace(runner, model_dir, prompts(2), steps=8, chunk=CHUNK)
    assert [logits for _, logits in got] == [logits for _, logits in expected]
    fallbacks = [e for e in log_records(tmp_path / "run" / "rank1.log")
                 if e.get("event") == "hop falls back to tcp"]
    assert len(fallbacks) == 1 and fallbacks[0]["reason"], fallbacks


KEEPALIVE_S = 0.5
DEAD_AFTER = 3
EXIT_BOUND_S = KEEPALIVE_S * DEAD_AFTER + 5.0  # as tests/pipeline/test_faults.py


@pytest.mark.parametrize("victim", [1])
def test_a_follower_killed_mid_stream_ends_every_stage(make_model, tmp_path, victim):
    from openai import OpenAI

    model = make_model("qwen2", num_hidden_layers=3, seed=7)
    fleet = launch(model, [(0, 1), (1, 2), (2, 3)], run_dir=tmp_path / "run", context=4096,
                   parallel=2, chunk=64,
                   extra_env={"FLEET_KEEPALIVE_S": str(KEEPALIVE_S),
                              "FLEET_DEAD_AFTER": str(DEAD_AFTER),
                              "FLEET_HOP_TRANSPORT": "dist"})
    try:
        fleet.wait_ready()
        assert rank0_health(fleet.http_port)["hops"] == ["gloo", "gloo", "gloo"]
        client = OpenAI(base_url=fleet.url, api_key="x", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        stream = client.completions.create(model=model_id, prompt="go on", max_tokens=4000,
                                           temperature=0, extra_body={"ignore_eos": True},
                                           stream=True)
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)  # rows are flowing over the gloo hops
        killed_at = time.monotonic()
        os.kill(fleet.processes[victim].pid, signal.SIGKILL)
        for rank, proc in enumerate(fleet.processes):
            if rank == victim:
                continue
            code = proc.wait(EXIT_BOUND_S + 10)
            after_s = time.monotonic() - killed_at
            assert code != 0, f"rank {rank} exited 0 after rank {victim} died"
            assert after_s < EXIT_BOUND_S, f"rank {rank} took {after_s:.1f} s to exit"
        wait_until(lambda: all(p.poll() is not None for p in fleet.processes), within_s=5,
                   what="every rank gone")
    finally:
        fleet.stop(grace_s=5)


def two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not two_gpus(), reason="NCCL between two stages needs two CUDA devices")
def test_dist_puts_a_cuda_to_cuda_hop_on_nccl(make_model, tmp_path):
    model_dir = make_model("llama", dtype="bfloat16", num_hidden_layers=4, seed=20)
    whole = whole_runner(model_dir, backend="torch-cuda", chunk=CHUNK, depth=2)
    expected = greedy_trace(whole, model_dir, prompts(4), steps=STEPS, chunk=CHUNK)
    with pipeline(model_dir, [(0, 1), (1, 4)], tmp_path, backends=["torch-cuda"] * 2,
                  chunk=CHUNK, rank_env={1: {"CUDA_VISIBLE_DEVICES": "1"}},
                  extra_env={"FLEET_ROUND_DEADLINE_S": "60",
                             "FLEET_HOP_TRANSPORT": "dist"}) as runner:
        assert runner.ring.hops.transports == ("nccl", "nccl")
        got = greedy_trace(runner, model_dir, prompts(4), steps=STEPS, chunk=CHUNK)
    assert [plan for plan, _ in got] == [plan for plan, _ in expected]
    assert all(a == b for (_, a), (_, b) in zip(got, expected, strict=True))
