"""`make demo`: a generated checkpoint served by a two-stage PyTorch + MLX ring, asked one question.

Random weights give random text: the point is the path (checkpoint -> stages -> ring ->
OpenAI API), not the prose. Point `--model` at a real Hugging Face checkpoint directory
(Llama, Mistral, Qwen2 or Qwen3) to hear a real model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from openai import OpenAI
from rich.console import Console

from engine.checkpoint.maker import PRESETS, make_checkpoint
from engine.launch import even_stages, launch

ROOT = Path(__file__).resolve().parent.parent
console = Console(stderr=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: generate one)")
    parser.add_argument("--backends", default="torch-cpu,mlx-cpu",
                        help="one per stage, e.g. torch-cpu,mlx-cpu")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        model_dir = ROOT / "build" / "demo-model"
        if not (model_dir / "config.json").exists():
            console.print(f"[bold]making a checkpoint[/] in {model_dir}")
            make_checkpoint(model_dir, PRESETS["demo"], overwrite=True)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    backends = args.backends.split(",")
    stages = even_stages(layers, len(backends))
    console.print(f"[bold]starting {len(stages)} stages[/]: "
                  + ", ".join(f"layers {a}:{b} on {be}" for (a, b), be in zip(stages, backends)))
    with launch(model_dir, stages, backends, context=1024, parallel=2, chunk=64,
                run_dir=ROOT / "build" / "demo-run") as fleet:
        started = time.monotonic()
        fleet.wait_ready()
        console.print(f"ring ready in {time.monotonic() - started:.1f} s at {fleet.url}")
        client = OpenAI(base_url=fleet.url, api_key="not-needed")
        model_id = client.models.list().data[0].id
        question = "Tell me about rings of machines."
        console.print(f"[bold]user:[/] {question}")
        console.print("[bold]assistant:[/] ", end="")
        stream = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": question}],
            max_tokens=48, temperature=0.8, seed=1, stream=True,
            stream_options={"include_usage": True})
        fingerprint, usage = None, None
        for chunk in stream:
            fingerprint = chunk.system_fingerprint or fingerprint
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].delta.content:
                console.print(chunk.choices[0].delta.content, end="", markup=False,
                              highlight=False)
        console.print()
        console.print(f"placement: {fingerprint}; usage: {usage.prompt_tokens} prompt + "
                      f"{usage.completion_tokens} completion tokens")
        console.print("(random weights make random text; see README to serve a real checkpoint)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
