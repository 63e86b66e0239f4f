"""The agent's HTTP API (aiohttp, mutual TLS): facts, calibration, link probes and engines.

Served only with `agent.tls.server_context`, so a caller without a fleet certificate never
reaches a handler; the role in the caller's certificate then decides what it may do:
spawning and draining engines is for the supervisor (and fleetctl's admin certificate).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from agent import dist_probe
from agent.calibrate import (
    PROGRESS_EVENT,
    RESULT_EVENT,
    CalibrationCache,
    CalibrationError,
    CalibrationRequest,
)
from agent.child import ChildProcess, GracePeriods, RotatingLog, SpawnError
from agent.config import AgentConfig
from agent.engines import EngineManager
from agent.facts import FactsService, engine_version
from agent.heartbeat import Heartbeat
from agent.mtls_api import PEER, authorize_and_explain, error_body, roles
from agent.pki import NodeCredentials
from agent.probe import (
    ProbeError,
    ProbeListener,
    ProbeTicket,
    ask_peer,
    open_listener,
    run_probe,
)
from agent.spawn import SpawnRefused, SpawnRequest, engine_pythonpath
from agent.tls import client_context

log = structlog.get_logger()

ANY_MEMBER = frozenset({"agent", "supervisor", "admin"})
CONTROLLERS = frozenset({"supervisor", "admin"})


@dataclass
class CalibrationJob:
    job_id: str
    key: str
    request: CalibrationRequest
    state: str = "running"  # running, done, failed
    done: int = 0
    total: int = 0
    what: str = ""
    result: dict[str, Any] | None = None
    error: str = ""
    started_at: float = field(default_factory=time.time)
    child: ChildProcess | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "key": self.key, "state": self.state, "done": self.done,
                "total": self.total, "what": self.what, "result": self.result,
                "error": self.error, "started_at": self.started_at}


class Calibrations:
    """Calibration children, one at a time (two would time each other), and the cache."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.cache = CalibrationCache(config.calibration_dir)
        self.jobs: dict[str, CalibrationJob] = {}
        self.running: CalibrationJob | None = None
        self.tasks: set[asyncio.Task] = set()

    def start(self, request: CalibrationRequest) -> CalibrationJob:
        key = request.key(engine_version())
        if self.running is not None:
            if self.running.key == key:
                return self.running
            raise SpawnRefused("calibration", f"job {self.running.job_id} is running; "
                               "calibrations run one at a time", 409)
        job = CalibrationJob(f"cal-{len(self.jobs) + 1}-{int(time.time())}", key, request)
        self.jobs[job.job_id] = job
        self.running = job
        task = asyncio.get_running_loop().create_task(self._run(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return job

    async def _run(self, job: CalibrationJob) -> None:
        from dataclasses import asdict

        def on_line(_line: str, event: dict | None) -> None:
            if not event:
                return
            if event.get("event") == PROGRESS_EVENT:
                job.done, job.total, job.what = event["done"], event["total"], event["what"]
            elif event.get("event") == RESULT_EVENT:
                job.result = event["result"]

        env = dict(os.environ, PYTHONPATH=engine_pythonpath())
        # The cache was asked before the job started (`start_calibration`): a child runs
        # only to measure, also where the cache holds an answer that a `force` passed over.
        argv = [sys.executable, "-m", "agent.calibrate", json.dumps(asdict(job.request)),
                str(self.cache.directory), "--force"]
        try:
            job.child = ChildProcess.spawn(f"calibration {job.job_id}", argv, env,
                                           RotatingLog(self.config.logs_dir / "calibration.log",
                                                       4 << 20, 2), from_start=False,
                                           on_line=on_line)
            exit_ = await job.child.wait(job.request.budget_s * 4 + 300)
            if exit_ is None:
                exit_ = await job.child.stop(GracePeriods(term_s=5.0, kill_s=5.0))
            if job.result is not None:
                job.state = "done"
            else:
                job.state = "failed"
                job.error = exit_.reason if exit_ else "the calibration would not stop"
        except (SpawnError, OSError) as exc:  # the agent keeps running, the job says why
            job.state, job.error = "failed", str(exc)
        finally:
            self.running = None
            log.info("calibration finished", job=job.job_id, state=job.state, error=job.error)

    async def close(self) -> None:
        job = self.running
        if job and job.child:
            await job.child.stop(GracePeriods(term_s=5.0, kill_s=5.0))
        for task in list(self.tasks):
            task.cancel()


CONFIG = web.AppKey("config", AgentConfig)
CREDENTIALS = web.AppKey("credentials", NodeCredentials)
CLIENT_SSL = web.AppKey("client_ssl", ssl.SSLContext)
FACTS = web.AppKey("facts", FactsService)
ENGINES = web.AppKey("engines", EngineManager)
HEARTBEAT = web.AppKey("heartbeat", Heartbeat)
CALIBRATIONS = web.AppKey("calibrations", Calibrations)
PROBES = web.AppKey("probes", set)
BACKGROUND = web.AppKey("background", set)


# --- errors and who may call what -------------------------------------------------------

def explain(exc: Exception) -> web.Response | None:
    """The agent's typed errors as bodies that name the field or problem."""
    if isinstance(exc, SpawnRefused):
        return error_body(exc.message, exc.status, field=exc.field)
    if isinstance(exc, (CalibrationError, ProbeError)):
        return error_body(str(exc), 422)
    if isinstance(exc, (ValueError, TypeError)):  # a bad number in a query or body
        return error_body(f"bad request: {exc}", 400)
    return None


# Any fleet certificate may read; spawning and draining are marked for controllers.
authorize = authorize_and_explain(ANY_MEMBER, explain)


async def json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise SpawnRefused("body", "expected a JSON object", 400)
    return body


# --- handlers ---------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    return web.json_response({"status": "ok", "node": config.node,
                              "engine_version": engine_version(),
                              "peer": request[PEER].node})


async def get_facts(request: web.Request) -> web.Response:
    service = request.app[FACTS]
    if request.query.get("refresh") == "backends":
        await service.probe()
    facts = service.refresh_host()
    return web.json_response({"facts": facts.to_dict(), "digest": facts.digest(),
                              "probe_error": service.probe_error})


@roles("supervisor", "admin")
async def refresh_facts(request: web.Request) -> web.Response:
    await request.app[FACTS].probe()
    return await get_facts(request)


async def list_engines(request: web.Request) -> web.Response:
    return web.json_response({"engines": [v.to_dict() for v in request.app[ENGINES].snapshot()]})


def _engine_or_404(request: web.Request):
    engine_id = request.match_info["engine_id"]
    view = request.app[ENGINES].view(engine_id)
    if view is None:
        raise web.HTTPNotFound(text=json.dumps({"error": {
            "message": f"no engine {engine_id!r} on this node", "status": 404}}),
            content_type="application/json")
    return view


async def get_engine(request: web.Request) -> web.Response:
    return web.json_response(_engine_or_404(request).to_dict())


@roles("supervisor", "admin")
async def spawn_engine(request: web.Request) -> web.Response:
    spawn = SpawnRequest.from_dict(await json_body(request))
    facts = request.app[FACTS]
    await facts.wait_probed(request.app[CONFIG].backend_probe_timeout_s)
    view = request.app[ENGINES].spawn(spawn)
    return web.json_response(view.to_dict(), status=201)


@roles("supervisor", "admin")
async def drain_engine(request: web.Request) -> web.Response:
    view = _engine_or_404(request)
    body = await json_body(request)
    drain_s = body.get("drain_s")
    if drain_s is not None and (not isinstance(drain_s, (int, float)) or drain_s < 0):
        raise SpawnRefused("drain_s", f"{drain_s!r}: expected seconds >= 0", 400)
    view = request.app[ENGINES].drain(view.spec.engine_id, reason=str(body.get("reason", "asked")),
                                      drain_s=drain_s)
    return web.json_response(view.to_dict(), status=202)


@roles("supervisor", "admin")
async def forget_engine(request: web.Request) -> web.Response:
    view = _engine_or_404(request)
    request.app[ENGINES].forget(view.spec.engine_id)
    return web.json_response({"forgotten": view.spec.engine_id})


async def engine_log(request: web.Request) -> web.Response:
    view = _engine_or_404(request)
    lines = min(int(request.query.get("lines", "100")), 2000)

    def tail() -> list[str]:
        try:
            with open(view.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - lines * 400))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []

    text = await asyncio.to_thread(tail)
    return web.json_response({"engine_id": view.spec.engine_id, "lines": text})


async def events(request: web.Request) -> web.Response:
    after = int(request.query.get("after", "0"))
    wait_s = min(float(request.query.get("wait_s", "0")), 30.0)
    found = await request.app[ENGINES].wait_events(after, wait_s)
    return web.json_response({"events": [e.to_dict() for e in found]})


async def list_calibrations(request: web.Request) -> web.Response:
    calibrations = request.app[CALIBRATIONS]
    return web.json_response({
        "calibrations": [c.to_dict() for c in calibrations.cache.all()],
        "jobs": [j.to_dict() for j in calibrations.jobs.values()]})


@roles("supervisor", "admin")
async def start_calibration(request: web.Request) -> web.Response:
    calibrations = request.app[CALIBRATIONS]
    body = await json_body(request)
    force = bool(body.pop("force", False))
    request_ = CalibrationRequest.from_dict(body)
    cached = calibrations.cache.get(request_.key(engine_version()))
    if cached is not None and not force:
        return web.json_response({"state": "done", "result": cached.to_dict()})
    job = calibrations.start(request_)
    return web.json_response(job.to_dict(), status=202)


async def get_calibration_job(request: web.Request) -> web.Response:
    job = request.app[CALIBRATIONS].jobs.get(request.match_info["job_id"])
    if job is None:
        return error_body(f"no calibration job {request.match_info['job_id']!r}", 404)
    return web.json_response(job.to_dict())


async def probe_listen(request: web.Request) -> web.Response:
    """Open a one-shot listener on a stage port for a peer's probe; answer its ticket. With
    "dist" (gloo or nccl), the torch.distributed end instead: the offer its child names."""
    config = request.app[CONFIG]
    body = await json_body(request)
    max_bytes = min(int(body.get("bytes", config.probe_max_bytes)), config.probe_max_bytes)
    if body.get("dist"):
        return web.json_response({"dist": await _dist_listen(request, body, max_bytes)})
    listener, ticket = await open_listener(config.listen_host, config.stage_ports, max_bytes,
                                           config.probe_max_s)
    probes: set[ProbeListener] = request.app[PROBES]
    probes.add(listener)
    task = asyncio.get_running_loop().create_task(listener.done.wait())
    task.add_done_callback(lambda _t: probes.discard(listener))
    request.app[BACKGROUND].add(task)
    task.add_done_callback(request.app[BACKGROUND].discard)
    return web.json_response(ticket.to_dict())


async def _dist_listen(request: web.Request, body: dict, max_bytes: int) -> dict:
    config = request.app[CONFIG]
    child, offer = await dist_probe.serve(dist_probe.request(
        "serve", str(body["dist"]), host=config.listen_host, pings=int(body.get("pings", 10)),
        row_bytes=int(body.get("row_bytes", dist_probe.ROW_BYTES)), bytes_=max_bytes,
        max_s=config.probe_max_s))
    task = asyncio.get_running_loop().create_task(child.reap())
    request.app[BACKGROUND].add(task)
    task.add_done_callback(request.app[BACKGROUND].discard)
    return offer


@roles("supervisor", "admin")
async def probe_peer(request: web.Request) -> web.Response:
    """Measure the link to a peer agent: ask it for a ticket (mTLS), then probe over TCP;
    with "dist" (gloo or nccl), then over torch.distributed too, reported under "dist"."""
    config = request.app[CONFIG]
    body = await json_body(request)
    peer = str(body.get("peer", "")).rstrip("/")
    if not peer.startswith("https://"):
        raise ProbeError(f"peer {peer!r}: expected the peer agent's https:// URL")
    want = min(int(body.get("bytes", 16 << 20)), config.probe_max_bytes)
    max_s = min(float(body.get("max_s", config.probe_max_s)), config.probe_max_s)
    pings = int(body.get("pings", 10))
    kind = dist_probe.checked_kind(str(body["dist"])) if body.get("dist") else ""
    started = time.monotonic()
    raw = await ask_peer(peer, request.app[CLIENT_SSL], {"bytes": want}, max_s)
    try:
        ticket = ProbeTicket(**raw)
    except TypeError as exc:
        raise ProbeError(f"{peer} answered something that is not a probe ticket: {raw}") from exc
    result = await run_probe(ticket, peer=peer, pings=pings, bytes_=want, max_s=max_s)
    if kind:
        # What is left of max_s, so the whole answer comes within it (the supervisor's
        # request has its own timeout) and a slow path costs only its own numbers.
        left_s = max(1.0, max_s - (time.monotonic() - started))
        try:
            answer = await ask_peer(peer, request.app[CLIENT_SSL], {
                "bytes": want, "pings": pings, "dist": kind,
                "row_bytes": int(body.get("row_bytes", dist_probe.ROW_BYTES))}, left_s)
            measured = await dist_probe.measure(
                answer["dist"], max(1.0, max_s - (time.monotonic() - started)))
        except (ProbeError, KeyError, TypeError) as exc:  # said beside the TCP probe's numbers
            measured = {"transport": kind, "error": str(exc) or type(exc).__name__}
        result = replace(result, dist=measured)
    return web.json_response(result.to_dict())


# --- the app ----------------------------------------------------------------------------

async def facts_ctx(app: web.Application) -> AsyncIterator[None]:
    service = app[FACTS]
    config = app[CONFIG]
    service.refresh_host()

    async def refresh() -> None:
        await service.probe()
        while True:
            await asyncio.sleep(config.facts_refresh_s)
            service.refresh_host()

    task = asyncio.get_running_loop().create_task(refresh())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def heartbeat_ctx(app: web.Application) -> AsyncIterator[None]:
    heartbeat = app.get(HEARTBEAT)
    if heartbeat is not None:
        await heartbeat.start()
    yield
    if heartbeat is not None:
        await heartbeat.stop()


async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ENGINES].start()
    yield
    await app[ENGINES].close(drain=True)


async def side_jobs_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[CALIBRATIONS].close()
    for listener in list(app[PROBES]):
        await listener.close()
    for task in list(app[BACKGROUND]):
        task.cancel()


def make_app(config: AgentConfig) -> web.Application:
    """The agent: serve it with `agent.tls.server_context(NodeCredentials(config.pki_dir))`."""
    credentials = NodeCredentials(config.pki_dir)
    app = web.Application(middlewares=[authorize], client_max_size=1 << 20)
    app[CONFIG] = config
    app[CREDENTIALS] = credentials
    app[CLIENT_SSL] = client_context(credentials)
    app[FACTS] = FactsService(config.node, config.os_floor_bytes, config.gpu_reserve_bytes,
                              config.logs_dir, config.backend_probe_timeout_s)
    heartbeat = None
    if config.supervisor_url:
        heartbeat = Heartbeat(config.node, config.url, config.supervisor_url,
                              config.heartbeat_interval_s, app[CLIENT_SSL],
                              lambda: app[FACTS].current, lambda: app[ENGINES].snapshot())
        app[HEARTBEAT] = heartbeat
    app[ENGINES] = EngineManager(config, app[FACTS].present_backends,
                                 heartbeat.push if heartbeat else None)
    app[CALIBRATIONS] = Calibrations(config)
    app[PROBES] = set()
    app[BACKGROUND] = set()
    app.router.add_routes([
        web.get("/v1/health", health),
        web.get("/v1/facts", get_facts),
        web.post("/v1/facts/refresh", refresh_facts),
        web.get("/v1/engines", list_engines),
        web.post("/v1/engines", spawn_engine),
        web.get("/v1/engines/{engine_id}", get_engine),
        web.post("/v1/engines/{engine_id}/drain", drain_engine),
        web.delete("/v1/engines/{engine_id}", forget_engine),
        web.get("/v1/engines/{engine_id}/log", engine_log),
        web.get("/v1/events", events),
        web.get("/v1/calibrations", list_calibrations),
        web.post("/v1/calibrations", start_calibration),
        web.get("/v1/calibrations/jobs/{job_id}", get_calibration_job),
        web.post("/v1/probe", probe_peer),
        web.post("/v1/probe/listen", probe_listen),
    ])
    # Set up in this order, torn down in reverse: engines drain first (heartbeats still
    # report them), then the goodbye, then the facts loop.
    app.cleanup_ctx.extend([facts_ctx, heartbeat_ctx, engines_ctx, side_jobs_ctx])
    return app


class AgentAlreadyRunning(RuntimeError):
    """Another agent holds this state directory (it would fight over the same engines)."""


def lock_state_dir(state_dir: Path) -> Any:
    """An exclusive lock on `state_dir/agent.lock` for the agent's life (released at exit)."""
    import fcntl

    from agent.pki import private_dir

    private_dir(state_dir)  # 0700: keys, secrets and run records live under it
    handle = open(state_dir / "agent.lock", "a+")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise AgentAlreadyRunning(f"{state_dir}: another agent (pid {holder}) is running on "
                                  "this state directory") from exc
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


async def serve(config: AgentConfig, stop: asyncio.Event) -> None:
    """Run the agent until `stop` is set, then shut down in order (drain, goodbye).

    The state directory is locked and the API's port bound before anything starts, so a
    second agent, or a port in use, fails at once and touches no engine."""
    import socket

    from agent.tls import server_context

    lock = lock_state_dir(config.state_dir)
    family = socket.AF_INET6 if ":" in config.listen_host else socket.AF_INET
    sock = socket.create_server((config.listen_host, config.listen_port), family=family,
                                reuse_port=False)
    app = make_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    try:
        await runner.setup()
        await web.SockSite(runner, sock, ssl_context=server_context(app[CREDENTIALS])).start()
        log.info("agent serving", node=config.node, url=config.url,
                 state_dir=str(Path(config.state_dir)))
        await stop.wait()
        log.info("agent stopping", node=config.node)
    finally:
        await runner.cleanup()
        sock.close()
        lock.close()
