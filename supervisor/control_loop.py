"""The supervisor's loop over its shared state: tick → decide (pure) → apply, and no more.

Members and replicas are kept in memory and on disk; each step calls the pure decisions
(membership.tick, lifecycle.decide, orphans.orphaned_engines) on a snapshot and applies the
actions they return (spawn and drain engines through the agents, record every change); the
health loop probes rank 0. What agents report (`supervisor.intake`), what fleetctl asks
(`supervisor.operator_commands`) and what is shown (`supervisor.views`) are functions over
the `Supervisor` beside it, kept out so that this file reads as the loop; they call `step`
when they change what it decides over.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import structlog

from agent.spawn import SpawnRequest
from engine.env import EngineEnv
from engine.link.sockets import port_in_use
from supervisor import lifecycle as lc
from supervisor.agents import AgentClient, AgentError
from supervisor.checkpoints import read_shape
from supervisor.fleet_config import FleetConfig, parse_fleet_config
from supervisor.measuring import Measurer
from supervisor.membership import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    Member,
    on_unreachable,
    tick,
)
from supervisor.memory import ModelShape
from supervisor.orphans import DrainOrphan, orphaned_engines
from supervisor.relays import Relays
from supervisor.replica_secrets import API_SECRET, LINK_KEY, ReplicaSecrets
from supervisor.settings import SupervisorSettings
from supervisor.speed import SpeedWatch
from supervisor.state import State

log = structlog.get_logger()

HEALTH_TIMEOUT_S = 2.0
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # where a port can be checked from here


class HealthAnswer(NamedTuple):
    """One probe of rank 0's /health: whether it answered at all (any status: a 503
    "draining" is an answer), whether it takes requests (200), and its body."""

    answered: bool
    healthy: bool
    body: dict[str, Any] | None


class Supervisor:
    """The in-memory state the loop, intake, operator commands and views share, and the
    loop over it; one per process."""

    def __init__(self, settings: SupervisorSettings, agents: AgentClient) -> None:
        self.settings = settings
        self.state = State(settings.db_path)
        self.agents = agents
        now = time.time()
        # A restarted supervisor gives every member a fresh grace period: their agents have
        # kept beating to nobody, and their engines kept serving.
        self.members = {n: replace(m, last_heartbeat_at=now) if m.state in (ALIVE, SUSPECT)
                        else m for n, m in self.state.members().items()}
        self.replicas = self.state.replicas()
        self.desired: FleetConfig | None = None
        stored = self.state.desired()
        if stored is not None:
            self.desired = parse_fleet_config(stored.text, stored.source)
        self.shapes: dict[str, ModelShape | str] = {}
        self.healthy: set[str] = set()
        self.rank0_health: dict[str, dict[str, Any]] = {}  # replica -> its rank 0's /health
        self.rank0_heard: dict[str, lc.Rank0Heard] = {}  # replica -> what its probes heard
        self.orphans_asked: set[DrainOrphan] = set()  # drains asked, until no longer reported
        self.tasks: set[asyncio.Task] = set()
        self.busy_ports: set[tuple[str, int]] = set()  # found taken when a start checked
        self.forgetting: set[lc.ForgetEngine] = set()
        self.relays = Relays()  # the front door's open relays, ended when a replica fails
        self.route_turn = 0  # round-robin among replicas with as many free slots (views.route)
        self.secrets = ReplicaSecrets(settings.keys_dir)
        self.secrets.keep_only(r.id for r in self.replicas.values()
                               if r.state in lc.RUNNING_STATES)
        self.measurer = Measurer(agents, settings.calibration_budget_s,
                                 settings.measure_timeout_s, self._measured_one,
                                 store=self.state, max_age_s=settings.measurement_max_age_s)
        if self.measurer.reused:
            self.event("measure", self.measurer.reused)
        self.speeds = SpeedWatch()
        adopted = [r.id for r in self.replicas.values() if r.state in lc.RUNNING_STATES]
        if adopted:
            self.event("adopt", f"re-adopting {', '.join(adopted)} after a restart")

    def event(self, kind: str, message: str, *, node: str = "", replica: str = "") -> None:
        self.state.log_event(kind, message, node=node, replica=replica)
        log.info(message, kind=kind, node=node or None, replica=replica or None)

    def put_member(self, member: Member) -> None:
        """Keep a member's new state in memory and on disk."""
        self.members[member.node] = member
        self.state.put_member(member)

    # --- the loop -------------------------------------------------------------------------
    def snapshot(self) -> lc.Snapshot:
        return lc.Snapshot(now=time.time(), desired=self.desired, members=dict(self.members),
                           replicas=dict(self.replicas), shapes=dict(self.shapes),
                           healthy=frozenset(self.healthy),
                           rebalance_epoch=self.state.rebalance_epoch(),
                           policy=self.settings.policy, measured=self.measurer.snapshot(),
                           engine_ports=(self.settings.engine_port_first,
                                         self.settings.engine_port_last),
                           busy_ports=frozenset(self.busy_ports),
                           rank0_heard=dict(self.rank0_heard))

    def _measured_one(self, failure: str, node: str) -> None:
        if failure:
            self.event("measure", failure, node=node)
        self.step()

    def step(self) -> None:
        now = time.time()
        for member in tick(self.members, now, self.settings.membership).values():
            self.event("member", f"{member.node} is {member.state}: {member.reason}",
                       node=member.node)
            self.put_member(member)
        for spec in self.desired.models if self.desired else ():
            if not isinstance(self.shapes.get(spec.id), ModelShape):
                self.shapes[spec.id] = read_shape(spec)
        if self.settings.calibration_budget_s > 0 and self.desired is not None:
            self.measurer.start_missing(self.desired, self.members, self._spawn_task)
        for action in lc.decide(self.snapshot()):
            self.apply(action)
        self.drain_orphans()

    def drain_orphans(self) -> None:
        """Ask agents to drain the engines no live replica owns (supervisor/orphans.py),
        each once while it is still reported running."""
        orphans = set(orphaned_engines(self.members, self.replicas, time.time()))
        for orphan in sorted(orphans - self.orphans_asked, key=lambda o: (o.node, o.engine_id)):
            self.event("orphan", f"{orphan.reason}: asking {orphan.node} to drain it",
                       node=orphan.node)
            self._spawn_task(self._drain_orphan(orphan))
        self.orphans_asked = orphans  # those no longer reported are forgotten

    async def _drain_orphan(self, orphan: DrainOrphan) -> None:
        member = self.members.get(orphan.node)
        if member is None:
            return
        try:  # nothing routes to an orphan: no in-flight requests of ours to wait for
            await self.agents.drain(orphan.node, member.url, orphan.engine_id, 0.0,
                                    orphan.reason)
        except AgentError as exc:
            log.warning("orphan drain not delivered", node=orphan.node, error=str(exc))
            self.orphans_asked.discard(orphan)  # asked again at the next step

    def apply(self, action: lc.Action) -> None:
        if isinstance(action, lc.Record):
            self.record(action.replica)
        elif isinstance(action, lc.StartStages):
            self.start_stages(action)
        elif isinstance(action, lc.StopEngines):
            self._spawn_task(self.stop_engines(action))
        elif isinstance(action, lc.ForgetEngine) and action not in self.forgetting:
            self.forgetting.add(action)
            self._spawn_task(self.forget_engine(action))

    def record(self, replica: lc.Replica) -> None:
        old = self.replicas.get(replica.id)
        self.replicas[replica.id] = replica
        self.state.put_replica(replica)
        if old is None or old.state != replica.state:
            why = f": {replica.reason}" if replica.reason else ""
            self.event("replica", f"{replica.id} is {replica.state}{why}", replica=replica.id)
            if replica.state == lc.FAILED:  # its streams end now, not when the process dies
                self.relays.replica_failed(replica.id, replica.reason)
            if replica.state in (lc.STOPPED, lc.FAILED):  # its id is never started again
                self.secrets.forget(replica.id)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:
                log.exception("supervisor step failed")
            await asyncio.sleep(self.settings.tick_s)

    async def health_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        # The longest a round leaves between two probes of one replica: the sleep, and the
        # slowest probe of the round before (the supervisor's silence count, after_probe).
        max_gap_s = self.settings.health_interval_s + HEALTH_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                watched = [r for r in self.replicas.values()  # draining: for its numbers
                           if r.state in (lc.WARMING, lc.SERVING, lc.DRAINING)]
                probes = await asyncio.gather(*(self._timed_health(session, r)
                                                for r in watched))
                self.healthy = {r.id for r, (_, _, a, _) in zip(watched, probes) if a.healthy}
                self.rank0_health = {r.id: a.body for r, (_, _, a, _) in zip(watched, probes)
                                     if a.body is not None}
                self.rank0_heard = {
                    r.id: lc.after_probe(self.rank0_heard.get(r.id), sent_at, ended_at,
                                         answer.answered, beat_at, HEALTH_TIMEOUT_S, max_gap_s)
                    for r, (sent_at, beat_at, answer, ended_at) in zip(watched, probes)}
                await asyncio.sleep(self.settings.health_interval_s)

    async def _timed_health(self, session: aiohttp.ClientSession, replica: lc.Replica
                            ) -> tuple[float, float, HealthAnswer, float]:
        """(when the probe went out, when rank 0's node last beat then, its answer, when it
        was over), on the snapshot's clock."""
        member = self.members.get(replica.stages[0].node)
        beat_at = member.last_heartbeat_at if member is not None else 0.0
        sent_at = time.time()
        answer = await self._health(session, replica)
        return sent_at, beat_at, answer, time.time()

    @staticmethod
    async def _health(session: aiohttp.ClientSession, replica: lc.Replica) -> HealthAnswer:
        """Rank 0's /health. A draining rank 0 answers 503 with status "draining": not
        healthy (it takes no new request), and not silent."""
        try:
            async with session.get(replica.url + "/health") as reply:
                try:
                    body = await reply.json(content_type=None)
                except ValueError:  # an answer all the same: rank 0 is not frozen
                    body = None
                return HealthAnswer(True, reply.status == 200,
                                    body if isinstance(body, dict) else None)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return HealthAnswer(False, False, None)

    # --- starting and stopping stages -----------------------------------------------------
    def start_stages(self, action: lc.StartStages) -> None:
        """Spawn the stages on the ports the lifecycle chose, unless one of them is taken
        here by another process: then it is left out of the next decision (the replica is
        still placing) and the next step chooses again."""
        replica = action.replica
        busy = {(s.host, p) for s in replica.stages if s.host in LOCAL_HOSTS
                for p in (*s.ports(), replica.master_port if s.rank == 0 else 0)
                if p and port_in_use(s.host, p)}
        if busy:
            self.busy_ports |= busy
            log.info("engine ports taken here; choosing again", replica=replica.id,
                     ports=sorted(p for _, p in busy))
            return
        self.busy_ports.clear()
        self.record(replica)
        self._spawn_task(self._spawn_all(replica))

    def apply_all(self, actions: list[lc.Action]) -> None:
        for action in actions:
            self.apply(action)

    def spawn_body(self, replica: lc.Replica, stage: lc.StageRecord) -> dict[str, Any]:
        """The agent's spawn request for one stage of `replica` (agent.spawn.SpawnRequest):
        the stage's environment contract as `EngineEnv.to_environ` writes it, which the
        agent reads back with the engine's own parser, and beside it what only the agent
        needs (the engine's id, its replica, the secrets it writes to files of its own)."""
        assert self.desired is not None
        spec = self.desired.model(replica.model_id)
        assert spec is not None
        model_dir = spec.checkpoint.path_for(stage.node)
        assert model_dir is not None  # placement uses only nodes that have the checkpoint
        rank0 = replica.stages[0]
        layout = tuple(s.layer_range for s in replica.stages)
        env = EngineEnv(
            model_dir=Path(model_dir), backend=stage.backend, rank=stage.rank,
            world_size=len(replica.stages), layer_range=stage.layer_range, layout=layout,
            listen=(stage.host, stage.listen_port),
            http=(rank0.host, rank0.http_port) if stage.rank == 0 else None,
            master=(rank0.host, replica.master_port), placement=replica.placement_id,
            model_id=spec.id, context=spec.context, parallel=spec.parallel,
            # The kept slots placement chose (set, or bought by the stages' budgets) and the
            # pool of KV pages it charged: every stage must hold the same slot table and the
            # same pool, since rank 0 admits requests by its own pool for all of them.
            prompt_cache_slots=replica.prompt_cache_slots, kv_pages=replica.kv_pages,
            chunk=spec.chunk,
            drain_s=self.settings.policy.drain_s, hop_transport=spec.hop_transport,
            drafter=spec.drafter, draft_tokens=spec.draft_tokens, **dict(spec.kernels))
        # The secrets travel inside the mutual-TLS request: agents need not share a disk.
        # The agent's own drain_s applies only to a contract that sets none; this one's is
        # the policy's, written even at the default so that no agent's setting replaces it.
        return SpawnRequest(
            engine_id=stage.engine_id, replica=replica.id,
            env=env.to_environ() | env.written("drain_s"),
            link_key=self.secrets.make(replica.id, LINK_KEY),
            api_secret=self.secrets.make(replica.id, API_SECRET) if stage.rank == 0 else "",
        ).to_dict()

    async def _spawn_all(self, replica: lc.Replica) -> None:
        async def one(stage: lc.StageRecord) -> None:
            member = self.members[stage.node]
            await self.agents.spawn(stage.node, member.url, self.spawn_body(replica, stage))

        results = await asyncio.gather(*(one(s) for s in replica.stages), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for exc in errors:
            if isinstance(exc, AgentError) and exc.status == 0 and exc.node in self.members:
                self.put_member(on_unreachable(self.members[exc.node], exc.message))
        if errors:
            current = self.replicas.get(replica.id, replica)
            if current.state in (lc.STARTING, lc.WARMING):
                self.apply_all(lc.fail_actions(current, f"spawn refused: {errors[0]}",
                                               time.time(), self.settings.policy))

    async def stop_engines(self, action: lc.StopEngines) -> None:
        """A drain is asked of one stage, rank 0 first: SIGTERM to any stage drains the whole
        replica, and a stage signalled after the replica's drain began takes it as a second
        signal (stop at once), which would cut the in-flight requests the drain protects.
        A failed replica's stages are all stopped (drain_s 0): nothing is left to protect."""
        async def one(stage: lc.StageRecord) -> bool:
            member = self.members.get(stage.node)
            if member is None or member.state in (DEAD, LEFT):
                return False
            try:
                await self.agents.drain(stage.node, member.url, stage.engine_id,
                                        action.drain_s, action.reason)
                return True
            except AgentError as exc:
                if exc.status not in (404, 409):
                    log.warning("drain not delivered", node=stage.node, error=str(exc),
                                replica=action.replica.id)
                return False

        if action.drain_s <= 0:
            await asyncio.gather(*(one(s) for s in action.replica.stages))
            return
        for stage in action.replica.stages:
            if await one(stage):
                return

    async def forget_engine(self, action: lc.ForgetEngine) -> None:
        member = self.members.get(action.node)
        try:
            if member is not None:
                await self.agents.forget(action.node, member.url, action.engine_id)
                engines = {k: v for k, v in member.engines.items() if k != action.engine_id}
                self.put_member(replace(self.members[action.node], engines=engines))
        except AgentError as exc:
            log.info("engine record not forgotten", node=action.node, error=str(exc))
        finally:
            self.forgetting.discard(action)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.state.close()

