"""A replica whose stages' KV pools are smaller than a whole window a slot (FLEET_KV_PAGES),
through the official client: a torch stage in pages and an MLX stage that counts them, short
requests served side by side, one that can never fit refused with a 400 that names the
pages, and the ring healthy after it."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from engine.harness.launch import launch

CONTEXT, CHUNK, POOL = 256, 32, 3  # a window is 4 pages of 64 positions; the pool holds 3


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
        with urllib.request.urlopen(fleet.url.removesuffix("/v1") + "/health",
                                    timeout=30) as reply:
            assert json.loads(reply.read())["status"] == "ok"
