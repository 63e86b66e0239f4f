"""What placement measures before it places: each node's ms per layer for a model (the agent's
calibration) and the links between nodes (the agents' probes).

The pure part turns an agent's calibration result into a node's timing for one model spec;
the async part asks the agents (a calibration is cached on the agent, so asking again after a
restart answers at once). Until a measurement is in, or when one fails, placement uses
nominal numbers and says which (`supervisor/planning.py`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from supervisor.agents import AgentClient, AgentError
from supervisor.fleet_config import ModelSpec
from supervisor.placement import LayerTypeMs, LinkSnapshot

POLL_S = 0.5
PROBE_BYTES = 8 << 20
PROBE_PINGS = 10
# A calibration's points of host work, each a whole figure in ms (agent.calibrate's ROUND
# and HOP): a stage's each round beyond its layers, and one end of a hop beyond the wire.
HOST_KINDS = ("round", "hop")


@dataclass(frozen=True)
class NodeTiming:
    """A node's calibrated ms per layer for one model spec on one backend."""

    decode_ms_per_layer: float  # one row
    decode_batch_ms_per_layer: float  # `parallel` rows
    prefill_ms_per_layer: float  # one chunk of `chunk` rows
    # Each layer type's, when the model has more than one (the three above: the slowest's).
    by_type: tuple[LayerTypeMs, ...] = ()
    # Rank 0's final norm, head and sampling, ms a decode round of 1 / `parallel` rows (0: a
    # calibration from before the head was timed).
    head_ms: float = 0.0
    head_batch_ms: float = 0.0
    # Host work beyond the layers, ms: a stage's each round, and one end of a hop's beyond
    # the wire (ring_cost.NodeSnapshot says what; 0: a calibration from before they were timed).
    round_ms: float = 0.0
    hop_ms: float = 0.0


@dataclass(frozen=True)
class Measured:
    """Everything measured so far, for a snapshot. Keys: `timing_key(...)`; (node, peer)."""

    timings: Mapping[str, NodeTiming | str] = field(default_factory=dict)  # str: why none
    links: Mapping[tuple[str, str], LinkSnapshot | str] = field(default_factory=dict)
    pending: frozenset[str] = frozenset()  # nodes with a calibration or probe under way

    def link(self, a: str, b: str) -> LinkSnapshot | None:
        """The link from a to b; one measured only the other way is used both ways."""
        found = self.links.get((a, b))
        if isinstance(found, LinkSnapshot):
            return found
        back = self.links.get((b, a))
        if isinstance(back, LinkSnapshot):
            return replace(back, peer=b)
        return None


NOTHING_MEASURED = Measured()


# A kernel knob's name in a calibration request (agent.calibrate.CalibrationRequest), where
# it is not EngineEnv's.
CALIBRATION_FIELD = {"quant": "quant_mode"}


def timing_node(key: str) -> str:
    """The node a `timing_key` is for."""
    return key.split("|")[1]


def timing_key(spec: ModelSpec, node: str, backend: str) -> str:
    """A calibration answers for a shape, a backend, the execution shape measured (the prompt
    whose mean chunk it times included) and the kernels timed: a model whose `kernels:` or
    `prompt_tokens` change is calibrated again."""
    return (f"{spec.id}|{node}|{backend}|{spec.context}|{spec.parallel}|{spec.chunk}"
            f"|prompt={spec.prompt_length}"
            + "".join(f"|{attr}={value}" for attr, value in spec.kernels))


def mean_chunk_end(prompt_tokens: int, chunk: int) -> int:
    """Where the prompt's mean chunk ends: a chunk's attention grows with the keys before it,
    the rest of its time does not, so its time is linear in its start, and the mean of the
    chunks [0, c), [c, 2c), ... of `ceil(prompt_tokens / c)` chunks (a partial last one costed
    whole, as placement costs it) is the time of the chunk that starts at their mean start,
    (chunks - 1) x c / 2, and ends `chunk` rows later."""
    chunks = max(1, math.ceil(prompt_tokens / chunk))
    return (chunks - 1) * chunk // 2 + chunk


def calibration_body(config_json: dict[str, Any], spec: ModelSpec, backend: str,
                     budget_s: float) -> dict[str, Any]:
    """The agent's calibration request for `spec` on `backend`: its execution shape, the
    prompt chunk placement costs (the mean of a `prompt_tokens` prompt's, see
    `mean_chunk_end`) and the kernels its engines run (`kernels:`), so that placement
    predicts with their times. The engine's defaults go unsent: they are the request's
    defaults too."""
    return {"config": config_json, "backend": backend, "contexts": [spec.context],
            "batch_rows": spec.parallel, "chunk_rows": spec.chunk,
            "prefill_end": mean_chunk_end(spec.prompt_length, spec.chunk), "budget_s": budget_s,
            **{CALIBRATION_FIELD.get(attr, attr): value for attr, value in spec.kernels}}


def timing_from_result(result: Mapping[str, Any], spec: ModelSpec) -> NodeTiming:
    """The decode times at the spec's context (1 row and `parallel` rows) and the prefill
    chunk's, per layer type; ValueError when the result lacks a point."""
    timings = result.get("timings") or []
    head = {t["rows"]: t["ms_per_layer"] for t in timings if t["kind"] == "head"}
    host = {t["kind"]: t["ms_per_layer"] for t in timings if t["kind"] in HOST_KINDS}
    layers = [t for t in timings if t["kind"] not in ("head", *HOST_KINDS)]
    # A calibration from before layer types were timed apart has one, unnamed: a dense one.
    types = list(dict.fromkeys(t.get("layer_type", "full_attention") for t in layers))
    by_type = tuple(_type_timing(layers, layer_type, spec) for layer_type in types)
    if not by_type:
        raise ValueError("the calibration has no timings")
    slowest = max(by_type, key=lambda t: t.decode_batch_ms_per_layer)
    return NodeTiming(slowest.decode_ms_per_layer, slowest.decode_batch_ms_per_layer,
                      slowest.prefill_ms_per_layer, by_type if len(by_type) > 1 else (),
                      head.get(1, 0.0), head.get(spec.parallel, 0.0),
                      host.get("round", 0.0), host.get("hop", 0.0))


def _type_timing(timings: list[dict[str, Any]], layer_type: str,
                 spec: ModelSpec) -> LayerTypeMs:
    mine = [t for t in timings if t.get("layer_type", "full_attention") == layer_type]

    def decode(rows: int) -> float:
        points = [t for t in mine if t["kind"] == "decode" and t["rows"] == rows]
        if not points:
            raise ValueError(f"the calibration has no {layer_type} decode point at "
                             f"{rows} row(s)")
        return min(points, key=lambda t: abs(t["context"] - spec.context))["ms_per_layer"]

    prefill = [t["ms_per_layer"] for t in mine if t["kind"] == "prefill"]
    if not prefill:
        raise ValueError(f"the calibration has no {layer_type} prompt-chunk point")
    one = decode(1)
    batch = decode(spec.parallel) if spec.parallel > 1 else one
    return LayerTypeMs(layer_type, one, batch, prefill[0])


async def calibrate(agents: AgentClient, node: str, url: str, body: dict[str, Any],
                    timeout_s: float) -> dict[str, Any]:
    """Ask the agent for a calibration and wait for it; AgentError / TimeoutError if none."""
    reply = await agents.call(node, "POST", f"{url}/v1/calibrations", body)
    deadline = time.monotonic() + timeout_s
    while reply.get("state") == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"calibration on {node} not done after {timeout_s:g} s")
        await asyncio.sleep(POLL_S)
        reply = await agents.call(node, "GET", f"{url}/v1/calibrations/jobs/{reply['job_id']}")
    if reply.get("state") != "done" or not reply.get("result"):
        raise AgentError(node, f"calibration failed: {reply.get('error') or reply}")
    return reply["result"]


async def probe(agents: AgentClient, node: str, url: str, peer: str, peer_url: str,
                dist: str = "") -> tuple[LinkSnapshot, str]:
    """The link node -> peer; with `dist` ("gloo" or "nccl"), its torch.distributed path
    too. The second item says why that path has no numbers ("" when it has)."""
    result = await agents.call(node, "POST", f"{url}/v1/probe", {
        "peer": peer_url, "bytes": PROBE_BYTES, "pings": PROBE_PINGS}
        | ({"dist": dist} if dist else {}))
    return link_from_probe(peer, result, dist)


def link_from_probe(peer: str, result: Mapping[str, Any], dist: str) -> tuple[LinkSnapshot, str]:
    """A probe's answer as a link. A torch.distributed path asked for but not measured keeps
    its name with no numbers, so it is not asked for again until the link is probed again,
    and the hop is costed on the TCP link's numbers (LinkSnapshot.path)."""
    link = LinkSnapshot(peer, float(result["rtt_ms"]), float(result["bandwidth_bytes_per_s"]))
    if not dist:
        return link, ""
    measured = result.get("dist") or {}
    if measured.get("transport") != dist or "error" in measured:
        why = measured.get("error") or f"the agent did not measure {dist}"
        return replace(link, dist_transport=dist), why
    return replace(link, dist_transport=dist, dist_rtt_ms=float(measured["rtt_ms"]),
                   dist_bandwidth_bytes_per_s=float(measured["bandwidth_bytes_per_s"])), ""
