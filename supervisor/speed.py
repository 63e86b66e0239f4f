"""A replica's decode speed: what the placement's cost model predicts for the layout it runs
(`supervisor/ring_cost.py`, over the measurements placement reads) beside what its rank 0
measures (`ringfleet_decode_round_seconds`, engine/api/metrics.py), for `fleetctl status`
and `bench/placement.py`; and the time to first token it predicts for the model's prompt
length (its chunks overlapped across the stages), which `bench/placement.py` measures
from a client.

The two are the same quantity: a stream's ms per token, which rank 0 measures as a decode
round's time from launch to landing. One stream alone: one round of one row around the
ring, every stage's layers and host work of a round, every hop (wire and both ends' host
work), and rank 0's final norm, head and sampling.
`parallel` streams: rank 0 keeps one round per stage in flight, each a group of the streams
(`supervisor/decode_groups.py`), so a round's time from launch to landing is the period of
the groups: the largest group's trip, or the busiest stage's or link's work over every
group, whichever is longest. Rank 0's rounds are counted by their rows, a group's (on a ring
of as many stages as streams, 1: the same label as one stream alone). Rank 0's figure also
holds what the model leaves out (the embeddings' lookup, rank 0's lane host building the
round and handing it to its thread and back, delivering tokens), which is part of the
error the benchmark reports. `predict` is pure; `SpeedWatch` reads rank 0's metrics on a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from engine.api.metrics import DECODE_ROUND
from supervisor.fleet_config import FleetConfig, ModelSpec
from supervisor.measurements import Measured
from supervisor.membership import Member
from supervisor.memory import ModelShape
from supervisor.planning import node_snapshots
from supervisor.ring_cost import RingCosts

log = structlog.get_logger()
Layout = tuple[tuple[str, str, tuple[int, int]], ...]  # (node, backend, layer range) by rank
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Predicted:
    """The cost model's decode ms per token for one layout, and its time to first token."""

    single_ms: float  # one stream alone: a round of one row
    parallel_ms: float  # `parallel` streams at once: the period of their groups in flight
    parallel: int
    nominal: tuple[str, ...] = ()  # inputs that were guesses, not measurements
    prompt_ms: float | None = None  # a prompt of `prompt_tokens`, its chunks overlapped
    prompt_tokens: int = 0

    def ms_for_rows(self, rows: int) -> float | None:
        return {1: self.single_ms, self.parallel: self.parallel_ms}.get(rows)


def predict(spec: ModelSpec, shape: ModelShape, config: FleetConfig,
            members: Mapping[str, Member], measured: Measured,
            layout: Layout) -> Predicted | str:
    """The decode ms per token `layout` gets by the placement's cost model over what is
    measured now; a string says why there is no prediction."""
    if not layout:
        return "no stages"
    nodes, nominal = node_snapshots(spec, config, members, measured)
    by_name = {n.name: n for n in nodes}
    ring = tuple(node for node, _, _ in layout)
    absent = [n for n in ring if n not in by_name]
    if absent:
        return f"no snapshot of {', '.join(absent)} (not alive, cordoned or without facts)"
    other = [f"{node} ({backend})" for node, backend, _ in layout
             if by_name[node].backend != backend]
    if other:
        return f"calibrated on another backend than the stage runs: {', '.join(other)}"
    if [rng for _, _, rng in layout] != [(a, b) for a, b in _ranges(layout)]:
        return "the stages' ranges are not contiguous from layer 0"
    problem = RingCosts(spec, shape, [by_name[n] for n in ring], spec.prompt_length)
    counts = tuple(end - start for _, _, (start, end) in layout)
    return Predicted(problem.decode_ms(ring, counts, 1),
                     problem.decode_ms(ring, counts, spec.parallel), spec.parallel,
                     tuple(nominal), problem.prompt_ms(ring, counts), spec.prompt_length)


def _ranges(layout: Layout) -> list[tuple[int, int]]:
    out, start = [], 0
    for _, _, (a, b) in layout:
        out.append((start, start + b - a))
        start += b - a
    return out


def decode_rounds(metrics_text: str) -> dict[int, tuple[float, int]]:
    """Rank 0's decode rounds from its Prometheus text: rows -> (seconds in all, rounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != DECODE_ROUND.removesuffix("_seconds") and family.name != DECODE_ROUND:
            continue
        for sample in family.samples:
            rows = sample.labels.get("rows")
            if rows is None or not rows.isdigit():
                continue
            if sample.name.endswith("_sum"):
                sums[int(rows)] = float(sample.value)
            elif sample.name.endswith("_count"):
                counts[int(rows)] = int(sample.value)
    return {rows: (sums.get(rows, 0.0), n) for rows, n in counts.items() if n > 0}


def speed_report(predicted: Predicted | str | None,
                 rounds: Mapping[int, tuple[float, int]]) -> dict[str, Any]:
    """`status`'s view of one replica: predicted and measured ms per token, by rows."""
    out: dict[str, Any] = {
        "measured": {str(rows): {"ms_per_token": round(total / n * 1000, 3), "rounds": n}
                     for rows, (total, n) in sorted(rounds.items())}}
    if isinstance(predicted, Predicted):
        out.update(predicted_ms_per_token=round(predicted.single_ms, 3),
                   predicted_ms_per_token_parallel=round(predicted.parallel_ms, 3),
                   parallel=predicted.parallel, nominal=list(predicted.nominal))
        if predicted.prompt_ms is not None:
            out.update(predicted_ttft_ms=round(predicted.prompt_ms, 3),
                       prompt_tokens=predicted.prompt_tokens)
        for rows, seen in out["measured"].items():
            expected = predicted.ms_for_rows(int(rows))
            if expected:  # the error of the figures shown, so a reader can check it
                seen["predicted_ms_per_token"] = shown = round(expected, 3)
                seen["error_pct"] = round((shown - seen["ms_per_token"])
                                          / seen["ms_per_token"] * 100, 1)
    elif predicted:
        out["no_prediction"] = predicted
    return out


class SpeedWatch:
    """Reads each watched replica's rank 0 metrics every `interval_s`; keeps the last."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.rounds: dict[str, dict[int, tuple[float, int]]] = {}

    async def run(self, targets: Callable[[], list[tuple[str, str, str]]]) -> None:
        """`targets()`: (replica id, rank 0's URL, its API secret) of each replica to read."""
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                watched = targets()
                found = await asyncio.gather(*(self._read(session, url, secret)
                                               for _, url, secret in watched))
                kept = {rid for rid, _, _ in watched}
                self.rounds = {rid: rounds for rid, rounds in self.rounds.items() if rid in kept}
                for (rid, _, _), rounds in zip(watched, found, strict=True):
                    if rounds is not None:
                        self.rounds[rid] = rounds
                await asyncio.sleep(self.interval_s)

    @staticmethod
    async def _read(session: aiohttp.ClientSession, url: str,
                    secret: str) -> dict[int, tuple[float, int]] | None:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        try:
            async with session.get(url + "/metrics", headers=headers) as reply:
                if reply.status != 200:
                    return None
                return decode_rounds(await reply.text())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.debug("rank 0 metrics not read", url=url, error=str(exc))
            return None
