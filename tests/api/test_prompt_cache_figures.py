"""The prompt cache's figures on a real two-stage ring: rank 0's /metrics and /health count
hits, misses and tokens reused, and each stage's bytes held (the closed slots that hold a
conversation, times what one slot takes on that stage, as placement charges it)."""

from __future__ import annotations

import json
import re
import urllib.request

from openai import OpenAI

from engine.harness.launch import launch
from supervisor.memory import kept_slot_bytes, model_shape_from_config
from tests.waiting import wait_until

CONTEXT, CHUNK = 256, 32
LONG = " ".join(f"word{i}" for i in range(15))  # several prompt chunks of this model's tokens


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def test_metrics_and_health_count_the_cache_per_stage(make_model, tmp_path):
    model_dir = make_model("qwen3", num_hidden_layers=3)
    stages = [(0, 1), (1, 3)]
    with launch(model_dir, stages, context=CONTEXT, parallel=1, chunk=CHUNK,
                prompt_cache_slots=2, run_dir=tmp_path) as fleet:
        fleet.wait_ready()
        base = fleet.url.removesuffix("/v1")
        client = OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": LONG}]
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                               temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                                temperature=0)
        reused = second.usage.prompt_tokens_details.cached_tokens
        assert reused > 0 and first.usage.prompt_tokens_details.cached_tokens == 0
        # The second turn's slot closes a round after its reply: then one slot holds it.
        figures = wait_until(lambda: (f := get_json(base + "/health")["prompt_cache"])["held"]
                             == 1 and f, within_s=60, what="the second turn's slot kept")
        shape = model_shape_from_config(json.loads((model_dir / "config.json").read_text()), 4)
        slot_bytes = [kept_slot_bytes(shape, CONTEXT, r) for r in stages]
        assert figures == {
            "slots": 2, "held": 1, "hits": 1, "misses": 1, "reused_tokens": reused,
            "stages": [{"rank": i, "layers": list(r), "slot_bytes": slot_bytes[i],
                        "bytes_held": slot_bytes[i]} for i, r in enumerate(stages)]}
        with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
            text = reply.read().decode()

    def value(name: str) -> float:
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert found, f"{name} not in /metrics"
        return float(found[1])

    assert value("ringfleet_prompt_cache_hits_total") == 1
    assert value("ringfleet_prompt_cache_misses_total") == 1
    assert value("ringfleet_prompt_cache_reused_tokens_total") == reused
    assert value("ringfleet_prompt_cache_slots") == 2
    assert value("ringfleet_prompt_cache_slots_held") == 1
    for i, (a, b) in enumerate(stages):
        labels = f'{{layers="{a}:{b}",rank="{i}"}}'
        assert value(f"ringfleet_prompt_cache_bytes_held{labels}") == slot_bytes[i]
        assert value(f"ringfleet_prompt_cache_slot_bytes{labels}") == slot_bytes[i]
