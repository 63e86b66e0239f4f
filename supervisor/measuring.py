"""The supervisor's measurements: calibrations and link probes asked of the agents, one task
each, kept in memory (the agents cache calibrations, so a restarted supervisor gets them
back at once), and handed to the pure decisions as a frozen `Measured`."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict
from typing import Any

import structlog

from supervisor.agents import AgentClient, AgentError
from supervisor.checkpoints import read_config
from supervisor.fleet_config import FleetConfig, ModelSpec
from supervisor.measurements import (
    Measured,
    NodeTiming,
    calibrate,
    calibration_body,
    probe,
    timing_from_result,
    timing_key,
)
from supervisor.membership import Member
from supervisor.placement import LinkSnapshot
from supervisor.planning import candidates

log = structlog.get_logger()
MEASURE_ERRORS = (AgentError, TimeoutError, ValueError, KeyError)


class Measurer:
    def __init__(self, agents: AgentClient, budget_s: float, timeout_s: float,
                 on_done: Callable[[str, str], None]) -> None:
        self.agents, self.budget_s, self.timeout_s = agents, budget_s, timeout_s
        self.on_done = on_done  # (failure message or "", node): after each measurement
        self.timings: dict[str, NodeTiming | str] = {}  # str: why there is none
        self.links: dict[tuple[str, str], LinkSnapshot | str] = {}
        self.running: dict[Any, tuple[str, ...]] = {}  # key -> the nodes it occupies

    def snapshot(self) -> Measured:
        pending = frozenset(n for nodes in self.running.values() for n in nodes)
        return Measured(dict(self.timings), dict(self.links), pending)

    def start_missing(self, desired: FleetConfig, members: Mapping[str, Member],
                      spawn: Callable[[Coroutine], None]) -> None:
        """Start the calibrations and link probes that placement lacks."""
        pairs: set[tuple[str, str]] = set()
        for spec in desired.models:
            found = candidates(spec, desired, members)
            names = [m.node for m, _ in found]
            pairs |= {(a, b) for i, a in enumerate(names) for b in names[i + 1:]}
            missing = [(member, backend, key) for member, backend in found
                       if (key := timing_key(spec, member.node, backend)) not in self.timings
                       and key not in self.running]
            config = read_config(spec) if missing else ""
            if isinstance(config, str):
                continue  # placement says why it has no shape
            for member, backend, key in missing:
                self.running[key] = (member.node,)
                body = calibration_body(config[0], spec, backend, self.budget_s)
                spawn(self._calibrate(key, spec, member, body))
        for a, b in sorted(pairs):
            if not ({(a, b), (b, a)} & (set(self.links) | set(self.running))):
                self.running[(a, b)] = (a, b)
                spawn(self._probe(a, members[a].url, b, members[b].url))

    async def _calibrate(self, key: str, spec: ModelSpec, member: Member, body: dict) -> None:
        failure = ""
        try:
            result = await calibrate(self.agents, member.node, member.url, body, self.timeout_s)
            self.timings[key] = timing_from_result(result, spec)
            log.info("calibrated", node=member.node, key=key, ms_per_layer=asdict(self.timings[key]))
        except MEASURE_ERRORS as exc:
            self.timings[key] = f"calibration failed: {exc}"
            failure = f"{member.node}: calibration failed, placing with nominal numbers: {exc}"
        finally:
            self.running.pop(key, None)
        self.on_done(failure, member.node)

    async def _probe(self, a: str, a_url: str, b: str, b_url: str) -> None:
        failure = ""
        try:
            self.links[(a, b)] = await probe(self.agents, a, a_url, b, b_url)
            log.info("probed", node=a, peer=b, link=vars(self.links[(a, b)]))
        except MEASURE_ERRORS as exc:
            self.links[(a, b)] = f"probe failed: {exc}"
            failure = f"link {a} -> {b}: probe failed, placing with a nominal link: {exc}"
        finally:
            self.running.pop((a, b), None)
        self.on_done(failure, a)

    def forget_failures(self) -> None:
        self.timings = {k: v for k, v in self.timings.items() if not isinstance(v, str)}
        self.links = {k: v for k, v in self.links.items() if not isinstance(v, str)}

    def to_dict(self) -> dict[str, Any]:
        return {"calibrations": {k: v if isinstance(v, str) else asdict(v)
                                 for k, v in self.timings.items()},
                "links": {f"{a} -> {b}": v if isinstance(v, str) else vars(v)
                          for (a, b), v in self.links.items()},
                "running": sorted(map(str, self.running))}
