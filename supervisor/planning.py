"""From members to placement inputs: which backend each node runs a model on, its node
snapshot (calibrated ms per layer, measured links), and the placement itself, with the
fallback a lost node needs. Pure.

A node not calibrated (yet, or whose calibration failed) is costed with a nominal ms per
layer, and a pair of nodes with no probe with a nominal LAN link; the placement's `why`
names every nominal input, so a plan never hides a guess.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace

from supervisor.fleet_config import (
    AUTO_REPLICAS,
    DEFAULT_PROMPT_CACHE_SHARE,
    FleetConfig,
    ModelSpec,
)
from supervisor.joint_placement import most_replicas, place_replicas
from supervisor.measurements import NOTHING_MEASURED, Measured, NodeTiming, timing_key
from supervisor.membership import Member
from supervisor.memory import ModelShape
from supervisor.placement import DoesNotFit, LinkSnapshot, NodeSnapshot, Placement, place

NOMINAL_DECODE_MS_PER_LAYER = 1.0
NOMINAL_PREFILL_MS_PER_LAYER = 20.0
NOMINAL_LINK = (0.5, 125e6)  # rtt ms, bytes/s: 1 GbE
NOMINAL_TIMING = NodeTiming(NOMINAL_DECODE_MS_PER_LAYER, NOMINAL_DECODE_MS_PER_LAYER,
                            NOMINAL_PREFILL_MS_PER_LAYER)


@dataclass(frozen=True)
class ModelPlan:
    """A placement, or why there is none (`error`)."""

    placement: Placement | None
    error: str = ""
    note: str = ""  # e.g. an explicit placement replaced by auto because a node is gone


def spec_digest(spec: ModelSpec) -> str:
    """Changes when anything about how the model is served changes, and only then: a digest
    of canonical JSON (sorted keys, no spacing), not of a repr that a Python upgrade or a new
    field's default could change."""
    # The replica count is left out: more or fewer replicas add or retire some, and leave
    # the serving ones where they are. An unset prompt length, the default hop transport,
    # no kernel settings, no drafter (at any draft length), an unset prompt cache count
    # or budget and whole KV windows (kv_pages 0) are left out too, so the digests of specs
    # written before they existed stay as they were.
    fields_ = {k: v for k, v in asdict(spec).items()
               if k != "replicas" and not (k == "prompt_tokens" and v is None)
               and not (k == "hop_transport" and v == "auto")
               and not (k == "kernels" and not v)
               and not (k in ("drafter", "draft_tokens") and spec.drafter == "off")
               and not (k in ("prompt_cache_slots", "prompt_cache_bytes") and v is None)
               and not (k == "kv_pages" and v == 0)}
    canonical = json.dumps(fields_, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def prompt_cache_budget(spec: ModelSpec, node_usable_bytes: int) -> int:
    """The prompt cache's byte budget of a stage of `spec` on a node with this much usable
    memory (the agent's figure, before other replicas take theirs): `prompt_cache_bytes`,
    else DEFAULT_PROMPT_CACHE_SHARE of it; 0 when `prompt_cache_slots` sets the count."""
    if spec.prompt_cache_slots is not None:
        return 0
    if spec.prompt_cache_bytes is not None:
        return spec.prompt_cache_bytes
    return int(node_usable_bytes * DEFAULT_PROMPT_CACHE_SHARE)


def node_backend(spec: ModelSpec, member: Member, config: FleetConfig) -> str | None:
    """The backend an explicit stage on the node names, when the node has it; else the
    node's `backend` label when the model allows it; else the model's first backend the
    node has. An explicit stage's `backend:` needs no label to agree with it."""
    present = member.present_backends()
    explicit = next((s.backend for s in spec.placement if s.node == member.node and s.backend),
                    None)
    if explicit and explicit in present:
        return explicit
    node = config.node(member.node)
    label = dict(node.labels).get("backend") if node else None
    if label and label in spec.backends and label in present:
        return label
    return next((b for b in spec.backends if b in present), None)


def candidates(spec: ModelSpec, config: FleetConfig,
               members: Mapping[str, Member]) -> list[tuple[Member, str]]:
    """Members that may hold a stage of `spec` now, with their backend, in fleet.yaml's order."""
    out = []
    for node in config.nodes:
        member = members.get(node.name)
        if member is None or not member.placeable or spec.checkpoint.path_for(node.name) is None:
            continue
        backend = node_backend(spec, member, config)
        if backend is not None:
            out.append((member, backend))
    return out


def node_snapshots(spec: ModelSpec, config: FleetConfig, members: Mapping[str, Member],
                   measured: Measured = NOTHING_MEASURED,
                   held: Mapping[str, int] | None = None) -> tuple[list[NodeSnapshot], list[str]]:
    """One snapshot per candidate, and a line for every nominal input used. `held`: bytes
    per node that running replicas hold, which a new placement must leave them."""
    found = candidates(spec, config, members)
    snapshots, nominal_nodes, nominal_links = [], [], []
    for member, backend in found:
        timing = measured.timings.get(timing_key(spec, member.node, backend))
        if not isinstance(timing, NodeTiming):
            nominal_nodes.append(member.node + (f" ({timing})" if timing else ""))
            timing = NOMINAL_TIMING
        links = []
        for other, _ in found:
            if other is member:
                continue
            link = measured.link(member.node, other.node)
            if link is None:
                nominal_links.append(f"{member.node} -> {other.node}")
                link = LinkSnapshot(other.node, *NOMINAL_LINK)
            links.append(link)
        usable = max(0, member.usable_memory_bytes(backend) - (held or {}).get(member.node, 0))
        snapshots.append(NodeSnapshot(member.node, usable, backend,
                                      timing.decode_ms_per_layer,
                                      timing.decode_batch_ms_per_layer,
                                      timing.prefill_ms_per_layer, tuple(links),
                                      timing.by_type,
                                      prompt_cache_budget(spec, member.usable_memory_bytes(backend)),
                                      timing.head_ms, timing.head_batch_ms,
                                      timing.round_ms, timing.hop_ms))
    notes = []
    if nominal_nodes:
        notes.append("not calibrated, nominal ms per layer: " + ", ".join(nominal_nodes))
    if nominal_links:
        notes.append("not probed, nominal links: " + ", ".join(nominal_links))
    return snapshots, notes


def plan_model(spec: ModelSpec, shape: ModelShape, config: FleetConfig,
               members: Mapping[str, Member], measured: Measured = NOTHING_MEASURED,
               held: Mapping[str, int] | None = None) -> ModelPlan:
    """Place `spec` on the members that may hold it now, beside what `held` keeps. An
    explicit placement that names a node which is not live falls back to auto over what
    remains (fail-fast re-placement must not wait for a dead node); the note says so."""
    nodes, nominal = node_snapshots(spec, config, members, measured, held)
    if not nodes:
        return ModelPlan(None, f"{spec.id}: no live node may hold a stage (needs one of "
                               f"backends {', '.join(spec.backends)} and a checkpoint path)")
    try:
        return ModelPlan(_with_note(place(spec, shape, nodes), *nominal))
    except DoesNotFit as exc:
        live = {n.name for n in nodes}
        missing = [s.node for s in spec.placement if s.node not in live]
        if not missing:
            return ModelPlan(None, str(exc))
        try:
            auto = place(replace(spec, placement=(), rank0=None), shape, nodes)
        except ValueError as auto_exc:
            return ModelPlan(None, f"{exc}; auto placement over what remains: {auto_exc}")
        note = (f"explicit placement needs {', '.join(missing)}, which cannot take stages now "
                f"(not alive, or cordoned): placed automatically on {', '.join(auto.ring)} "
                "until a rebalance")
        return ModelPlan(_with_note(auto, note, *nominal), note=note)
    except ValueError as exc:  # PlacementError: the inputs contradict each other
        return ModelPlan(None, str(exc))


@dataclass(frozen=True)
class ReplicasPlan:
    """Placements for several replicas placed together, or why not (`error`)."""

    placements: tuple[Placement, ...]
    error: str = ""
    note: str = ""  # as ModelPlan's


def plan_replicas(spec: ModelSpec, shape: ModelShape, config: FleetConfig,
                  members: Mapping[str, Member], measured: Measured, count: int,
                  held: Mapping[str, int] | None = None) -> ReplicasPlan:
    """`count` replicas of `spec` side by side (AUTO_REPLICAS: as many as fit), beside what
    `held` keeps. One replica is `plan_model`'s, with its fallback for a lost node."""
    if count == 1:
        plan = plan_model(spec, shape, config, members, measured, held)
        if plan.placement is None:
            return ReplicasPlan((), plan.error)
        return ReplicasPlan((plan.placement,), note=plan.note)
    nodes, nominal = node_snapshots(spec, config, members, measured, held)
    if not nodes:
        return ReplicasPlan((), f"{spec.id}: no live node may hold a stage")
    try:
        found = most_replicas(spec, shape, nodes) if count == AUTO_REPLICAS \
            else place_replicas(spec, shape, nodes, count)
    except ValueError as exc:  # DoesNotFit, PlacementError
        return ReplicasPlan((), str(exc))
    return ReplicasPlan(tuple(_with_note(p, *nominal) for p in found))


def held_bytes(stages: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Bytes per node from (node, bytes) pairs: what running stages hold."""
    out: dict[str, int] = {}
    for node, nbytes in stages:
        out[node] = out.get(node, 0) + nbytes
    return out


def _with_note(placement: Placement, *notes: str) -> Placement:
    return replace(placement, why=(*placement.why, *notes))


def same_layout(a: Placement, stages: tuple[tuple[str, str, tuple[int, int]], ...]) -> bool:
    """Does `a` put the same layers on the same nodes with the same backends?"""
    return tuple((s.node, s.backend, s.layer_range) for s in a.stages) == stages
