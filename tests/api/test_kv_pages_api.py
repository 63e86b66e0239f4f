"""A replica whose stages' KV pools are smaller than a whole window a slot (FLEET_KV_PAGES),
through the official client: a torch stage and an MLX stage, each in pages, short requests
served side by side, one that can never fit refused with a 400 that names the pages, the
ring healthy after it, and /health and /metrics counting the pages the kept conversations
hold on each stage."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from engine.harness.launch import launch
from engine.kv_pages import pages_for
from supervisor.memory import kept_slot_bytes, model_shape_from_config
from tests.waiting import wait_until

CONTEXT, CHUNK, POOL = 256, 32, 3  # a window is 4 pages of 64 positions; the pool holds 3
LONG = " ".join(f"word{i}" for i in range(15))  # past a prompt chunk, within a page or two


def test_a_pool_serves_short_requests_side_by_side_and_refuses_one_past_it(make_model,
                                                                           tmp_path):
    model_dir = make_model("qwen3", num_hidden_layers=3)
    with launch(model_dir, [(0, 1), (1, 3)], ["torch-cpu", "mlx-cpu"], context=CONTEXT,
                parallel=3, chunk=CHUNK, run_dir=tmp_path,
                extra_env={"FLEET_KV_PAGES": str(POOL)}) as fleet:
        fleet.wait_ready()
        client = OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(words: str, max_tokens: int):
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": words}],
                max_tokens=max_tokens, temperature=0)

        with pytest.raises(openai.BadRequestError) as refused:
            ask("hello there", 200)  # the prompt and 200 tokens need 4 pages
        body = refused.value.body
        assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
        assert "KV pages of 64 positions; this model's pool holds 3" in body["message"]
        with ThreadPoolExecutor(3) as pool:  # a page each: all three at once
            replies = list(pool.map(lambda i: ask(f"count to {i}", 12), range(3)))
        assert all(r.usage.completion_tokens == 12 for r in replies)
        base = fleet.url.removesuffix("/v1")

        def health() -> dict:
            with urllib.request.urlopen(base + "/health", timeout=30) as reply:
                return json.loads(reply.read())

        assert health()["status"] == "ok"
        # A conversation long enough to keep (a full prompt chunk): its closed slot keeps
        # its pages, and every stage counts a page's positions of KV for each, no window
        kept = ask(LONG, 4)
        figures = wait_until(lambda: (f := health()["prompt_cache"])["held"] == 1 and f,
                             within_s=60, what="the long conversation kept")
        with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
    pages = figures["kv_pages"]
    assert pages["pool"] == POOL and 1 <= pages["kept"] <= pages["in_use"] <= POOL
    tokens = kept.usage.prompt_tokens + kept.usage.completion_tokens  # the last may not run
    assert pages_for(tokens - 1) <= pages["kept"] <= pages_for(tokens)
    shape = model_shape_from_config(json.loads((model_dir / "config.json").read_text()), 4)
    assert [s["bytes_held"] for s in figures["stages"]] == [
        kept_slot_bytes(shape, 64 * pages["kept"], layers) for layers in ((0, 1), (1, 3))]
    assert f"\nringfleet_kv_pages {POOL}.0\n" in metrics
    assert f"\nringfleet_kv_pages_in_use {pages['in_use']}.0\n" in metrics
