"""Engine lifecycle on one node: check and spawn `fleet-engine` stages, watch them become
ready, drain and reap them, and find the ones an earlier agent started (adopt or end them).

The decisions — is this spawn request sound (`agent.spawn`), what should happen to each
engine now, what to do with the run records found at start — are pure functions over frozen
snapshots; the `EngineManager` is the thin loop that applies them through the one child
wrapper (`agent.child`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import structlog

from agent.child import (
    ChildExit,
    ChildProcess,
    GracePeriods,
    RotatingLog,
    SpawnError,
    resident_bytes,
)
from agent.config import AgentConfig
from agent.pki import private_dir, write_private
from agent.spawn import (
    ENGINE_ID,
    EngineSpec,
    LogFile,
    SpawnRefused,
    SpawnRequest,
    check_spawn,
    child_environment,
    engine_logs_to_prune,
    read_checkpoint_info,
)
from engine.link.sockets import port_in_use

log = structlog.get_logger()

READY_EVENT = "ready"  # the engine's log line once it serves (rank 0) or joined its ring
LOADED_EVENT = "loaded"  # its line once its range is loaded, with `weights_bytes`


class EnginePhase(str, Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    EXITED = "exited"


# --- snapshots and decisions -------------------------------------------------------------

@dataclass(frozen=True)
class EngineView:
    """One engine as the agent sees it at one moment."""

    spec: EngineSpec
    state: EnginePhase
    pid: int
    started_at: float
    log_path: str
    adopted: bool = False
    ready_at: float | None = None
    drain_started_at: float | None = None
    exit: ChildExit | None = None
    weights_bytes: int | None = None  # what its loaded line said its weights take
    resident_bytes: int | None = None  # its resident set when this view was made

    def to_dict(self) -> dict[str, Any]:
        out = {"engine_id": self.spec.engine_id, "replica": self.spec.replica,
               "rank": self.spec.rank, "state": self.state.value, "pid": self.pid,
               "started_at": self.started_at, "ready_at": self.ready_at,
               "drain_started_at": self.drain_started_at, "adopted": self.adopted,
               "log_path": self.log_path, "spec": self.spec.to_dict(),
               "exit": self.exit.to_dict() if self.exit else None,
               "weights_bytes": self.weights_bytes, "resident_bytes": self.resident_bytes}
        return out


@dataclass(frozen=True)
class DrainEngine:
    engine_id: str
    reason: str
    drain_s: float


def decide(views: tuple[EngineView, ...], now: float, ready_timeout_s: float) -> list[DrainEngine]:
    """What the loop should do now: stop stages that never became ready."""
    actions = []
    for view in views:
        if view.state == EnginePhase.STARTING and now - view.started_at > ready_timeout_s:
            actions.append(DrainEngine(view.spec.engine_id,
                                       f"not ready {ready_timeout_s:g} s after start", 0.0))
    return actions


@dataclass(frozen=True)
class RunRecord:
    """`run/<engine_id>.json`: what a later agent needs to find an engine again."""

    spec: EngineSpec
    pid: int
    create_time: float
    started_at: float
    log_path: str
    agent_pid: int
    ready_at: float | None = None
    drain_started_at: float | None = None
    weights_bytes: int | None = None  # kept, so an agent that adopts the engine still knows

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunRecord:
        """A record read back; a ValueError (RecordError) names a spec it cannot read, such
        as an older agent's spec of fields."""
        raw = dict(raw)
        raw["spec"] = EngineSpec.from_dict(raw["spec"])
        return cls(**raw)


@dataclass(frozen=True)
class Adopt:
    record: RunRecord


@dataclass(frozen=True)
class AdoptAndDrain:
    record: RunRecord


@dataclass(frozen=True)
class Discard:
    record: RunRecord
    reason: str


def plan_adoption(records: tuple[RunRecord, ...], alive: Mapping[str, bool],
                  adopt: bool) -> list[Adopt | AdoptAndDrain | Discard]:
    """For each engine an earlier agent left: adopt it, end it, or forget a dead one. Pure."""
    plan: list[Adopt | AdoptAndDrain | Discard] = []
    for record in records:
        if not alive.get(record.spec.engine_id, False):
            plan.append(Discard(record, "exited while the agent was not running"))
        elif adopt:
            plan.append(Adopt(record))
        else:
            plan.append(AdoptAndDrain(record))
    return plan


# --- the thin loop -----------------------------------------------------------------------

@dataclass(frozen=True)
class EngineEvent:
    """A state change, numbered so a reader can ask for what came after."""

    seq: int
    engine_id: str
    state: EnginePhase
    at: float
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "engine_id": self.engine_id, "state": self.state.value,
                "at": self.at, "detail": self.detail}


class _Engine:
    """The loop's mutable holder for one engine (views are made from it)."""

    def __init__(self, record: RunRecord, child: ChildProcess, adopted: bool) -> None:
        self.record = record
        self.child = child
        self.adopted = adopted
        self.state = EnginePhase.READY if record.ready_at else EnginePhase.STARTING
        if record.drain_started_at:
            self.state = EnginePhase.DRAINING
        self.drain_task: asyncio.Task | None = None

    def view(self) -> EngineView:
        r = self.record
        # Sampled now (a heartbeat's view), so status shows what the engine holds lately:
        # a dense stage's weights are mmapped and only count once its rounds touched them.
        resident = None if self.child.exit else resident_bytes(r.pid, r.create_time)
        return EngineView(r.spec, self.state, r.pid, r.started_at, r.log_path, self.adopted,
                          r.ready_at, r.drain_started_at, self.child.exit, r.weights_bytes,
                          resident)


class EngineManager:
    """Runs this node's engines; every state change goes to `on_event` at once."""

    MAX_EVENTS = 1000
    MAX_EXITED = 100

    def __init__(self, config: AgentConfig,
                 backends_present: Callable[[], frozenset[str]] = frozenset,
                 on_event: Callable[[EngineEvent], None] | None = None) -> None:
        self.config = config
        self.backends_present = backends_present
        self.on_event = on_event
        self.engines: dict[str, _Engine] = {}
        self.events: list[EngineEvent] = []
        self.seq = 0
        self._changed = asyncio.Event()  # set and replaced on every event
        self._loop_task: asyncio.Task | None = None
        self.log = log.bind(node=config.node)

    # --- records on disk -----------------------------------------------------------------

    def _record_path(self, engine_id: str) -> Path:
        return self.config.run_dir / f"{engine_id}.json"

    def _save(self, record: RunRecord) -> None:
        path = self._record_path(record.spec.engine_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record.to_dict(), indent=1))
        os.replace(tmp, path)

    def _load_records(self) -> list[RunRecord]:
        records = []
        for path in sorted(self.config.run_dir.glob("*.json")):
            try:
                records.append(RunRecord.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                # Its engine, if one still runs, is not adopted: it is left as it is.
                self.log.warning("unreadable run record removed", path=str(path), error=str(exc))
                path.unlink(missing_ok=True)
        return records

    # --- events --------------------------------------------------------------------------

    def _emit(self, engine: _Engine, state: EnginePhase, **detail: Any) -> None:
        engine.state = state
        self.seq += 1
        event = EngineEvent(self.seq, engine.record.spec.engine_id, state, time.time(), detail)
        self.events.append(event)
        del self.events[:-self.MAX_EVENTS]
        self.log.info("engine state", engine=event.engine_id, replica=engine.record.spec.replica,
                      rank=engine.record.spec.rank, state=state.value, **detail)
        if self.on_event:
            self.on_event(event)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_events(self, after: int, timeout_s: float) -> list[EngineEvent]:
        """Events with seq > after; waits up to timeout_s for one if there are none yet."""
        if self.seq <= after and timeout_s > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        return [e for e in self.events if e.seq > after]

    # --- the child's callbacks -----------------------------------------------------------

    def _on_line(self, engine_id: str, line: str, event: dict | None) -> None:
        engine = self.engines.get(engine_id)
        if engine is None or event is None:
            return
        if event.get("event") == LOADED_EVENT and isinstance(event.get("weights_bytes"), int):
            engine.record = replace(engine.record, weights_bytes=event["weights_bytes"])
            self._save(engine.record)
        if event.get("event") == READY_EVENT and engine.state == EnginePhase.STARTING:
            engine.record = replace(engine.record, ready_at=time.time())
            self._save(engine.record)
            self._emit(engine, EnginePhase.READY)

    def _on_exit(self, engine_id: str, exit_: ChildExit) -> None:
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        self._record_path(engine_id).unlink(missing_ok=True)
        self._remove_secrets(engine_id)
        self._emit(engine, EnginePhase.EXITED, **exit_.to_dict())
        exited = [e for e in self.engines.values() if e.state == EnginePhase.EXITED]
        for old in exited[:-self.MAX_EXITED]:
            self.engines.pop(old.record.spec.engine_id, None)

    def _child_kwargs(self, spec: EngineSpec) -> dict[str, Any]:
        engine_id = spec.engine_id
        return dict(on_line=lambda line, ev: self._on_line(engine_id, line, ev),
                    on_exit=lambda exit_: self._on_exit(engine_id, exit_),
                    replica=spec.replica, rank=spec.rank)

    def _log_file(self, engine_id: str) -> RotatingLog:
        return RotatingLog(self.config.logs_dir / f"engine-{engine_id}.log",
                           self.config.engine_log_max_bytes, self.config.engine_log_backups)

    def _prune_logs(self, running: frozenset[str]) -> None:
        """Delete the logs of old engines (agent.spawn.engine_logs_to_prune decides which)."""
        try:
            files = [LogFile(p.name, p.stat().st_mtime)
                     for p in self.config.logs_dir.glob("engine-*.log*")]
        except OSError:
            return
        for name in engine_logs_to_prune(files, running, self.config.engine_logs_keep,
                                         self.config.engine_logs_max_age_s, time.time()):
            (self.config.logs_dir / name).unlink(missing_ok=True)
            self.log.info("old engine log pruned", file=name)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Find what an earlier agent left, act on it, and start the decision loop."""
        from agent.child import same_process_alive

        records = tuple(self._load_records())
        alive = {r.spec.engine_id: same_process_alive(r.pid, r.create_time) for r in records}
        for action in plan_adoption(records, alive, self.config.adopt_engines):
            record = action.record
            engine_id = record.spec.engine_id
            if isinstance(action, Discard):
                self._record_path(engine_id).unlink(missing_ok=True)
                self._remove_secrets(engine_id)
                self.log.info("engine gone while the agent was down", engine=engine_id,
                              pid=record.pid)
                continue
            child = ChildProcess.adopt(f"engine {engine_id}", record.pid, record.create_time,
                                       self._log_file(engine_id), **self._child_kwargs(record.spec))
            if child is None:
                self._record_path(engine_id).unlink(missing_ok=True)
                self._remove_secrets(engine_id)
                continue
            engine = _Engine(record, child, adopted=True)
            self.engines[engine_id] = engine
            self._emit(engine, engine.state, adopted=True, pid=record.pid)
            child.start_monitor()
            if engine.state == EnginePhase.DRAINING:  # an earlier agent's drain: see it through
                self._resume_drain(engine)
            elif isinstance(action, AdoptAndDrain):
                self.drain(engine_id, reason="adopted after a restart; adopt_engines is off")
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            views = self.snapshot()
            for action in decide(views, time.time(), self.config.ready_timeout_s):
                self.drain(action.engine_id, reason=action.reason, drain_s=action.drain_s)

    def snapshot(self) -> tuple[EngineView, ...]:
        return tuple(e.view() for e in self.engines.values())

    def view(self, engine_id: str) -> EngineView | None:
        engine = self.engines.get(engine_id)
        return engine.view() if engine else None

    def spawn(self, request: SpawnRequest) -> EngineView:
        """Check and start one stage; SpawnRefused names what is wrong."""
        engine_id = request.engine_id
        if not ENGINE_ID.match(engine_id):  # it names files: check it before any is written
            raise SpawnRefused("engine_id", f"{engine_id!r}: use letters, digits, '-', "
                               "'_', '.' (at most 96)")
        live = self.engines.get(engine_id)
        if live is not None and live.state != EnginePhase.EXITED:  # before touching its files
            raise SpawnRefused("engine_id", f"{engine_id!r} is already running here", 409)
        try:
            return self._spawn(self._with_secret_files(request))
        except BaseException:
            self._remove_secrets(engine_id)
            raise

    def _spawn(self, spec: EngineSpec) -> EngineView:
        info = read_checkpoint_info(str(spec.engine.model_dir))
        running = tuple(e.record.spec for e in self.engines.values()
                        if e.state != EnginePhase.EXITED)
        check_spawn(spec, info, self.backends_present(), running)
        for name, host, port in spec.bound_ports():
            if port_in_use(host, port):
                raise SpawnRefused(name, f"{host}:{port} is in use by another process", 409)
        self._prune_logs(frozenset(e.record.spec.engine_id for e in self.engines.values()
                                   if e.state != EnginePhase.EXITED) | {spec.engine_id})
        log_file = self._log_file(spec.engine_id)
        argv = list(self.config.engine_command)
        try:
            child = ChildProcess.spawn(f"engine {spec.engine_id}", argv,
                                       child_environment(spec), log_file,
                                       from_start=False, **self._child_kwargs(spec))
        except SpawnError as exc:
            raise SpawnRefused("engine_command", str(exc), 500) from exc
        record = RunRecord(spec, child.pid, child.create_time, time.time(),
                           str(log_file.path), os.getpid())
        self._save(record)
        engine = _Engine(record, child, adopted=False)
        self.engines[spec.engine_id] = engine
        self._emit(engine, EnginePhase.STARTING, pid=child.pid)
        child.start_monitor()
        return engine.view()

    # --- secrets on disk: 0600 files in keys/ (0700), named for their engine, gone with it --

    def _secret_paths(self, engine_id: str) -> tuple[Path, Path]:
        keys = self.config.state_dir / "keys"
        return keys / f"{engine_id}.key", keys / f"{engine_id}.api"

    def _with_secret_files(self, request: SpawnRequest) -> EngineSpec:
        """The link key and the API secret arrive over mutual TLS; write each to a file of
        ours and let the contract name only its path, so neither the run record nor any view
        holds them. Then read the contract, with this agent's drain_s where it sets none."""
        link_path, api_path = self._secret_paths(request.engine_id)
        key_file = api_secret_file = None
        if request.link_key:
            try:
                key = bytes.fromhex(request.link_key)
            except ValueError:
                raise SpawnRefused("link_key", "expected the link key in hex") from None
            if len(key) < 16:
                raise SpawnRefused("link_key", f"{len(key)} bytes; a link key has at least 16")
            write_private(private_dir(link_path.parent) / link_path.name,
                          request.link_key.encode())
            key_file = link_path
        if request.api_secret:  # the contract refuses it at a rank other than 0
            write_private(private_dir(api_path.parent) / api_path.name,
                          request.api_secret.encode())
            api_secret_file = api_path
        return request.spec(self.config.drain_s, key_file, api_secret_file)

    def _remove_secrets(self, engine_id: str) -> None:
        for path in self._secret_paths(engine_id):
            path.unlink(missing_ok=True)

    def drain(self, engine_id: str, *, reason: str = "asked", drain_s: float | None = None) -> (
            EngineView):
        """SIGTERM (the engine stops admitting and lets in-flight requests finish), then
        SIGKILL if it is still there `drain_s + term_grace_s` later. Returns at once."""
        engine = self.engines[engine_id]
        if engine.state == EnginePhase.EXITED or engine.drain_task is not None:
            return engine.view()
        if drain_s is None:  # the request's, else the engine's own (the spawn's or the agent's)
            drain_s = engine.record.spec.engine.drain_s
        grace = GracePeriods(term_s=drain_s + self.config.term_grace_s,
                             kill_s=self.config.kill_grace_s)
        engine.record = replace(engine.record, drain_started_at=time.time())
        self._save(engine.record)
        self._emit(engine, EnginePhase.DRAINING, reason=reason, drain_s=drain_s)
        engine.drain_task = asyncio.get_running_loop().create_task(engine.child.stop(grace))
        return engine.view()

    def _resume_drain(self, engine: _Engine) -> None:
        """The SIGTERM went out before a restart: SIGKILL if the engine outlives its drain."""
        drain_s = engine.record.spec.engine.drain_s
        elapsed = time.time() - (engine.record.drain_started_at or time.time())
        left = max(0.0, drain_s + self.config.term_grace_s - elapsed)
        engine.drain_task = asyncio.get_running_loop().create_task(engine.child.stop(
            GracePeriods(term_s=left, kill_s=self.config.kill_grace_s), termed_already=True))

    def forget(self, engine_id: str) -> None:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise KeyError(engine_id)
        if engine.state != EnginePhase.EXITED:
            raise SpawnRefused("engine_id", f"{engine_id} is {engine.state.value}: drain it "
                               "first", 409)
        del self.engines[engine_id]

    async def close(self, *, drain: bool = True) -> None:
        """Drain every engine (graceful stop of the agent) and stop the loop."""
        if self._loop_task:
            self._loop_task.cancel()
        if drain:
            for engine_id, engine in list(self.engines.items()):
                if engine.state != EnginePhase.EXITED:
                    self.drain(engine_id, reason="the agent is stopping")
            tasks = [e.drain_task for e in self.engines.values() if e.drain_task]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines.values():
            await engine.child.close()
