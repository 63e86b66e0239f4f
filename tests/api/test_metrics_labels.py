"""Hostile names against /metrics: model names and paths with quotes, backslashes,
newlines, braces, thousands of characters and hundreds of distinct values, sent to a real
rank 0 (a fleet-engine process) and through the front door in front of it, leave both
/metrics parseable by Prometheus's own parser, with no series per name: rank 0 labels
requests by route template (`unmatched` for every unknown path) and status alone; the front
door by route, status and model, any model the fleet does not serve counted as `other`."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine.harness.launch import LOOPBACK, free_port
from supervisor.front_door import FrontDoorConfig, Route, open_front_door
from tests.api.conftest import http

ROUTES = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
          "unmatched"}  # rank 0's and the front door's alike
NASTY = ['a"b', "back\\slash", "new\nline", "{brace}", 'x"} evil{le="1', "\\n\\\"", "é\u2028",
         "\x00nul", "x" * 5000]
DISTINCT = 300  # distinct hostile names of each kind, bounded


def metric_labels(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Every sample's label set, by metric family, as Prometheus's parser reads the text."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(family.name, set()).add(tuple(sorted(sample.labels.items())))
    return out


def hostile_models() -> list[str]:
    return NASTY + [f'm{i}"\\\n{{}}' for i in range(DISTINCT)]


def hostile_paths() -> list[str]:
    quoted = ["/v1/%22quote%22", "/v1/back%5Cslash", "/v1/new%0Aline", "/%7Bbrace%7D",
              "/v1/completions/", "/v1/completions%00", "/" + "y" * 4000]
    return quoted + [f"/scan/{i}/%22%7B%7D%5C" for i in range(DISTINCT)]


def check_metrics(text: str, family: str, models: set[str] | None = None) -> dict[str, set]:
    families = metric_labels(text)  # raises on anything Prometheus could not read
    requests = families[family]
    endpoints = {dict(labels)["endpoint"] for labels in requests}
    statuses = {dict(labels)["status"] for labels in requests}
    assert endpoints <= ROUTES, endpoints - ROUTES
    assert all(re.fullmatch(r"[1-5][0-9][0-9]", s) for s in statuses), statuses
    if models is not None:
        seen = {dict(labels)["model"] for labels in requests}
        assert seen <= models | {"other"}, seen - models
    # A handful of series, not one per name: routes x the statuses they answered (x models).
    assert len(requests) <= 2 * len(ROUTES) * len(statuses) * len(models or {1}), len(requests)
    for name in ("a\"b", "back", "brace", "evil", "scan", "quote", "x" * 100):
        assert name not in text, name
    return families


def rank0_metrics(base_url: str) -> str:
    status, text = http("GET", f"{base_url}/metrics")
    assert status == 200
    return text


def test_hostile_models_and_paths_at_rank_0(engine):
    base = engine.url.removesuffix("/v1")
    for model in hostile_models():
        for route, body in (("/v1/completions", {"model": model, "prompt": "hi"}),
                            ("/v1/chat/completions", {"model": model, "messages": [
                                {"role": "user", "content": model}]})):
            status, text = http("POST", base + route, json.dumps(body).encode())
            assert status == 400 and json.loads(text)["error"]["code"] == "model_not_found"
    for path in hostile_paths():
        status, _ = http("GET", base + path)
        assert status in (400, 404), (path, status)
        status, _ = http("POST", base + path, b"{}")
        assert status in (400, 404, 405), (path, status)
    families = check_metrics(rank0_metrics(base), "ringfleet_requests")
    seen = {dict(labels)["endpoint"] for labels in families["ringfleet_requests"]}
    assert {"/v1/completions", "/v1/chat/completions", "unmatched"} <= seen


def test_hostile_models_and_fields_through_the_front_door(engine, model_id):
    base = engine.url.removesuffix("/v1")

    async def run() -> None:
        route = Route(url=base, replica="m-g1")
        config = FrontDoorConfig(
            lambda model, conversation: route if model == model_id else Route(
                status=404, message=f"model {model!r} is not served by this fleet"),
            lambda: [{"id": model_id, "serving": True}])
        port = free_port()
        runner = await open_front_door(config, LOOPBACK, port)
        try:
            async with aiohttp.ClientSession(f"http://{LOOPBACK}:{port}") as door:
                for model in hostile_models():
                    async with door.post("/v1/completions",
                                         json={"model": model, "prompt": "hi"}) as r:
                        assert r.status == 404
                for path in hostile_paths()[:50]:
                    async with door.get(path) as r:
                        assert r.status in (400, 404), (path, r.status)
                # The served model with hostile text in every free-form field: relayed to
                # rank 0, which labels it by route alone.
                for text in NASTY:
                    async with door.post("/v1/chat/completions", json={
                            "model": model_id, "max_tokens": 1, "user": text,
                            "messages": [{"role": "user", "content": text, "name": "n"}]}) as r:
                        assert r.status in (200, 400), (text, r.status, await r.text())
                async with door.get("/metrics") as r:
                    assert r.status == 200
                    door_text = await r.text()
        finally:
            await runner.cleanup()
        families = check_metrics(door_text, "ringfleet_front_door_requests", {model_id})
        counted = {(dict(labels)["model"], dict(labels)["status"]) for labels in
                   families["ringfleet_front_door_requests"]}
        assert ("other", "404") in counted and (model_id, "200") in counted, counted
        assert "ringfleet_front_door_suspected" in families

    asyncio.run(run())
    check_metrics(rank0_metrics(base), "ringfleet_requests")
