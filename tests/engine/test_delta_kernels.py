"""Who runs the gated delta rule on PyTorch: the choice for FLEET_DELTA_KERNEL on each device,
and fla-core's kernels against ours on CUDA (skipped without a GPU and fla-core)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.base import StageSpec
from engine.backends.pytorch import delta_kernels, gated_delta
from engine.backends.pytorch.delta_kernels import DeltaKernelError, choose
from engine.env import EngineEnv, EnvError


def test_cpu_stages_run_ours_unless_fla_is_demanded():
    cpu = torch.device("cpu")
    assert choose(cpu, "auto") is delta_kernels.OURS
    assert choose(cpu, "torch") is delta_kernels.OURS
    with pytest.raises(DeltaKernelError, match="CUDA only.*FLEET_DELTA_KERNEL=torch"):
        choose(cpu, "fla")
    with pytest.raises(DeltaKernelError, match="FLEET_DELTA_KERNEL='triton': expected one of"):
        choose(cpu, "triton")


def test_the_engine_environment_carries_the_choice(tmp_path):
    base = {"FLEET_MODEL": str(tmp_path)}
    assert EngineEnv.from_environ(base).delta_kernel == "auto"
    env = EngineEnv.from_environ({**base, "FLEET_DELTA_KERNEL": "torch"})
    assert StageSpec.of(env, 4).delta_kernel == "torch"
    assert env.to_environ()["FLEET_DELTA_KERNEL"] == "torch"
    assert "FLEET_DELTA_KERNEL" not in EngineEnv.from_environ(base).to_environ()
    with pytest.raises(EnvError) as caught:
        EngineEnv.from_environ({**base, "FLEET_DELTA_KERNEL": "fast"})
    assert caught.value.variable == "FLEET_DELTA_KERNEL"


needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or delta_kernels.fla_unavailable(torch.device("cuda")),
    reason="fla-core's kernels need a CUDA device and the fla extra")


def random_inputs(tokens: int, streams: int, heads: int = 6, k_dim: int = 32, v_dim: int = 48,
                  key_heads: int = 2):
    gen = torch.Generator(device="cuda").manual_seed(tokens * 31 + streams)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = gated_delta.prepare(rand(tokens, key_heads, k_dim), rand(tokens, key_heads, k_dim),
                               heads)
    v = rand(tokens, heads, v_dim)
    g = -torch.nn.functional.softplus(rand(tokens, heads))
    beta = torch.sigmoid(rand(tokens, heads))
    state = rand(streams, heads, k_dim, v_dim) * 0.1
    return q, k, v, g, beta, state


@needs_fla
def test_fla_one_step_matches_ours():
    q, k, v, g, beta, state = random_inputs(tokens=5, streams=5)
    ours = gated_delta.step(q, k, v, g, beta, state)
    theirs = delta_kernels.fla_step(q, k, v, g, beta, state)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3)


@needs_fla
@pytest.mark.parametrize("tokens", [1, 63, 64, 300])
def test_fla_chunked_matches_ours(tokens):
    q, k, v, g, beta, state = random_inputs(tokens=tokens, streams=1)
    ours = gated_delta.chunked(q, k, v, g, beta, state[0])
    theirs = delta_kernels.fla_chunked(q, k, v, g, beta, state[0])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-2)
