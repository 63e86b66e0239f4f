"""Engine lifecycle: spawn checks (pure), adoption plans, and the loop driving stand-in
engines through start, ready, drain, SIGKILL escalation and death at start."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from agent.engines import (
    Adopt,
    AdoptAndDrain,
    Discard,
    DrainEngine,
    EnginePhase,
    EngineView,
    RunRecord,
    decide,
    plan_adoption,
)
from agent.spawn import (
    CheckpointInfo,
    EngineSpec,
    SpawnRefused,
    SpawnRequest,
    check_spawn,
    read_checkpoint_info,
)
from tests.agent.conftest import (
    agent_config,
    client,
    fake_engine_command,
    free_port,
    pid_alive,
    serving,
    wait_state,
)
from tests.waiting import wait_until, wait_until_async

INFO = CheckpointInfo("/m", n_layers=4, weight_files=1)
CPU = frozenset({"torch-cpu", "mlx-cpu"})


def spec(engine_id: str = "e1", **variables: str) -> EngineSpec:
    """A stage read from a request whose contract is FLEET_MODEL=/m, FLEET_HTTP and
    `variables` (the agent's drain_s: 180)."""
    env = {"FLEET_MODEL": "/m", "FLEET_HTTP": "127.0.0.1:8100"} | variables
    return SpawnRequest(engine_id, env).spec(180.0)


def refused(engine_id: str = "e1", running=(), backends=CPU, **variables: str) -> SpawnRefused:
    """What refuses the request: the contract's reading or the node's checks."""
    with pytest.raises(SpawnRefused) as caught:
        check_spawn(spec(engine_id, **variables), INFO, backends, tuple(running))
    return caught.value


def test_check_spawn_accepts_a_sound_request():
    check_spawn(spec(), INFO, CPU, ())
    check_spawn(spec(FLEET_LAYERS="0:4"), INFO, CPU, ())


def test_check_spawn_refuses_by_variable(tmp_path):
    key = tmp_path / "link.key"
    key.write_bytes(b"k" * 32)
    assert refused(FLEET_LAYERS="2:9").field == "FLEET_LAYERS"
    assert "outside the model's 4 layers" in refused(FLEET_LAYERS="2:9").message
    assert refused(FLEET_LAYERS="3:2").field == "FLEET_LAYERS"  # the contract's own rule
    assert refused(FLEET_BACKEND="torch-cuda").field == "FLEET_BACKEND"
    assert refused(FLEET_BACKEND="torch-tpu").field == "FLEET_BACKEND"
    assert refused("bad id!").field == "engine_id"
    dup = refused(running=[spec(FLEET_HTTP="127.0.0.1:9")])
    assert (dup.field, dup.status) == ("engine_id", 409)
    clash = refused("e2", running=[spec()])
    assert (clash.field, clash.status) == ("FLEET_HTTP", 409)
    # rank 0's API binds its default address when the contract names none: that is taken too
    default = refused("e2", running=[spec(FLEET_HTTP="127.0.0.1:8000")], FLEET_HTTP="")
    assert (default.field, default.status) == ("FLEET_HTTP", 409)
    ring = dict(WORLD_SIZE="2", RANK="1", FLEET_LAYERS="2:4", FLEET_LISTEN="127.0.0.1:29501",
                FLEET_KEY_FILE=str(key))
    check_spawn(spec(FLEET_LAYOUT="0:2,2:4", **ring), INFO, CPU, ())
    assert refused(FLEET_LAYOUT="0:1,2:4", **ring).field == "FLEET_LAYOUT"
    assert refused(FLEET_LAYOUT="0:3,3:4", **ring).field == "FLEET_LAYOUT"
    assert refused(FLEET_LAYOUT="0:2,2:4", **dict(ring, FLEET_LISTEN="0.0.0.0:29501")).field == (
        "FLEET_LISTEN")
    assert refused(FLEET_LAYOUT="0:2,2:4", **dict(ring, FLEET_KEY_FILE="/nope")).field == (
        "FLEET_KEY_FILE")
    assert refused(FLEET_LAYOUT="0:2,2:4", **dict(ring, FLEET_KEY_FILE="")).field == (
        "FLEET_KEY_FILE")


def test_the_agents_drain_s_fills_only_a_contract_that_sets_none():
    assert SpawnRequest("e", {"FLEET_MODEL": "/m"}).spec(42.0).engine.drain_s == 42.0
    named = SpawnRequest("e", {"FLEET_MODEL": "/m", "FLEET_DRAIN_S": "0.5"}).spec(42.0)
    assert named.engine.drain_s == 0.5
    assert named.engine.to_environ()["FLEET_DRAIN_S"] == "0.5"  # what the engine is told


def test_read_checkpoint_info_refuses_what_is_not_a_checkpoint(tmp_path, tiny_model):
    assert read_checkpoint_info(str(tiny_model)).n_layers == 4
    with pytest.raises(SpawnRefused, match="no such checkpoint directory"):
        read_checkpoint_info(str(tmp_path / "missing"))
    with pytest.raises(SpawnRefused, match="config.json: missing"):
        read_checkpoint_info(str(tmp_path))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(SpawnRefused, match="no \\*.safetensors"):
        read_checkpoint_info(str(tmp_path))


def test_a_request_names_its_bad_field_or_variable():
    def refusal(raw) -> SpawnRefused:
        with pytest.raises(SpawnRefused) as caught:
            SpawnRequest.from_dict(raw).spec(180.0)
        return caught.value

    env = {"FLEET_MODEL": "/m"}
    assert str(refusal({"engine_id": "x"})) == "env: is required"
    assert str(refusal({"env": env})) == "engine_id: is required"
    assert refusal({"engine_id": "x", "env": env, "colour": "red"}).field == "colour"
    # an older supervisor's request of fields: refused, naming where the settings went
    old = refusal({"engine_id": "x", "model_dir": "/m"})
    assert old.field == "model_dir" and "go in env, by their variables" in old.message
    assert str(refusal({"engine_id": "x", "env": {"FLEET_CONTXT": "8"} | env})) == (
        "FLEET_CONTXT: not a variable of the engine's contract (did you mean FLEET_CONTEXT?)")
    assert str(refusal({"engine_id": "x", "env": {"RANK": 0} | env})) == (
        "RANK: expected a string, got 0")
    assert refusal({"engine_id": "x", "env": ["FLEET_MODEL=/m"]}).field == "env"
    assert refusal({"engine_id": "x", "env": {"RANK": "x"} | env}).field == "RANK"
    assert str(refusal({"engine_id": "x", "env": {}})) == "env: is required"
    assert str(refusal({"engine_id": "x", "env": {"FLEET_PARALLEL": "4"}})) == (
        "FLEET_MODEL: FLEET_MODEL is not set")
    both = refusal({"engine_id": "x", "link_key": "ab" * 16,
                    "env": {"FLEET_KEY_FILE": "/k"} | env})
    assert both.field == "link_key" and "not both" in both.message


def test_a_run_record_keeps_the_contract_and_an_older_agents_is_refused_by_name(tmp_path):
    secret = tmp_path / "api"
    secret.write_text("s" * 32)
    kept = spec(FLEET_API_SECRET_FILE=str(secret), FLEET_DRAIN_S="7.5")
    record = RunRecord(kept, 123, 1.0, 2.0, "/l", 1)
    raw = record.to_dict()
    assert raw["spec"]["env"]["FLEET_API_SECRET_FILE"] == str(secret)
    assert "s" * 32 not in str(raw)
    secret.unlink()  # read back without its secret: the engine read it at start
    back = RunRecord.from_dict(raw)
    assert back.spec.engine.drain_s == 7.5 and back.spec.engine.api_secret_file == secret
    assert kept.engine.api_secret == ""  # checked at spawn, then left to the engine
    assert back == record
    older = dict(raw, spec={"engine_id": "e1", "model_dir": "/m", "rank": 0})
    with pytest.raises(ValueError, match="from an agent before the contract travelled whole"):
        RunRecord.from_dict(older)


def test_plan_adoption_and_decide_are_pure():
    rec = RunRecord(spec(), 123, 1.0, 1.0, "/l", 1)
    other = RunRecord(spec("e2"), 124, 1.0, 1.0, "/l", 1)
    alive = {"e1": True, "e2": False}
    assert plan_adoption((rec, other), alive, True) == [
        Adopt(rec), Discard(other, "exited while the agent was not running")]
    assert plan_adoption((rec,), alive, False) == [AdoptAndDrain(rec)]
    now = time.time()
    starting = EngineView(spec(), EnginePhase.STARTING, 1, now - 100, "/l")
    ready = EngineView(spec("e2"), EnginePhase.READY, 2, now - 100, "/l")
    assert decide((starting, ready), now, 60.0) == [DrainEngine("e1", "not ready 60 s after start",
                                                                0.0)]
    assert decide((starting,), now, 600.0) == []


def test_stand_in_engines_start_drain_escalate_and_die(fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path, engine_command=fake_engine_command())

    async def lifecycle(session, url: str, engine_id: str, manners: str):
        body = dict(engine_id=engine_id, env={"FLEET_MODEL": str(tiny_model),
                                              "FLEET_MODEL_ID": manners,
                                              "FLEET_HTTP": f"127.0.0.1:{free_port()}"})
        async with session.post(url + "/v1/engines", json=body) as r:
            assert r.status == 201, await r.text()
            assert (await r.json())["state"] == "starting"
        view = await wait_state(session, url, engine_id, {"ready", "exited"}, 30)
        if view["state"] == "ready":
            async with session.post(f"{url}/v1/engines/{engine_id}/drain",
                                    json={"drain_s": 0.5}) as r:
                assert r.status == 202
                assert (await r.json())["state"] == "draining"
            view = await wait_state(session, url, engine_id, {"exited"}, 30)
        async with session.get(url + "/v1/events") as r:
            states = [e["state"] for e in (await r.json())["events"]
                      if e["engine_id"] == engine_id]
        async with session.get(url + "/v1/health") as r:
            assert r.status == 200  # the agent itself keeps running
        assert not pid_alive(view["pid"])
        assert not (config.run_dir / f"{engine_id}.json").exists()
        return view, states

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            view, states = await lifecycle(session, url, "polite", "")
            assert states == ["starting", "ready", "draining", "exited"]
            assert (view["exit"]["code"], view["exit"]["reason"]) == (0, "drained")

            started = time.monotonic()
            view, _ = await lifecycle(session, url, "stubborn", "--ignore-term")
            assert view["exit"]["signal"] == "SIGKILL"
            assert view["exit"]["stopped_by"] == "SIGKILL"
            assert "did not exit within 2.5 s" in view["exit"]["reason"]
            assert time.monotonic() - started < 20

            view, states = await lifecycle(session, url, "dies", "--die")
            assert states == ["starting", "exited"]
            assert (view["exit"]["code"], view["exit"]["reason"]) == (3, "told to die at start")

    asyncio.run(scenario())


def test_no_orphans_a_drained_engine_takes_its_process_group_with_it(fleet, tmp_path,
                                                                      tiny_model):
    config = agent_config(fleet, tmp_path,
                          engine_command=fake_engine_command("--spawn-grandchild"))

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            async with session.post(url + "/v1/engines", json=dict(
                    engine_id="parent", env={"FLEET_MODEL": str(tiny_model),
                                             "FLEET_HTTP": f"127.0.0.1:{free_port()}"})) as r:
                assert r.status == 201
            await wait_state(session, url, "parent", {"ready"}, 30)
            async with session.get(url + "/v1/engines/parent/log") as r:
                lines = (await r.json())["lines"]
            grandchild = next(int(line.split('"pid": ')[1].rstrip("}")) for line in lines
                              if "grandchild" in line)
            assert pid_alive(grandchild)
            async with session.post(url + "/v1/engines/parent/drain", json={}) as r:
                assert r.status == 202
            await wait_state(session, url, "parent", {"exited"}, 30)
            await wait_until_async(lambda: not pid_alive(grandchild), within_s=5,
                                   what="the grandchild gone with its engine")

    asyncio.run(scenario())


def test_bad_spawn_requests_are_refused_with_a_reason(fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path, engine_command=fake_engine_command())

    async def scenario():
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        async with serving(config) as url, client(fleet) as session:
            model = {"FLEET_MODEL": str(tiny_model)}
            cases = [
                (dict(engine_id="a", env=model | {"FLEET_HTTP": f"127.0.0.1:{port}"}),
                 409, "FLEET_HTTP", "in use"),
                (dict(engine_id="b", env={"FLEET_MODEL": str(Path(tiny_model) / "nope")}), 422,
                 "FLEET_MODEL", "no such checkpoint"),
                (dict(engine_id="c", env=model | {"FLEET_LAYERS": "1:7"}), 422, "FLEET_LAYERS",
                 "outside the model's 4 layers"),
                (dict(engine_id="d", env=model | {"FLEET_BACKEND": "mlx-metal"}), 422,
                 "FLEET_BACKEND", "not available"),
                (dict(engine_id="e", env=model, link_key="not hex"), 422, "link_key", "hex"),
                (dict(engine_id="f", env=model, link_key="abcd"), 422, "link_key",
                 "at least 16"),
                (dict(engine_id="g", env=model | {"FLEET_CONTEXT": "lots"}), 422,
                 "FLEET_CONTEXT", "expected an integer"),
                (dict(engine_id="h", model_dir=str(tiny_model)), 422, "model_dir",
                 "unknown field"),
            ]
            for body, status, field, words in cases:
                async with session.post(url + "/v1/engines", json=body) as r:
                    error = (await r.json())["error"]
                    assert (r.status, error["field"]) == (status, field), error
                    assert words in error["message"]
            async with session.post(url + "/v1/engines", data=b"{not json") as r:
                assert r.status == 400
            async with session.get(url + "/v1/engines") as r:
                assert (await r.json())["engines"] == []
        busy.close()

    asyncio.run(scenario())


def test_after_a_restart_engines_are_ended_when_adoption_is_off_and_dead_ones_forgotten(
        fleet, tmp_path, tiny_model):
    import json
    import os
    import subprocess

    import psutil

    config = agent_config(fleet, tmp_path, engine_command=fake_engine_command(),
                          adopt_engines=False)
    config.run_dir.mkdir(parents=True)
    config.logs_dir.mkdir(parents=True)
    left_behind = {}
    # Engines an earlier agent started and left running; one of them it was draining (its
    # SIGTERM went out) and it will not go by itself.
    for engine_id, flags in (("left", ()), ("draining", ("--ignore-term",))):
        log_path = config.logs_dir / f"engine-{engine_id}.log"
        with open(log_path, "ab") as log:
            left_behind[engine_id] = subprocess.Popen(
                fake_engine_command(*flags), stdout=log, stderr=log, start_new_session=True,
                env=dict(os.environ))
        # Up and handling SIGTERM, as a long-running engine would be.
        wait_until(lambda path=log_path: b'"ready"' in path.read_bytes(), within_s=10,
                   what=f"{engine_id}'s fake engine ready")
    gone = subprocess.Popen(["true"])
    gone.wait()
    for engine_id, pid, created, drain_started_at in (
            ("left", left_behind["left"].pid,
             psutil.Process(left_behind["left"].pid).create_time(), None),
            ("draining", left_behind["draining"].pid,
             psutil.Process(left_behind["draining"].pid).create_time(), time.time() - 60),
            ("gone", gone.pid, time.time() - 5, None)):
        # as the earlier agent started them: with its drain_s, which the record keeps
        started = SpawnRequest(engine_id, {"FLEET_MODEL": str(tiny_model)}).spec(config.drain_s)
        record = RunRecord(started, pid, created,
                           time.time(), str(config.logs_dir / f"engine-{engine_id}.log"), 1,
                           ready_at=time.time() - 100, drain_started_at=drain_started_at)
        (config.run_dir / f"{engine_id}.json").write_text(json.dumps(record.to_dict()))

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            view = await wait_state(session, url, "left", {"exited"}, 30)
            assert view["adopted"] and view["exit"]["reason"] == "drained"
            async with session.get(url + "/v1/events") as r:
                events = (await r.json())["events"]
            draining = [e for e in events if e["state"] == "draining" and e["engine_id"] == "left"]
            assert "adopt_engines is off" in draining[0]["detail"]["reason"]
            # The drain an earlier agent started is seen through: SIGKILL once its time is up,
            # and no second SIGTERM (which would mean "stop now" to a real engine).
            view = await wait_state(session, url, "draining", {"exited"}, 30)
            assert view["exit"]["stopped_by"] == "SIGKILL"
            assert b"ignoring SIGTERM" not in Path(view["log_path"]).read_bytes()
            async with session.get(url + "/v1/engines") as r:
                assert sorted(e["engine_id"] for e in (await r.json())["engines"]) == [
                    "draining", "left"]
        assert sorted(config.run_dir.glob("*.json")) == []

    try:
        asyncio.run(scenario())
    finally:
        for proc in left_behind.values():
            proc.kill()
            proc.wait(10)


def test_a_link_key_sent_in_the_spawn_lands_in_a_private_file_and_nowhere_else(
        fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path, engine_command=fake_engine_command())
    key = "ab" * 32

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            body = dict(engine_id="ringed", link_key=key, env={
                "FLEET_MODEL": str(tiny_model), "WORLD_SIZE": "2", "RANK": "1",
                "FLEET_LAYERS": "2:4", "FLEET_LAYOUT": "0:2,2:4",
                "FLEET_LISTEN": f"127.0.0.1:{free_port()}"})
            async with session.post(url + "/v1/engines", json=body) as r:
                assert r.status == 201, await r.text()
                view = await r.json()
            assert "link_key" not in view["spec"]
            key_file = Path(view["spec"]["env"]["FLEET_KEY_FILE"])
            assert key_file.read_text() == key
            assert key_file.stat().st_mode & 0o077 == 0
            assert key not in (config.run_dir / "ringed.json").read_text()
            async with session.post(f"{url}/v1/engines/ringed/drain", json={"drain_s": 0.5}):
                pass
            await wait_state(session, url, "ringed", {"exited"}, 30)

    asyncio.run(scenario())
