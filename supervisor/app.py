"""The supervisor's aiohttp app: the mutual-TLS API for agents and fleetctl, with the loop,
the health checks and the front door (its own plain-HTTP port) owned by `cleanup_ctx`.

Routes are marked with the roles that may call them (the OU of the caller's certificate):
agents report about themselves only (the certificate's name must be the path's node);
`fleet-front-door`'s `front-door` certificate reads the route table (`GET /v1/routes`: the
replicas, their secrets, the client API keys); fleetctl's `admin` certificate drives
everything else. `/v1/pki/ca` and `/v1/pki/join` are open: a joining node has no certificate yet, and its token is the proof.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import structlog
from aiohttp import web

from agent.mtls_api import authorize_and_explain, error_body, roles
from agent.pki import FleetCA, Identity, PkiError, check_node_name, check_ttl
from agent.tls import client_context
from supervisor import intake, issuing, operator_commands, views
from supervisor.agents import AgentClient
from supervisor.control_loop import Supervisor
from supervisor.front_door import FrontDoorConfig, open_front_door
from supervisor.request_error import RequestError
from supervisor.settings import SupervisorSettings, split_address

log = structlog.get_logger()

SETTINGS = web.AppKey("settings", SupervisorSettings)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
CA = web.AppKey("ca", FleetCA)
LOOPS = web.AppKey("loops", list)
AGENT, ADMIN = frozenset({"agent"}), frozenset({"admin"})


def refuse_agent_peer(request: web.Request, who: Identity, allowed: frozenset[str]) -> str | None:
    """An agent reports for its own node only, with the certificate pinned when it joined."""
    if allowed != AGENT:
        return None
    node = request.match_info.get("node")
    if node != who.node:
        return f"certificate {who.node!r} may not report for node {node!r}"
    return intake.refuse_agent(request.app[SUPERVISOR], who)


def explain(exc: Exception) -> web.Response | None:
    """The supervisor's typed errors as bodies that name the field, line or problem."""
    if isinstance(exc, RequestError):
        return error_body(exc.message, exc.status, **exc.extra)
    if isinstance(exc, issuing.AlreadyMember):
        return error_body(str(exc), 409)
    if isinstance(exc, PkiError):
        return error_body(str(exc), 403)
    return None


async def body_of(request: web.Request) -> dict[str, Any]:
    body = await request.json() if request.can_read_body else {}
    if not isinstance(body, dict):
        raise RequestError(400, "expected a JSON object")
    return body


# --- the PKI ------------------------------------------------------------------------------
@roles("open")
async def pki_ca(request: web.Request) -> web.Response:
    return web.json_response(issuing.ca_body(request.app[CA]))


@roles("open")
async def pki_join(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    return web.json_response(issuing.join(request.app[CA], supervisor.state,
                                          await body_of(request)))


@roles("admin")
async def new_token(request: web.Request) -> web.Response:
    body = await body_of(request)
    node = body.get("node")
    if not isinstance(node, str) or not node:
        raise RequestError(400, "a join token names the one node that may use it: give "
                           "`node` (fleetctl token --node NAME)", field="node")
    # ttl_s goes to the check as sent: "nan", NaN, Infinity or a negative number is refused.
    for name, check in (("node", lambda: check_node_name(node)),
                        ("ttl_s", lambda: check_ttl(body.get("ttl_s", 3600)))):
        try:
            check()
        except PkiError as exc:
            raise RequestError(400, str(exc), field=name) from exc
    token = issuing.new_token(request.app[CA], request.app[SUPERVISOR].state,
                              ttl_s=body.get("ttl_s", 3600), node=node)
    return web.json_response({"token": str(token), "node": node})


# --- agents -------------------------------------------------------------------------------
@roles("agent")
async def heartbeat(request: web.Request) -> web.Response:
    body = await body_of(request)
    if not isinstance(body.get("url"), str) or not body["url"].startswith("https://"):
        raise RequestError(400, "a heartbeat needs the agent's url (https://HOST:PORT)",
                           field="url")
    reply = intake.heartbeat(request.app[SUPERVISOR], request.match_info["node"], body)
    return web.json_response(reply)


@roles("agent")
async def events(request: web.Request) -> web.Response:
    body = await body_of(request)
    intake.engine_events(request.app[SUPERVISOR], request.match_info["node"],
                         list(body.get("events", [])))
    return web.json_response({"ok": True})


@roles("agent")
async def goodbye(request: web.Request) -> web.Response:
    body = await body_of(request)
    intake.goodbye(request.app[SUPERVISOR], request.match_info["node"], str(body.get("reason", "")))
    return web.json_response({"ok": True})


# --- a front door of its own process -----------------------------------------------------
@roles("front-door")
async def routes(request: web.Request) -> web.Response:
    """The route table (supervisor/route_table.py) that `fleet-front-door` polls."""
    table = views.route_table(request.app[SUPERVISOR])
    return web.Response(body=table.to_json(), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


# --- fleetctl -----------------------------------------------------------------------------
async def status(request: web.Request) -> web.Response:
    return web.json_response(views.status(request.app[SUPERVISOR]))


async def apply(request: web.Request) -> web.Response:
    body = await body_of(request)
    result = operator_commands.apply_desired(
        request.app[SUPERVISOR], str(body.get("text", "")), str(body.get("source", "fleet.yaml")),
        dry_run=bool(body.get("dry_run")), force=bool(body.get("force")))
    return web.json_response(result)


async def plan(request: web.Request) -> web.Response:
    body = await body_of(request)
    config = operator_commands.parse(str(body.get("text", "")),
                                     str(body.get("source", "fleet.yaml")))
    return web.json_response({"plans": operator_commands.plans(request.app[SUPERVISOR], config)})


async def revoke_node(request: web.Request) -> web.Response:
    return web.json_response(operator_commands.revoke(request.app[SUPERVISOR],
                                                      request.match_info["node"]))


async def drain_node(request: web.Request) -> web.Response:
    body = await body_of(request)
    return web.json_response(operator_commands.drain_node(
        request.app[SUPERVISOR], request.match_info["node"], undo=bool(body.get("undo"))))


async def rebalance(request: web.Request) -> web.Response:
    return web.json_response(operator_commands.rebalance(request.app[SUPERVISOR]))


async def remeasure(request: web.Request) -> web.Response:
    body = await body_of(request)
    nodes = body.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise RequestError(400, "nodes: a list of node names (none: every node)", field="nodes")
    return web.json_response(operator_commands.remeasure(request.app[SUPERVISOR], nodes))


async def event_log(request: web.Request) -> web.Response:
    after = int(request.query.get("after", "0"))
    return web.json_response({"events": request.app[SUPERVISOR].state.events(after)})


# --- what the app owns --------------------------------------------------------------------
async def supervisor_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    agents = AgentClient(client_context(issuing.supervisor_credentials(settings.state_dir)))
    await agents.start()
    app[SUPERVISOR] = Supervisor(settings, agents)
    issuing.ensure_front_door_credentials(settings.state_dir, app[CA], settings.listen)
    yield
    await app[SUPERVISOR].close()
    await agents.close()


async def loops_ctx(app: web.Application) -> AsyncIterator[None]:
    supervisor = app[SUPERVISOR]
    loop = asyncio.get_running_loop()
    app[LOOPS] = [loop.create_task(supervisor.run()), loop.create_task(supervisor.health_loop()),
                  loop.create_task(supervisor.speeds.run(partial(views.speed_targets, supervisor)))]
    yield
    for task in app[LOOPS]:
        task.cancel()
    await asyncio.gather(*app[LOOPS], return_exceptions=True)


async def front_door_ctx(app: web.Application) -> AsyncIterator[None]:
    """The front door in this process (the one-process setup); none with `--no-front-door`,
    where `fleet-front-door` serves it from `GET /v1/routes`."""
    settings, supervisor = app[SETTINGS], app[SUPERVISOR]
    if not settings.front_door:
        yield
        return
    config = FrontDoorConfig(partial(views.route, supervisor), partial(views.models, supervisor),
                             frozenset(settings.api_keys), relays=supervisor.relays)
    host, port = split_address(settings.front_door, "front_door")
    runner = await open_front_door(config, host, port)
    log.info("front door open", url=settings.front_door_url)
    yield
    await runner.cleanup()


def make_app(settings: SupervisorSettings) -> web.Application:
    """Serve it with `tls.server_context(settings)`; the front door opens with it."""
    app = web.Application(middlewares=[authorize_and_explain(ADMIN, explain, refuse_agent_peer)],
                          client_max_size=4 << 20)
    app[SETTINGS] = settings
    app[CA] = FleetCA.load(settings.state_dir / "pki")
    app.router.add_routes([
        web.get("/v1/pki/ca", pki_ca),
        web.post("/v1/pki/join", pki_join),
        web.post("/v1/tokens", new_token),
        web.post("/v1/nodes/{node}/heartbeat", heartbeat),
        web.post("/v1/nodes/{node}/events", events),
        web.post("/v1/nodes/{node}/goodbye", goodbye),
        web.post("/v1/nodes/{node}/drain", drain_node),
        web.post("/v1/nodes/{node}/revoke", revoke_node),
        web.get("/v1/status", status),
        web.post("/v1/apply", apply),
        web.post("/v1/plan", plan),
        web.post("/v1/rebalance", rebalance),
        web.post("/v1/remeasure", remeasure),
        web.get("/v1/events", event_log),
        web.get("/v1/routes", routes),
    ])
    # Torn down in reverse: the front door closes first, then the loops, then the state.
    app.cleanup_ctx.extend([supervisor_ctx, loops_ctx, front_door_ctx])
    return app
