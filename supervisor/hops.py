"""How each hop of a replica's ring carries its rows, as the supervisor shows it: predicted
for a plan (the engine's own pure choice, `engine.hop_choice.choose`, from the
model's `hop_transport` and the two stages' backends), and as rank 0's /health reports it
for a running replica (a hop whose group would not form has fallen back to TCP there).

Hop i is rank i's rows to rank i + 1; the last hop goes back to rank 0. A one-stage
replica has no hop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.hop_choice import choose


def predicted_hops(mode: str, backends: Sequence[str]) -> list[dict[str, str]]:
    """Every hop's transport ("tcp", "nccl" or "gloo") and why, for stages on `backends`
    (rank 0 first) under FLEET_HOP_TRANSPORT=`mode`."""
    world = len(backends)
    if world < 2:
        return []
    return [dict(zip(("transport", "why"), choose(mode, backends[i], backends[(i + 1) % world]),
                     strict=True)) for i in range(world)]


def planned_hops(placement: dict[str, Any], mode: str) -> dict[str, Any]:
    """A placement as `fleetctl plan` receives it (`Placement.to_dict`), with its hops."""
    return dict(placement, hops=predicted_hops(mode, [s["backend"] for s in placement["stages"]]))


def reported_hops(health: dict[str, Any] | None) -> list[str] | None:
    """The hops rank 0's /health names, or None when it named none (not answering yet, or
    one stage alone)."""
    hops = (health or {}).get("hops")
    if not isinstance(hops, list) or not hops or not all(isinstance(h, str) for h in hops):
        return None
    return hops


def hops_text(transports: Sequence[str]) -> str:
    """`hops tcp,nccl`: what `fleetctl status` and `plan` print for a ring."""
    return "hops " + ",".join(transports)


def planned_hops_text(hops: Sequence[dict[str, str]]) -> str:
    """`hops gloo,gloo (why)`: a plan's predicted hops, each reason said once."""
    return (hops_text([h["transport"] for h in hops]) + " ("
            + "; ".join(dict.fromkeys(h["why"] for h in hops)) + ")")
