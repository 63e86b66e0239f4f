"""Which implementation of the gated delta rule a PyTorch stage runs: ours, or fla-core's.

fla-core (flash-linear-attention's Triton kernels) has a fused one-step recurrence for
decode rows and a chunked kernel for prompt chunks. It runs on CUDA only and is an optional
extra (`pip install 'ringfleet[fla]'`), so our own PyTorch forms (`gated_delta`) stay the
path every device has and the one CI tests. `auto` takes fla-core on a CUDA device when it
imports and ours elsewhere; `fla` insists and says why it cannot; `torch` never asks.

Both take the same prepared inputs (unit-length, scaled q and k, one per value head,
float32) and return the same float32 outputs and states, so a stage's slots and rows do not
care which one ran; the choice is part of what a placement runs, like the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backend_names import DELTA_KERNELS as CHOICES
from engine.backends.pytorch import gated_delta

AUTO, TORCH, FLA = CHOICES


class DeltaKernelError(ValueError):
    """The kernels asked for cannot run here; the message says why and what to change."""


@dataclass(frozen=True)
class DeltaKernels:
    name: str
    # (q, k, v, g, beta, state [n, heads, k_dim, v_dim]) -> (out [n, heads, v_dim], state)
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (q, k, v, g, beta, state [heads, k_dim, v_dim]) for L tokens -> (out [L, ...], state)
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]]


OURS = DeltaKernels(TORCH, gated_delta.step, gated_delta.chunked)


def fla_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n streams, one token each: fla's batch is the streams, its time axis one long."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, final = fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v.float()[:, None], g=g[:, None], beta=beta[:, None],
        scale=1.0, initial_state=state, output_final_state=True)  # q arrives scaled
    return out[:, 0], final


def fla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one stream: fla's batch of one."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q[None], k[None], v.float()[None], g=g[None], beta=beta[None], scale=1.0,
        initial_state=state[None].contiguous(), output_final_state=True)
    return out[0], final[0]


FLA_KERNELS = DeltaKernels(FLA, fla_step, fla_chunked)


def fla_unavailable(device: torch.device) -> str | None:
    """Why fla-core's kernels cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return f"fla-core's kernels run on CUDA only (this stage runs on {device.type})"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except (ImportError, AttributeError, RuntimeError) as exc:  # also a Triton misfit
        return (f"fla-core does not import ({type(exc).__name__}: {exc}); install it with "
                "pip install 'ringfleet[fla]'")
    return None


def choose(device: torch.device, choice: str) -> DeltaKernels:
    """The kernels a stage on `device` runs for FLEET_DELTA_KERNEL=`choice`."""
    if choice not in CHOICES:
        raise DeltaKernelError(f"FLEET_DELTA_KERNEL={choice!r}: expected one of "
                               f"{', '.join(CHOICES)}")
    if choice == TORCH:
        return OURS
    reason = fla_unavailable(device)
    if reason is None:
        return FLA_KERNELS
    if choice == FLA:
        raise DeltaKernelError(f"FLEET_DELTA_KERNEL=fla: {reason}; or set "
                               "FLEET_DELTA_KERNEL=torch")
    return OURS
