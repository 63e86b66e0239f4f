"""Which transport each hop of a ring uses: a pure decision from FLEET_HOP_TRANSPORT and
both ends' backends (read from the placement id), so both ends of a hop, and the
supervisor's cost model, decide alike without asking and without importing sockets or
torch.distributed (engine.pipeline.hop_transport carries the rows; docs/hop-transport.md)."""

from __future__ import annotations

# FLEET_HOP_TRANSPORT's spellings: auto (TCP on every hop until NCCL hops are measured on
# two GPUs; see `choose`), tcp, or dist (torch.distributed: NCCL between two torch-cuda
# stages, gloo between two torch-cpu stages, TCP for any other pair).
HOP_TRANSPORTS = ("auto", "tcp", "dist")


def placement_backends(placement: str, world: int) -> list[str] | None:
    """Every rank's backend from a placement id ("0-9@torch-cpu,9-20@mlx-cpu"), or None
    when it is not one (a standalone engine's "local")."""
    parts = placement.split(",")
    if len(parts) != world or not all("@" in part for part in parts):
        return None
    return [part.rsplit("@", 1)[1] for part in parts]


def choose(mode: str, sender: str | None, receiver: str | None) -> tuple[str, str]:
    """The transport of one hop ("tcp", "nccl" or "gloo") and why."""
    if mode == "tcp":
        return "tcp", "FLEET_HOP_TRANSPORT=tcp"
    if sender is None or receiver is None:
        return "tcp", "the placement id does not name both ends' backends"
    ends = (sender, receiver)
    if mode == "auto":
        # NCCL hops have not yet run on two GPUs (docs/hop-transport.md): until they are
        # measured, a CUDA-to-CUDA hop uses them only when asked for (dist).
        return "tcp", (f"{sender} -> {receiver}: NCCL hops are opt-in (FLEET_HOP_TRANSPORT=dist)"
                       if ends == ("torch-cuda", "torch-cuda")
                       else f"{sender} -> {receiver} is not CUDA to CUDA")
    if ends == ("torch-cuda", "torch-cuda"):
        return "nccl", "both ends are torch-cuda (FLEET_HOP_TRANSPORT=dist)"
    if all(end in ("torch-cpu",) for end in ends):
        return "gloo", "FLEET_HOP_TRANSPORT=dist between CPU stages"
    return "tcp", f"torch.distributed does not join {sender} and {receiver}"


def hop_plan(mode: str, placement: str, world: int) -> list[tuple[str, str]]:
    """The choice for every hop, hop i being rank i -> rank i + 1 (the last back to 0)."""
    backends = placement_backends(placement, world)
    return [choose(mode, backends[i] if backends else None,
                   backends[(i + 1) % world] if backends else None) for i in range(world)]
