"""The supervisor's measurements: calibrations and link probes asked of the agents, one task
each, kept in memory and in the state (SQLite) with their age and the software they were
measured with, and handed to the pure decisions as a frozen `Measured`.

A restarted supervisor reuses what the state holds instead of measuring again; a
measurement is taken again when it is older than `max_age_s`, when its node's backend
versions (framework, its version, the engine's) are no longer those it was measured with
(`why_measure_again`, pure), or when the operator asks (`remeasure`). A calibration taken
again is forced past the agent's own cache of calibrations, which would otherwise answer
with the old figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict
from typing import Any

import structlog

from engine.hop_choice import choose
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
    timing_node,
)
from supervisor.membership import Member
from supervisor.placement import LayerTypeMs, LinkSnapshot
from supervisor.planning import candidates
from supervisor.state import State, StoredMeasurement

log = structlog.get_logger()
MEASURE_ERRORS = (AgentError, TimeoutError, ValueError, KeyError)


CALIBRATION, PROBE = "calibration", "probe"


def backend_versions(member: Member, backend: str) -> str:
    """What a calibration of `backend` on `member` was measured with: the framework and its
    version as the agent reports them (agent/facts.py's BackendFacts), and the engine's."""
    facts = member.facts or {}
    found = next((b for b in facts.get("backends", ()) if b.get("backend") == backend), {})
    return (f"{found.get('framework', '?')} {found.get('framework_version', '?')}, "
            f"engine {facts.get('engine_version', '?')}")


def link_versions(a: Member, b: Member) -> str:
    """A probe answers for the two agents' addresses: a node that moved has another link."""
    return f"{a.url} {b.url}"


def why_measure_again(measured_with: str, now_with: str, measured_at: float, now: float,
                      max_age_s: float) -> str:
    """Why a measurement kept from before must be taken again ("" when it still stands)."""
    if now_with and measured_with != now_with:
        return f"measured with {measured_with}, now {now_with}"
    if now - measured_at > max_age_s:
        return f"{now - measured_at:.0f} s old (more than {max_age_s:g} s)"
    return ""


def host_of(member: Member) -> str:
    """The machine an agent runs on, as its facts name it ("" before they come)."""
    return str(((member.facts or {}).get("host") or {}).get("hostname") or "")


def dist_path(spec: ModelSpec, backend_a: str, backend_b: str) -> str:
    """The torch.distributed path ("gloo", "nccl") a hop of `spec` between stages on these
    backends would take, either way round; "" when such a hop stays on TCP."""
    for ends in ((backend_a, backend_b), (backend_b, backend_a)):
        transport = choose(spec.hop_transport, *ends)[0]
        if transport != "tcp":
            return transport
    return ""


def _dist_said(link: LinkSnapshot, dist: str, failed: str) -> str:
    """What a probe event adds for the torch.distributed path, when one was asked for."""
    if not dist:
        return ""
    if failed:
        return f"; {dist}: not measured, its hops costed as TCP: {failed}"
    return (f"; {dist}: rtt {link.dist_rtt_ms:.3g} ms, "
            f"{link.dist_bandwidth_bytes_per_s / 1e6:.0f} MB/s")


def link_key(a: str, b: str) -> str:
    return f"{a} -> {b}"


class Measurer:
    def __init__(self, agents: AgentClient, budget_s: float, timeout_s: float,
                 on_done: Callable[[str, str], None], store: State | None = None,
                 max_age_s: float = float("inf")) -> None:
        self.agents, self.budget_s, self.timeout_s = agents, budget_s, timeout_s
        self.on_done = on_done  # (what to record or "", node): after each measurement
        self.store, self.max_age_s = store, max_age_s
        self.timings: dict[str, NodeTiming | str] = {}  # str: why there is none
        self.links: dict[tuple[str, str], LinkSnapshot | str] = {}
        self.running: dict[Any, tuple[str, ...]] = {}  # key -> the nodes it occupies
        # key (timing key or link_key) -> (versions measured with, measured_at), measured only
        self.provenance: dict[str, tuple[str, float]] = {}
        self.again: dict[str, str] = {}  # key -> why it is being measured again
        self.waiting: frozenset[str] = frozenset()  # nodes whose machine is measuring another
        self.reused = self._load()

    def _load(self) -> str:
        """Read back what the state holds; the line that says what was reused."""
        if self.store is None:
            return ""
        counts = {CALIBRATION: 0, PROBE: 0}
        oldest = time.time()
        for stored in self.store.measurements():
            try:
                if stored.kind == CALIBRATION:
                    self.timings[stored.key] = stored_timing(stored.record)
                else:
                    a, _, b = stored.key.partition(" -> ")
                    self.links[(a, b)] = LinkSnapshot(**stored.record)
            except (TypeError, ValueError, KeyError):
                continue  # a record from another version of this file: measured again
            self.provenance[stored.key] = (stored.versions, stored.measured_at)
            counts[stored.kind] = counts.get(stored.kind, 0) + 1
            oldest = min(oldest, stored.measured_at)
        if not any(counts.values()):
            return ""
        return (f"reusing {counts[CALIBRATION]} calibration(s) and {counts[PROBE]} link "
                f"probe(s) kept in the state (the oldest {time.time() - oldest:.0f} s old); "
                "each is measured again when stale or when its node's backend versions change")

    def _again(self, key: str, versions: str) -> bool:
        """Is the measurement under `key` one to take again now? (Says why, once.)"""
        if key not in self.provenance:
            return False
        measured_with, measured_at = self.provenance[key]
        why = why_measure_again(measured_with, versions, measured_at, time.time(),
                                self.max_age_s)
        if why:  # said in the event that the new measurement records
            del self.provenance[key]
            self.again[key] = why
            log.info("measuring again", key=key, why=why)
        return bool(why)

    def remeasure(self, nodes: set[str], why: str) -> list[str]:
        """Mark every calibration of `nodes` and every link probe with an end among them to
        be taken again (`start_missing` starts them); the keys marked."""
        keys = [key for key in self.timings if timing_node(key) in nodes]
        keys += [link_key(a, b) for a, b in self.links if a in nodes or b in nodes]
        for key in keys:
            self.again[key] = why
        return sorted(keys)

    def _keep(self, key: str, kind: str, versions: str, record: dict[str, Any]) -> None:
        now = time.time()
        self.provenance[key] = (versions, now)
        if self.store is not None:
            self.store.put_measurement(StoredMeasurement(key, kind, versions, now, record))

    def snapshot(self) -> Measured:
        pending = frozenset(n for nodes in self.running.values() for n in nodes) | self.waiting
        return Measured(dict(self.timings), dict(self.links), pending)

    def _busy_hosts(self, members: Mapping[str, Member]) -> set[str]:
        return {host_of(members[n]) for nodes in self.running.values() for n in nodes
                if n in members} - {""}

    def start_missing(self, desired: FleetConfig, members: Mapping[str, Member],
                      spawn: Callable[[Coroutine], None]) -> None:
        """Start the calibrations and link probes that placement lacks, one at a time per
        machine: two agents on one host (a one-machine fleet) measured at once would each
        time the other's load, several times their real cost on a few cores. Those left
        waiting count as pending, so placement waits for them too."""
        pairs: dict[tuple[str, str], str] = {}  # -> the torch.distributed path to probe too
        busy = self._busy_hosts(members)
        self.waiting = frozenset()
        for spec in desired.models:
            found = candidates(spec, desired, members)
            for i, (a, backend_a) in enumerate(found):
                for b, backend_b in found[i + 1:]:
                    pair = (a.node, b.node)
                    pairs[pair] = pairs.get(pair) or dist_path(spec, backend_a, backend_b)
            missing = [(member, backend, key) for member, backend in found
                       if (key := timing_key(spec, member.node, backend)) not in self.running
                       and (key not in self.timings or key in self.again
                            or self._again(key, backend_versions(member, backend)))]
            config = read_config(spec) if missing else ""
            if isinstance(config, str):
                continue  # placement says why it has no shape
            for member, backend, key in missing:
                if host_of(member) in busy:
                    self.waiting |= {member.node}
                    continue
                busy |= {host_of(member)} - {""}
                self.running[key] = (member.node,)
                body = calibration_body(config[0], spec, backend, self.budget_s)
                if key in self.again:  # not the agent's cached answer: a new measurement
                    body["force"] = True
                spawn(self._calibrate(key, spec, member, body,
                                      backend_versions(member, backend)))
        for (a, b), dist in sorted(pairs.items()):
            if {(a, b), (b, a)} & set(self.running):
                continue
            versions = link_versions(members[a], members[b])
            have = [pair for pair in ((a, b), (b, a)) if pair in self.links]
            # A link probed before its hop could take torch.distributed lacks that path.
            lacks_dist = dist and not any(
                isinstance(self.links[pair], str) or self.links[pair].dist_transport == dist
                for pair in have)
            if have and not any(link_key(*pair) in self.again or
                                self._again(link_key(*pair), versions) for pair in have) \
                    and not lacks_dist:
                continue
            hosts = {host_of(members[a]), host_of(members[b])} - {""}
            if hosts & busy:
                self.waiting |= {a, b}
                continue
            busy |= hosts
            self.running[(a, b)] = (a, b)
            spawn(self._probe(a, members[a].url, b, members[b].url, versions, dist))

    async def _calibrate(self, key: str, spec: ModelSpec, member: Member, body: dict,
                         versions: str) -> None:
        why = self.again.pop(key, "")  # marked once: a failure is not retried every tick
        try:
            result = await calibrate(self.agents, member.node, member.url, body, self.timeout_s)
            timing = self.timings[key] = timing_from_result(result, spec)
            self._keep(key, CALIBRATION, versions, asdict(timing))
            done = (f"calibrated {member.node} for {spec.id} on {body['backend']} ({versions}):"
                    f" {timing.decode_ms_per_layer:.3g} ms per layer for one row"
                    + (f" (measured again: {why})" if why else ""))
        except MEASURE_ERRORS as exc:
            if isinstance(self.timings.get(key), NodeTiming):
                done = (f"{member.node}: calibration failed, keeping the figures measured "
                        f"before: {exc}")
            else:
                self.timings[key] = f"calibration failed: {exc}"
                done = f"{member.node}: calibration failed, placing with nominal numbers: {exc}"
        finally:
            self.running.pop(key, None)
        self.on_done(done, member.node)

    async def _probe(self, a: str, a_url: str, b: str, b_url: str, versions: str,
                     dist: str = "") -> None:
        why = self.again.pop(link_key(a, b), "")
        why = self.again.pop(link_key(b, a), "") or why  # marked once, either way round
        try:
            link, dist_failed = await probe(self.agents, a, a_url, b, b_url, dist)
            self.links[(a, b)] = link
            self.links.pop((b, a), None)  # measured again one way: the other's is older
            self._keep(link_key(a, b), PROBE, versions, vars(link))
            done = (f"probed {a} -> {b}: rtt {link.rtt_ms:.3g} ms, "
                    f"{link.bandwidth_bytes_per_s / 1e6:.0f} MB/s"
                    + _dist_said(link, dist, dist_failed)
                    + (f" (measured again: {why})" if why else ""))
        except MEASURE_ERRORS as exc:
            self.links[(a, b)] = f"probe failed: {exc}"
            done = f"link {a} -> {b}: probe failed, placing with a nominal link: {exc}"
        finally:
            self.running.pop((a, b), None)
        self.on_done(done, a)

    def forget_failures(self) -> None:
        self.timings = {k: v for k, v in self.timings.items() if not isinstance(v, str)}
        self.links = {k: v for k, v in self.links.items() if not isinstance(v, str)}

    def to_dict(self) -> dict[str, Any]:
        now = time.time()

        def age(key: str) -> dict[str, Any]:
            if key not in self.provenance:
                return {}
            versions, measured_at = self.provenance[key]
            return {"age_s": round(now - measured_at, 1), "versions": versions}

        return {"calibrations": {k: v if isinstance(v, str) else dict(asdict(v), **age(k))
                                 for k, v in self.timings.items()},
                "links": {link_key(a, b): v if isinstance(v, str)
                          else dict(vars(v), **age(link_key(a, b)))
                          for (a, b), v in self.links.items()},
                "running": sorted(map(str, self.running)),
                "waiting": sorted(self.waiting)}


def stored_timing(record: Mapping[str, Any]) -> NodeTiming:
    """A NodeTiming from its `asdict` form, as the state keeps it (a record from before the
    head or the host work was timed: 0 for them, as the calibration would have said)."""
    return NodeTiming(float(record["decode_ms_per_layer"]),
                      float(record["decode_batch_ms_per_layer"]),
                      float(record["prefill_ms_per_layer"]),
                      tuple(LayerTypeMs(**t) for t in record.get("by_type", ())),
                      *(float(record.get(name, 0.0))
                        for name in ("head_ms", "head_batch_ms", "round_ms", "hop_ms")))
