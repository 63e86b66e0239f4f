"""Facts on this machine agree with psutil and the frameworks' own answers."""

from __future__ import annotations

import asyncio
import platform
import socket

import psutil

from agent.facts import HostFacts, collect_facts, usable_bytes
from tests.agent.conftest import agent_config, client, serving

GIB = 1 << 30


def check_against_this_machine(facts: dict) -> None:
    host = facts["host"]
    assert host["hostname"] == socket.gethostname()
    assert host["cores_logical"] == psutil.cpu_count()
    assert host["cores_physical"] == (psutil.cpu_count(logical=False) or psutil.cpu_count())
    assert host["ram_total_bytes"] == psutil.virtual_memory().total
    assert abs(host["ram_available_bytes"] - psutil.virtual_memory().available) < 2 * GIB
    assert host["arch"] == platform.machine()
    backends = {b["backend"]: b for b in facts["backends"]}
    assert set(backends) == {"torch-cuda", "torch-mps", "torch-cpu", "mlx-metal", "mlx-cuda",
                             "mlx-cpu"}
    import mlx.core as mx
    import torch

    cpu = backends["torch-cpu"]
    assert cpu["present"] and cpu["framework_version"] == torch.__version__
    assert backends["torch-cuda"]["present"] == torch.cuda.is_available()
    assert backends["mlx-cpu"]["present"]
    assert backends["mlx-cpu"]["framework_version"] == mx.__version__
    assert backends["mlx-metal"]["present"] == mx.metal.is_available()
    floor = host["os_floor_bytes"]
    assert cpu["devices"][0]["memory_usable_bytes"] == max(0, host["ram_total_bytes"] - floor)
    for backend in backends.values():
        assert backend["present"] or backend["reason"]
    from engine import ENGINE_VERSION

    assert facts["engine_version"] == ENGINE_VERSION


def test_facts_in_process_agree_with_psutil():
    facts = collect_facts("n1", os_floor_bytes=2 * GIB, gpu_reserve_bytes=GIB)
    check_against_this_machine(facts.to_dict())
    assert facts.present_backends >= {"torch-cpu", "mlx-cpu"}


def test_facts_digest_ignores_free_memory_but_not_what_placement_uses():
    facts = collect_facts("n1", 2 * GIB, GIB, probed=[])
    from dataclasses import replace

    busier = replace(facts, host=replace(facts.host, ram_available_bytes=1),
                     collected_at=facts.collected_at + 60)
    assert busier.digest() == facts.digest()
    assert replace(facts, host=replace(facts.host, os_floor_bytes=1)).digest() != facts.digest()


def test_usable_memory_after_the_floor_per_kind_of_device():
    host = HostFacts("n", "h", "linux", "os", "aarch64", "3.11", 20, 20, 128 * GIB, 100 * GIB,
                     True, 8 * GIB, None)
    assert usable_bytes("torch-cpu", {}, host, GIB) == (128 * GIB, 120 * GIB, True)
    gb10 = {"memory_total_bytes": 119 * GIB, "integrated": True}
    assert usable_bytes("torch-cuda", gb10, host, GIB) == (119 * GIB, 111 * GIB, True)
    discrete = {"memory_total_bytes": 80 * GIB, "integrated": False}
    assert usable_bytes("torch-cuda", discrete, host, GIB) == (80 * GIB, 79 * GIB, False)
    mac = HostFacts("m", "h", "darwin", "os", "arm64", "3.11", 12, 12, 64 * GIB, 40 * GIB, True,
                    8 * GIB, 48 * GIB)
    assert usable_bytes("mlx-metal", {}, mac, GIB) == (64 * GIB, 48 * GIB, True)
    unset = HostFacts(*(list(mac.__dict__.values())[:-1] + [None]))
    metal = {"recommended_max_bytes": 51 * GIB}
    assert usable_bytes("mlx-metal", metal, unset, GIB)[1] == 51 * GIB


def test_the_agent_reports_facts_probed_in_a_child(fleet, tmp_path):
    config = agent_config(fleet, tmp_path)

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            async with session.post(url + "/v1/facts/refresh") as r:
                body = await r.json()
            assert body["probe_error"] == ""
            check_against_this_machine(body["facts"])
            assert body["facts"]["host"]["node"] == "node-a"

    asyncio.run(scenario())
