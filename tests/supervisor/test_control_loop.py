"""The control loop's spawn request carries each stage's environment contract whole, which
the agent reads back with the engine's own parser, with the stage's addresses (an IPv6
node's in brackets), its model's kernel settings and the pool of KV pages placement charged;
its /health probe tells an answer (a 503 "draining" too) from none."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl

import aiohttp
from aiohttp import web

from agent.spawn import SpawnRequest
from engine.backends.base import StageSpec
from engine.env import KERNEL_KNOBS, EngineEnv
from engine.harness.launch import free_port
from supervisor import lifecycle as lc
from supervisor.agents import AgentClient
from supervisor.control_loop import Supervisor
from supervisor.settings import SupervisorSettings
from tests.supervisor.test_lifecycle import config, snap


def test_the_spawn_body_reads_back_as_each_stage_contract(tmp_path):
    supervisor = Supervisor(SupervisorSettings(state_dir=tmp_path, calibration_budget_s=0),
                            AgentClient(ssl.create_default_context()))
    supervisor.desired = config()
    stages = (lc.StageRecord(0, "a", "torch-cpu", (0, 4), "demo-g1-r0", "::1", 9000, 9001),
              lc.StageRecord(1, "b", "mlx-cpu", (4, 8), "demo-g1-r1", "10.0.0.2", 9002))
    replica = lc.Replica("demo-g1", "demo", 1, lc.STARTING, 0.0, "d", stages=stages,
                         master_port=9003, placement_id="0-4@torch-cpu,4-8@mlx-cpu")
    key = tmp_path / "link.key"
    key.write_text("k" * 32)
    envs = []
    for stage in stages:
        body = supervisor.spawn_body(replica, stage)
        request = SpawnRequest.from_dict(body)
        assert set(body) == {"engine_id", "replica", "env", "link_key", "api_secret"}
        assert (request.engine_id, request.replica) == (stage.engine_id, "demo-g1")
        assert len(request.link_key) == 64 and (request.api_secret != "") == (stage.rank == 0)
        # the agent keeps the secrets in files of its own before it reads the contract
        spec = SpawnRequest(request.engine_id, request.env).spec(
            drain_s=1.0, key_file=key)
        envs.append(spec.engine)
        # what the engine is started with is what the supervisor wrote
        assert EngineEnv.from_environ(body["env"] | {"FLEET_KEY_FILE": str(key)}) == spec.engine
    rank0, rank1 = envs
    assert rank0.listen == ("::1", 9000) and rank0.http == ("::1", 9001)
    assert rank1.listen == ("10.0.0.2", 9002) and rank1.master == ("::1", 9003)
    assert rank0.layout == rank1.layout == ((0, 4), (4, 8))
    assert (rank0.model_id, rank0.context, rank0.placement) == (
        "demo", 1024, "0-4@torch-cpu,4-8@mlx-cpu")
    # the policy's drain, even at its default: not the agent's (1.0 here)
    assert rank0.drain_s == rank1.drain_s == supervisor.settings.policy.drain_s
    # a model without `kernels:` runs the engine's defaults, none of them written
    assert all(getattr(env, attr) == EngineEnv.__dataclass_fields__[attr].default
               for env in envs for attr in KERNEL_KNOBS)


def test_a_models_kernels_reach_every_stages_contract(tmp_path):
    supervisor = Supervisor(SupervisorSettings(state_dir=tmp_path, calibration_budget_s=0),
                            AgentClient(ssl.create_default_context()))
    kernels = (("quant", "dense"), ("compile", "off"), ("delta_kernel", "torch"),
               ("decode_attention", "sdpa"), ("packed_kernel", "int4"),
               ("prompt_attention", "cudnn"), ("cuda_graphs", False))
    desired = config()
    spec = dataclasses.replace(desired.models[0], kernels=kernels)
    supervisor.desired = dataclasses.replace(desired, models=(spec,))
    stages = (lc.StageRecord(0, "a", "torch-cpu", (0, 4), "demo-g1-r0", "::1", 9000, 9001),
              lc.StageRecord(1, "b", "torch-cpu", (4, 8), "demo-g1-r1", "10.0.0.2", 9002))
    replica = lc.Replica("demo-g1", "demo", 1, lc.STARTING, 0.0, "d", stages=stages,
                         master_port=9003, placement_id="0-4@torch-cpu,4-8@torch-cpu")
    key = tmp_path / "link.key"
    key.write_text("k" * 32)
    for stage in stages:
        body = supervisor.spawn_body(replica, stage)
        assert body["env"]["FLEET_DECODE_ATTENTION"] == "sdpa"
        assert body["env"]["FLEET_CUDA_GRAPHS"] == "0"
        # read back as the agent does, and as the engine then does from what the agent wrote
        engine = SpawnRequest.from_dict(body).spec(drain_s=1.0, key_file=key).engine
        assert {attr: getattr(engine, attr) for attr in KERNEL_KNOBS} == dict(kernels)
        assert EngineEnv.from_environ(engine.to_environ()) == engine


def test_the_pool_placement_charged_reaches_every_stage_it_starts(tmp_path):
    """fleet.yaml's kv_pages: placed, recorded on the replica, written into each stage's
    contract, read back by the agent and made the engine's stage spec."""
    supervisor = Supervisor(SupervisorSettings(state_dir=tmp_path, calibration_budget_s=0),
                            AgentClient(ssl.create_default_context()))
    desired = config()  # the demo: a context of 1024 positions, 16 pages
    spec = dataclasses.replace(desired.models[0], kv_pages=24)
    desired = dataclasses.replace(desired, models=(spec,))
    supervisor.desired = desired
    placing = lc.decide(snap([], cfg=desired))[0].replica
    [start] = lc.decide(snap([placing], cfg=desired))
    assert start.placement.kv_pages == start.replica.kv_pages == 24
    key = tmp_path / "link.key"
    key.write_text("k" * 32)
    for stage in start.replica.stages:
        body = supervisor.spawn_body(start.replica, stage)
        assert body["env"]["FLEET_KV_PAGES"] == "24"
        engine = SpawnRequest.from_dict(body).spec(drain_s=1.0, key_file=key).engine
        assert engine.kv_pages == 24 and EngineEnv.from_environ(engine.to_environ()) == engine
        assert StageSpec.of(engine, 8).kv_pages == 24
    # Whole windows write nothing: the engine's default.
    plain = dataclasses.replace(start.replica, kv_pages=0)
    supervisor.desired = config()
    assert "FLEET_KV_PAGES" not in supervisor.spawn_body(plain, plain.stages[0])["env"]


def test_the_health_probe_tells_a_draining_answer_from_silence():
    """Only no answer is silence (what fails a frozen rank 0): a 503 "draining" and a body
    that is not JSON are answers; a reply that never comes and a refused connection are not."""
    answering = {"kind": "ok"}

    async def health(request: web.Request) -> web.Response:
        kind = answering["kind"]
        if kind == "draining":
            return web.json_response({"status": "draining", "in_flight": 1}, status=503)
        if kind == "garbled":
            return web.Response(text="<html>", status=200)
        if kind == "frozen":
            await asyncio.Event().wait()  # as a stopped process: the connection open, mute
        return web.json_response({"status": "ok", "slots_in_use": 0})

    def replica(port: int) -> lc.Replica:
        stage = lc.StageRecord(0, "a", "torch-cpu", (0, 8), "demo-g1-r0", "127.0.0.1", 1, port)
        return lc.Replica("demo-g1", "demo", 1, lc.SERVING, 0.0, "d", stages=(stage,))

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        answers = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            for kind in ("ok", "draining", "garbled", "frozen"):
                answering["kind"] = kind
                answers[kind] = await Supervisor._health(session, replica(port))
            await runner.cleanup()
            answers["refused"] = await Supervisor._health(session, replica(port))
        assert answers["ok"] == (True, True, {"status": "ok", "slots_in_use": 0})
        assert answers["draining"] == (True, False, {"status": "draining", "in_flight": 1})
        assert answers["garbled"] == (True, True, None)
        assert answers["frozen"] == answers["refused"] == (False, False, None)

    asyncio.run(scenario())
