"""Links with their torch.distributed path: a probe's answer read into a link, the probes the
supervisor asks for (the path only where a hop would take it), and placement costing a hop
on that path's numbers, against the hop cost written out by hand."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.checkpoint.maker import PRESETS, config_json
from supervisor.fleet_config import parse_fleet_config
from supervisor.measurements import NodeTiming, link_from_probe, timing_key
from supervisor.measuring import Measurer, dist_path
from supervisor.placement import LinkSnapshot, place
from tests.supervisor.test_measuring import member
from tests.supervisor.test_placement import SHAPE, node, spec

TCP = {"rtt_ms": 0.4, "bandwidth_bytes_per_s": 1e9}


def test_a_probes_answer_with_its_dist_path_becomes_a_link():
    gloo = dict(TCP, dist={"transport": "gloo", "rtt_ms": 0.2, "bandwidth_bytes_per_s": 3e9})
    assert link_from_probe("b", gloo, "gloo") == (LinkSnapshot("b", 0.4, 1e9, "gloo", 0.2, 3e9),
                                                   "")
    assert link_from_probe("b", gloo, "") == (LinkSnapshot("b", 0.4, 1e9), "")
    failed = dict(TCP, dist={"transport": "nccl", "error": "no CUDA"})
    link, why = link_from_probe("b", failed, "nccl")
    assert link == LinkSnapshot("b", 0.4, 1e9, "nccl") and why == "no CUDA"
    assert link.path("nccl") == (0.4, 1e9)  # not measured: the TCP link's numbers
    link, why = link_from_probe("b", TCP, "gloo")  # an agent that does not know the field
    assert link.dist_transport == "gloo" and "did not measure gloo" in why


def test_a_hop_on_torch_distributed_is_costed_on_that_paths_numbers():
    def hop_ms(backend: str, transport: str) -> float:
        """Rank 0's hop when two nodes, each too small for the model alone, share it over a
        slow TCP link whose NCCL path is fast."""
        nodes = [replace(node(name, 100, backend=backend),
                         links=(LinkSnapshot(peer, 2.0, 1e8, "nccl", 0.05, 2e10),))
                 for name, peer in (("a", "b"), ("b", "a"))]
        placed = place(spec(rank0="a", hop_transport=transport), SHAPE, nodes)
        assert [s.node for s in placed.stages] == ["a", "b"], placed.why
        return placed.stages[0].hop_decode_ms

    def by_hand(rtt_ms: float, bandwidth: float) -> float:
        return rtt_ms / 2 + spec().parallel * SHAPE.row_bytes / bandwidth * 1000

    assert hop_ms("torch-cuda", "dist") == pytest.approx(by_hand(0.05, 2e10))
    assert hop_ms("torch-cuda", "tcp") == pytest.approx(by_hand(2.0, 1e8))
    # auto keeps CUDA hops on TCP for now, and with them the TCP numbers.
    assert hop_ms("torch-cuda", "auto") == pytest.approx(by_hand(2.0, 1e8))
    # The path measured is NCCL's: a gloo hop (CPU stages) has no measurement of its own.
    assert hop_ms("torch-cpu", "dist") == pytest.approx(by_hand(2.0, 1e8))


@pytest.fixture
def fleet(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config_json(PRESETS["demo"])))

    def config(transport: str):
        return parse_fleet_config(f"""
version: 1
supervisor: {{address: "127.0.0.1:7400", state_dir: {tmp_path}}}
nodes: [{{name: a}}, {{name: b}}]
models:
  - {{id: m, checkpoint: {tmp_path / "m"}, backends: [torch-cpu], context: 256,
     hop_transport: {transport}}}
""")
    return config


def probes_started(measurer: Measurer, config, members) -> dict[str, str]:
    """link key -> the torch.distributed path each probe `start_missing` starts asks for
    (the coroutines are read, then closed, not run)."""
    asked: dict[str, str] = {}

    def spawn(coro) -> None:
        if coro.cr_code.co_name == "_probe":
            local = coro.cr_frame.f_locals
            asked[f"{local['a']} -> {local['b']}"] = local["dist"]
        coro.close()

    measurer.start_missing(config, members, spawn)
    return asked


def test_the_supervisor_probes_the_dist_path_only_where_a_hop_would_take_it(fleet):
    assert dist_path(fleet("dist").model("m"), "torch-cpu", "torch-cpu") == "gloo"
    assert dist_path(fleet("dist").model("m"), "torch-cpu", "mlx-cpu") == ""
    assert dist_path(fleet("auto").model("m"), "torch-cuda", "torch-cuda") == ""
    assert dist_path(fleet("dist").model("m"), "torch-cuda", "torch-cuda") == "nccl"
    members = {"a": member("a"), "b": member("b")}

    def measurer(link: LinkSnapshot | None) -> Measurer:
        made = Measurer(None, 5.0, 60.0, lambda *_: None)  # type: ignore[arg-type]
        for name in ("a", "b"):  # calibrated already: only the probe is left to start
            made.timings[timing_key(fleet("dist").model("m"), name, "torch-cpu")] = \
                NodeTiming(1.0, 2.0, 30.0)
        if link is not None:
            made.links[("a", "b")] = link
        return made

    assert probes_started(measurer(None), fleet("dist"), members) == {"a -> b": "gloo"}
    assert probes_started(measurer(None), fleet("auto"), members) == {"a -> b": ""}
    tcp_only = LinkSnapshot("b", 0.3, 1e9)
    assert probes_started(measurer(tcp_only), fleet("auto"), members) == {}
    # Probed before the model's hops could take gloo: probed again, with the path.
    assert probes_started(measurer(tcp_only), fleet("dist"), members) == {"a -> b": "gloo"}
    # The path asked for once, measured or not, is not asked for again every step.
    for known in (LinkSnapshot("b", 0.3, 1e9, "gloo", 0.1, 2e9),
                  LinkSnapshot("b", 0.3, 1e9, "gloo")):
        assert probes_started(measurer(known), fleet("dist"), members) == {}
