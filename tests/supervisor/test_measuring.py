"""Measurements kept in the state: read back by a new Measurer (a restarted supervisor)
and reused, measured again when stale or when the node's backend versions change."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.checkpoint.maker import PRESETS, config_json
from supervisor.agents import AgentError
from supervisor.fleet_config import parse_fleet_config
from supervisor.measurements import NodeTiming, timing_key
from supervisor.measuring import (
    CALIBRATION,
    PROBE,
    Measurer,
    backend_versions,
    link_versions,
    why_measure_again,
)
from supervisor.membership import ALIVE, Member
from supervisor.placement import LayerTypeMs, LinkSnapshot
from supervisor.state import State, StoredMeasurement


def test_why_measure_again():
    assert why_measure_again("torch 2.5", "torch 2.5", 100.0, 150.0, 60.0) == ""
    assert why_measure_again("torch 2.5", "torch 2.6", 100.0, 101.0, 60.0) == \
        "measured with torch 2.5, now torch 2.6"
    assert why_measure_again("torch 2.5", "torch 2.5", 100.0, 161.0, 60.0) == \
        "61 s old (more than 60 s)"
    assert why_measure_again("torch 2.5", "", 100.0, 101.0, 60.0) == ""  # facts not in yet


def member(name: str, torch_version: str = "2.5.0", hostname: str = "") -> Member:
    facts = {"engine_version": "0.3", "host": {"hostname": hostname or f"host-{name}"},
             "backends": [
        {"backend": "torch-cpu", "framework": "torch", "framework_version": torch_version,
         "present": True, "devices": [{"memory_usable_bytes": 8 << 30}]}]}
    return Member(name, f"https://127.0.0.1:{7700 + ord(name)}", ALIVE, 0.0, 0.0, facts, "d")


@pytest.fixture
def fleet(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config_json(PRESETS["demo"])))
    return parse_fleet_config(f"""
version: 1
supervisor: {{address: "127.0.0.1:7400", state_dir: {tmp_path}}}
nodes: [{{name: a}}, {{name: b}}]
models:
  - {{id: m, checkpoint: {tmp_path / "m"}, backends: [torch-cpu], context: 256}}
""")


def started(measurer: Measurer, fleet, members) -> list[str]:
    """What `start_missing` sets running (the coroutines are closed, not run)."""
    before = set(measurer.running)
    measurer.start_missing(fleet, members, lambda coro: coro.close())
    return sorted(map(str, set(measurer.running) - before))


def test_a_new_measurer_reuses_what_the_state_keeps(tmp_path: Path, fleet):
    spec = fleet.model("m")
    members = {"a": member("a"), "b": member("b")}
    key = timing_key(spec, "a", "torch-cpu")
    timing = NodeTiming(1.0, 2.0, 30.0, (LayerTypeMs("full_attention", 1.0, 2.0, 30.0),))
    state = State(tmp_path / "s" / "supervisor.sqlite")
    now = time.time()
    state.put_measurement(StoredMeasurement(key, CALIBRATION,
                                            backend_versions(members["a"], "torch-cpu"), now,
                                            asdict(timing)))
    state.put_measurement(StoredMeasurement(timing_key(spec, "b", "torch-cpu"), CALIBRATION,
                                            backend_versions(members["b"], "torch-cpu"), now,
                                            asdict(NodeTiming(1.5, 2.5, 35.0))))
    state.put_measurement(StoredMeasurement(
        "a -> b", PROBE, link_versions(members["a"], members["b"]), now,
        vars(LinkSnapshot("b", 0.3, 1e9))))
    state.close()

    state = State(tmp_path / "s" / "supervisor.sqlite")  # as a restarted supervisor opens it
    measurer = Measurer(None, 5.0, 60.0, lambda *_: None, store=state,  # type: ignore[arg-type]
                        max_age_s=3600.0)
    assert measurer.timings[key] == timing
    assert measurer.snapshot().link("b", "a") == LinkSnapshot("a", 0.3, 1e9)
    assert measurer.reused.startswith("reusing 2 calibration(s) and 1 link probe(s)")
    assert started(measurer, fleet, members) == []  # nothing is measured again
    shown = measurer.to_dict()["calibrations"][key]
    assert shown["versions"] == "torch 2.5.0, engine 0.3" and shown["age_s"] >= 0

    upgraded = dict(members, a=member("a", torch_version="2.6.0"))
    assert started(measurer, fleet, upgraded) == [key]  # a's torch changed: a only
    assert measurer.again[key] == ("measured with torch 2.5.0, engine 0.3, now torch 2.6.0, "
                                   "engine 0.3")
    assert measurer.timings[key] == timing  # placement keeps the old numbers meanwhile

    stale = Measurer(None, 5.0, 60.0, lambda *_: None, store=state,  # type: ignore[arg-type]
                     max_age_s=1e-9)
    assert started(stale, fleet, members) == sorted([key, timing_key(spec, "b", "torch-cpu")])
    assert set(stale.again) == {key, timing_key(spec, "b", "torch-cpu"), "a -> b"}  # the
    # probe is due too; it waits for the machines' calibrations


def test_a_record_the_code_cannot_read_is_measured_again(tmp_path: Path, fleet):
    spec = fleet.model("m")
    state = State(tmp_path / "supervisor.sqlite")
    key = timing_key(spec, "a", "torch-cpu")
    state.put_measurement(StoredMeasurement(key, CALIBRATION, "x", 0.0, {"decode": 1}))
    measurer = Measurer(None, 5.0, 60.0, lambda *_: None, store=state)  # type: ignore[arg-type]
    assert key not in measurer.timings and measurer.reused == ""
    members = {"a": member("a")}
    assert started(measurer, fleet, members) == [key]


def test_agents_on_one_machine_are_measured_one_at_a_time(fleet):
    spec = fleet.model("m")
    members = {"a": member("a", hostname="box"), "b": member("b", hostname="box")}
    measurer = Measurer(None, 5.0, 60.0, lambda *_: None)  # type: ignore[arg-type]
    key_a, key_b = (timing_key(spec, n, "torch-cpu") for n in ("a", "b"))
    assert started(measurer, fleet, members) == [key_a]
    assert measurer.snapshot().pending == {"a", "b"}  # b waits, and placement with it
    assert measurer.to_dict()["waiting"] == ["a", "b"]  # b's calibration; the a-b probe
    assert started(measurer, fleet, members) == []  # a's still runs

    del measurer.running[key_a]  # a's calibration is in
    measurer.timings[key_a] = NodeTiming(1.0, 2.0, 30.0)
    assert started(measurer, fleet, members) == [key_b]
    del measurer.running[key_b]
    measurer.timings[key_b] = NodeTiming(1.0, 2.0, 30.0)
    assert started(measurer, fleet, members) == [str(("a", "b"))]  # the probe last

    apart = {"a": member("a"), "b": member("b")}  # two machines: calibrated at once (the
    # probe, which uses both, follows them)
    assert started(Measurer(None, 5.0, 60.0, lambda *_: None),  # type: ignore[arg-type]
                   fleet, apart) == [key_a, key_b]


def test_a_models_kernels_are_what_its_calibrations_time(fleet):
    """The request the agent gets names the kernels the model's engines run (the agent's
    own parser reads them back), and their key is not the default kernels' key."""
    import asyncio
    import dataclasses

    from agent.calibrate import CalibrationRequest

    kernels = (("quant", "dense"), ("compile", "off"), ("delta_kernel", "torch"),
               ("decode_attention", "sdpa"), ("packed_kernel", "int4"),
               ("prompt_attention", "cudnn"), ("cuda_graphs", False))
    spec = dataclasses.replace(fleet.model("m"), kernels=kernels)
    desired = dataclasses.replace(fleet, models=(spec,))
    asked = []

    class Agents:
        async def call(self, node, method, url, body=None):
            asked.append(body)
            return {"state": "done", "result": {"timings": [
                {"kind": kind, "context": 256, "rows": rows, "ms_per_layer": 1.0, "runs": 1,
                 "spread_ms": 0.0} for kind, rows in (("decode", 1), ("prefill", 512))]}}

    async def measure() -> None:
        tasks = []
        measurer.start_missing(desired, {"a": member("a")},
                               lambda coro: tasks.append(asyncio.ensure_future(coro)))
        await asyncio.gather(*tasks)

    measurer = Measurer(Agents(), 5.0, 60.0, lambda *_: None)  # type: ignore[arg-type]
    asyncio.run(measure())
    request = CalibrationRequest.from_dict(asked[0])
    assert (request.quant_mode, request.compile, request.delta_kernel, request.cuda_graphs,
            request.decode_attention, request.packed_kernel, request.prompt_attention) == (
        "dense", "off", "torch", False, "sdpa", "int4", "cudnn")
    key = timing_key(spec, "a", "torch-cpu")
    assert key in measurer.timings and key != timing_key(fleet.model("m"), "a", "torch-cpu")
    # a model without kernel settings asks for the defaults by sending none
    measurer = Measurer(Agents(), 5.0, 60.0, lambda *_: None)  # type: ignore[arg-type]
    desired = fleet
    asked.clear()
    asyncio.run(measure())
    assert CalibrationRequest.from_dict(asked[0]).stage_options() == \
        CalibrationRequest(config={}).stage_options()
    assert not set(asked[0]) & {"quant_mode", "compile", "delta_kernel", "cuda_graphs",
                                "decode_attention", "packed_kernel", "prompt_attention"}


class RefusingAgents:
    """Agents whose every call fails (an injected fault), keeping the bodies they were sent."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def call(self, node: str, method: str, url: str, body: dict | None = None) -> dict:
        self.bodies.append(dict(body or {}))
        raise AgentError(node, "refused (injected)")


def test_a_remeasure_is_forced_and_one_that_fails_keeps_the_figures_without_a_retry(fleet):
    spec = fleet.model("m")
    members = {"a": member("a")}
    key = timing_key(spec, "a", "torch-cpu")
    timing = NodeTiming(1.0, 2.0, 30.0)
    agents, said = RefusingAgents(), []
    measurer = Measurer(agents, 5.0, 60.0,  # type: ignore[arg-type]
                        lambda done, node: said.append(done))
    measurer.timings[key] = timing
    assert measurer.remeasure({"a"}, "asked by the operator") == [key]
    runs: list = []
    measurer.start_missing(fleet, members, runs.append)
    assert len(runs) == 1
    asyncio.run(runs[0])
    assert agents.bodies[0]["force"] is True  # past the agent's cache of calibrations
    assert measurer.timings[key] == timing  # placement keeps the figures it had
    assert said == [("a: calibration failed, keeping the figures measured before: "
                     "agent a: refused (injected)")]
    assert started(measurer, fleet, members) == []  # not asked again on every tick
