"""The real model's tokens a second through the OpenAI API, per placement, against
transformers' and mlx-lm's own generate in the same run.

    python bench/real_model.py [--tokens 200] [--repeats 2] [--placements NAME,...]
                               [--model DIR]

The model is SmolLM2-135M-Instruct (float32, 30 layers), made once by scripts/real_model.py,
or any checkpoint `--model` names (split in halves for the two-stage placements).
Every placement is started with `engine.harness.launch` on loopback, warmed up with one short chat,
then asked one chat `--repeats` times, streamed and greedy with `ignore_eos`, so each answer
is exactly `--tokens` tokens. Decode ms/token is the time from the first streamed token to
the last over the tokens in between; tok/s is tokens over the whole request. The references
generate the same number of tokens from the same chat-rendered prompt in this process:
their decode ms/token is (time for all tokens - time for one) over the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median_s, table
from engine.harness.launch import launch, placement_id
from scripts.real_model import ensure_real_model

QUESTION = "What is the capital of France? Tell me about the city."
PLACEMENTS = ("torch", "torch+torch", "torch+mlx", "mlx")


def placement(name: str, layers: int) -> tuple[list[tuple[int, int]], list[str]]:
    """The stages and backends of a named placement: one stage, or two halves."""
    backends = [f"{b}-cpu" for b in name.split("+")]
    if len(backends) == 1:
        return [(0, layers)], backends
    return [(0, layers // 2), (layers // 2, layers)], backends


def through_api(model_dir: Path, stages, backends, tokens: int, repeats: int,
                run_dir: Path) -> dict:
    """Median time to first token, decode ms/token and tok/s over `repeats` streamed chats."""
    from openai import OpenAI

    fleet = launch(model_dir, stages, backends, context=1024, parallel=1, chunk=128,
                   run_dir=run_dir)
    try:
        fleet.wait_ready(timeout_s=300)
        client = OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": QUESTION}]

        def chat(max_tokens: int) -> tuple[float, float, float, int, str]:
            start = time.perf_counter()
            first = last = None
            text, used = [], 0
            for chunk in client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                now = time.perf_counter()
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or now
                    last = now
                    text.append(chunk.choices[0].delta.content)
            return start, first, last, used, "".join(text)

        chat(16)  # warm-up: first-call allocations and lazy compilation stay out of the figures
        runs = [chat(tokens) for _ in range(repeats)]
    finally:
        fleet.stop()
    for _start, _first, _last, used, _text in runs:
        if used != tokens:
            raise RuntimeError(f"{placement_id(stages, backends)}: {used} tokens, not {tokens}")
    return dict(
        ttft_ms=statistics.median((first - start) * 1000 for start, first, _, _, _ in runs),
        decode_ms=statistics.median((last - first) * 1000 / (tokens - 1)
                                    for _, first, last, _, _ in runs),
        tok_s=statistics.median(tokens / (last - start) for start, _, last, _, _ in runs),
        text=runs[-1][4],
    )


def transformers_reference(model_dir: Path, tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out: list = []

    def generate(n: int) -> None:
        with torch.inference_mode():
            out[:] = [model.generate(**inputs, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False)]

    whole = median_s(lambda: generate(tokens), repeats=repeats)
    first = median_s(lambda: generate(1), repeats=repeats)
    # The answer itself: greedy, stopping at the end-of-turn token as a chat does.
    with torch.inference_mode():
        answer = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    text = tokenizer.decode(answer[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return dict(ttft_ms=first * 1000, decode_ms=(whole - first) * 1000 / (tokens - 1),
                tok_s=tokens / whole, text=text)


def mlx_lm_reference(model_dir: Path, tokens: int, repeats: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    prompt = mx.array(tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True))
    ids: list[int] = []

    def generate(n: int) -> None:
        ids.clear()
        # generate_step does not stop at the end-of-turn token, as ignore_eos does not.
        for token, _logprobs in generate_step(prompt, model, max_tokens=n):
            ids.append(int(token))
            if len(ids) == n:
                break

    whole = median_s(lambda: generate(tokens), repeats=repeats)
    text = tokenizer.decode(ids)  # the last timed run's
    first = median_s(lambda: generate(1), repeats=repeats)
    return dict(ttft_ms=first * 1000, decode_ms=(whole - first) * 1000 / (tokens - 1),
                tok_s=tokens / whole, text=text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--placements", default=",".join(PLACEMENTS),
                        help=f"some of {', '.join(PLACEMENTS)}")
    parser.add_argument("--run-dir", type=Path, default=Path("build") / "bench-real-model")
    parser.add_argument("--model", type=Path, help="a checkpoint (default: the real model)")
    args = parser.parse_args()
    unknown = set(args.placements.split(",")) - set(PLACEMENTS)
    if unknown:
        parser.error(f"--placements: unknown {', '.join(sorted(unknown))}; "
                     f"expected some of {', '.join(PLACEMENTS)}")
    model_dir = args.model or ensure_real_model()
    layers = json.loads((model_dir / "config.json").read_text())
    layers = layers.get("text_config", layers)["num_hidden_layers"]
    # Other work on the machine moves every figure; the load says how much there was.
    load_before = os.getloadavg()[0]
    results: dict[str, dict] = {}
    for name in args.placements.split(","):
        stages, backends = placement(name, layers)
        print(f"# {placement_id(stages, backends)} through the API", flush=True)
        results[placement_id(stages, backends) + " (API)"] = through_api(
            model_dir, stages, backends, args.tokens, args.repeats, args.run_dir / name)
    print("# transformers generate", flush=True)
    results["transformers generate (torch-cpu)"] = transformers_reference(
        model_dir, args.tokens, args.repeats)
    print("# mlx-lm generate_step", flush=True)
    results["mlx-lm generate_step (mlx-cpu)"] = mlx_lm_reference(model_dir, args.tokens,
                                                                 args.repeats)
    # Past the end-of-turn token each generator goes on its own way (transformers'
    # min_new_tokens forbids the token, the others emit it and carry on): the answer is
    # what comes before it.
    answer = results["transformers generate (torch-cpu)"]["text"]
    table(f"{model_dir.name}, {args.tokens} tokens, greedy",
          ["what", "first token ms", "decode ms/token", "tok/s", "answer = transformers'"],
          [[name, round(r["ttft_ms"]), r["decode_ms"], r["tok_s"],
            "yes" if r["text"].startswith(answer) else "NO"]
           for name, r in results.items()])
    print(f"\ntransformers' answer ({len(answer)} characters): {answer[:100]!r}...")
    print(f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
