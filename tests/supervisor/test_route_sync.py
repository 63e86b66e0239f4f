"""The route sync of `fleet-front-door` (supervisor/route_sync.py) against a real supervisor
app over mutual TLS and against a stand-in supervisor on loopback whose answers the test
chooses: the last good routes kept while the supervisor errs, is away or answers garbage
(each refusal logged once, naming what was wrong); keys and failures taken on a re-sync; the
routes kept on disk with mode 0600 and served by a front door restarted without a
supervisor; the route table's checks and routing rule."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from agent.pki import NodeCredentials
from agent.tls import client_context
from engine.harness.launch import free_port
from supervisor.app import make_app
from supervisor.issuing import front_door_credentials, init_pki
from supervisor.main import server_context
from supervisor.relays import Relays
from supervisor.route_sync import RouteSync
from supervisor.route_table import (
    ModelRoutes,
    ReplicaRoute,
    RouteTable,
    RouteTableError,
)
from supervisor.settings import SupervisorSettings

TABLE = RouteTable(
    models=(ModelRoutes("m", parallel=2, serving=True, replicas=(
        ReplicaRoute("m-g1", "http://127.0.0.1:9001", "secret-1", slots_in_use=1),
        ReplicaRoute("m-g2", "http://127.0.0.1:9002", "secret-2"))),
        ModelRoutes("idle", unavailable="model 'idle' has no serving replica now (placing)")),
    api_keys=frozenset({"key-a"}),
    failed=(("m-g0", "rank 0 exited"),))


class StandIn:
    """A supervisor's `GET /v1/routes` on loopback, answering what the test sets."""

    def __init__(self) -> None:
        self.status, self.body = 200, TABLE.to_json()
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def answer(self, request: web.Request) -> web.Response:
        return web.Response(status=self.status, body=self.body,
                            content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/routes", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def served(sync: RouteSync) -> tuple:
    route = sync.route("m")
    return (route.replica, route.api_secret, tuple(f.replica for f in route.fallbacks),
            sync.api_keys())


def test_the_last_good_routes_are_kept_through_errors_absence_and_garbage(tmp_path: Path):
    routes_file = tmp_path / "door" / "routes.json"

    async def scenario() -> None:
        supervisor = StandIn()
        await supervisor.start()
        sync = RouteSync(supervisor.url, None, routes_file, Relays())
        async with aiohttp.ClientSession() as session:
            assert await sync.poll_once(session)
            good = served(sync)
            # m-g2 has a free slot more (m-g1's rank 0 said one was taken): it goes first.
            assert good == ("m-g2", "secret-2", ("m-g1",), frozenset({"key-a"}))
            assert sync.relays.failure("m-g0") == "rank 0 exited"  # its relays end
            assert sync.route("idle").status == 503
            assert "placing" in sync.route("idle").message
            assert sync.route("other").status == 404

            garbage = {
                "not JSON": b"{\"version\": 1, \"mod",
                "version": json.dumps(dict(TABLE.to_dict(), version=2)).encode(),
                "models[0].replicas[0].url": json.dumps(_with_replica(
                    url="file:///etc/passwd")).encode(),
                "models[0].replicas[0].replica": json.dumps(_with_replica(replica="")).encode(),
                "models[0].replicas[0].slots_in_use": json.dumps(_with_replica(
                    slots_in_use=-1)).encode(),
                "expected a JSON object": b"[1, 2]",
                "api_keys[0]": json.dumps(dict(TABLE.to_dict(), api_keys=[7])).encode(),
            }
            for named, body in garbage.items():
                supervisor.body = body
                with capture_logs() as logs:
                    assert not await sync.poll_once(session)
                    assert not await sync.poll_once(session)  # the same problem: no new line
                assert len(logs) == 1, (named, logs)
                assert logs[0]["event"] == "route answer refused; keeping the last routes"
                assert named in logs[0]["problem"], (named, logs[0])
                assert served(sync) == good
            supervisor.body, supervisor.status = b'{"error": "boom"}', 500
            with capture_logs() as logs:
                assert not await sync.poll_once(session)
            assert "HTTP 500" in logs[0]["problem"] and served(sync) == good
            await supervisor.stop()  # away
            with capture_logs() as logs:
                assert not await sync.poll_once(session)
            assert logs[0]["problem"].startswith("unreachable") and served(sync) == good

            # Back, with other keys and one replica failed: taken at the re-sync.
            supervisor.status = 200
            supervisor.body = RouteTable(
                models=(ModelRoutes("m", 2, True, (ReplicaRoute(
                    "m-g2", "http://127.0.0.1:9002", "secret-2"),)),),
                api_keys=frozenset({"key-b"}), failed=(("m-g1", "its node died"),)).to_json()
            await supervisor.start()
            with capture_logs() as logs:
                assert await sync.poll_once(session)
            assert logs[0]["event"] == "routes synced from the supervisor"
            assert served(sync) == ("m-g2", "secret-2", (), frozenset({"key-b"}))
            assert sync.relays.failure("m-g1") == "its node died"
            await supervisor.stop()

    asyncio.run(scenario())
    # Kept on disk for its owner only (it holds secrets and keys), in its newest form.
    assert routes_file.stat().st_mode & 0o777 == 0o600
    kept = RouteTable.from_json(routes_file.read_bytes())
    assert kept.api_keys == frozenset({"key-b"})

    # A front door restarted while the supervisor is down serves from the file.
    restarted = RouteSync(f"http://127.0.0.1:{free_port()}", None, routes_file, Relays())
    assert restarted.load()
    assert served(restarted) == ("m-g2", "secret-2", (), frozenset({"key-b"}))


def test_a_garbled_routes_file_is_refused_and_the_door_starts_with_none(tmp_path: Path):
    routes_file = tmp_path / "routes.json"
    routes_file.write_text('{"version": 1, "models": [{"id": ')
    sync = RouteSync("http://127.0.0.1:1", None, routes_file)
    with capture_logs() as logs:
        assert not sync.load()
    assert logs[0]["event"] == "routes file refused; no routes until the supervisor answers"
    assert "not JSON" in logs[0]["error"]
    assert sync.route("m").status == 404 and sync.models() == []
    assert not RouteSync("http://127.0.0.1:1", None, tmp_path / "none.json").load()


def _with_replica(**change) -> dict:
    body = TABLE.to_dict()
    body["models"][0]["replicas"][0].update(change)
    return body


def test_the_route_table_round_trips_and_refuses_what_is_not_one():
    assert RouteTable.from_json(TABLE.to_json()) == TABLE
    assert RouteTable.from_dict(json.loads(TABLE.to_json())).to_json() == TABLE.to_json()
    twice = TABLE.to_dict()
    twice["models"].append(twice["models"][0])
    with pytest.raises(RouteTableError, match="appears twice"):
        RouteTable.from_dict(twice)
    for bad in ({"parallel": 0}, {"serving": "yes"}, {"id": ""}, {"replicas": {}}):
        body = TABLE.to_dict()
        body["models"][0].update(bad)
        with pytest.raises(RouteTableError, match=r"models\[0\]"):
            RouteTable.from_dict(body)
    assert TABLE.without_loads().models[0].replicas[0].slots_in_use == 0
    assert RouteTable().route(None, Relays(), 0).status == 400


def test_the_supervisor_gives_its_routes_to_the_front_door_certificate_only(tmp_path: Path):
    """The real supervisor app (no front door of its own): the front-door certificate it
    made at its start reads the table with the client keys, kept across a restart that
    changed them; fleetctl's admin certificate is refused."""
    state_dir, ctl = tmp_path / "sup", tmp_path / "ctl"
    port = free_port()
    init_pki(state_dir, f"127.0.0.1:{port}", ctl)

    async def supervisor_with(keys: tuple[str, ...]) -> web.AppRunner:
        settings = SupervisorSettings(state_dir=state_dir, listen=f"127.0.0.1:{port}",
                                      front_door="", api_keys=keys, calibration_budget_s=0)
        runner = web.AppRunner(make_app(settings))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port,
                          ssl_context=server_context(settings)).start()
        return runner

    async def scenario() -> None:
        runner = await supervisor_with(("key-1",))
        creds = front_door_credentials(state_dir)
        assert creds.check().role == "front-door"
        assert (creds.directory / "supervisor_url").read_text().strip() == (
            f"https://127.0.0.1:{port}")
        assert creds.key_path.stat().st_mode & 0o777 == 0o600
        sync = RouteSync(f"https://127.0.0.1:{port}", client_context(creds),
                         tmp_path / "door" / "routes.json")
        async with aiohttp.ClientSession() as session:
            assert await sync.poll_once(session)
            assert sync.api_keys() == frozenset({"key-1"}) and sync.models() == []
            admin = RouteSync(f"https://127.0.0.1:{port}", client_context(
                NodeCredentials(ctl)), tmp_path / "admin.json")
            with capture_logs() as logs:
                assert not await admin.poll_once(session)
            assert "HTTP 403" in logs[0]["problem"] and "front-door" in logs[0]["problem"]
            await runner.cleanup()
            assert not await sync.poll_once(session)
            assert sync.api_keys() == frozenset({"key-1"})
            runner = await supervisor_with(("key-2", "key-3"))
            assert await sync.poll_once(session)
            assert sync.api_keys() == frozenset({"key-2", "key-3"})
            await runner.cleanup()

    asyncio.run(scenario())
