"""The checkpoint maker: transformers loads what it writes, bit for bit, for every family."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.checkpoint.maker import (
    FAMILIES,
    PRESETS,
    CheckpointExistsError,
    CheckpointSpec,
    SpecError,
    WriteProgress,
    config_json,
    make_checkpoint,
    shard_file_names,
    split_into_shards,
    tensor_blocks,
    tensor_plan,
)
from engine.checkpoint.reader import open_checkpoint
from engine.checkpoint.tokenizer import CHATML_TEMPLATE, EOS_TOKEN_ID, build_tokenizer
from tests.checkpoint.conftest import family_spec
from tests.requirements import require

transformers = require("transformers")
transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_hf(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_exactly_what_was_written(made, family, dtype, tied, shards):
    spec = family_spec(family, dtype=dtype, tie_word_embeddings=tied, shards=shards)
    model_dir = made(spec)
    model, info = _load_hf(model_dir)
    assert {k: v for k, v in info.items() if v} == {}, "missing, unexpected or mismatched keys"
    assert type(model).__name__ == config_json(spec)["architectures"][0]
    assert model.dtype == TORCH_DTYPES[dtype]
    assert model.config.head_dim == spec.head_dim
    assert model.config.num_key_value_heads == spec.num_key_value_heads
    assert model.config.tie_word_embeddings == tied
    if spec.rope_scaling is not None:
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert model.config.rope_parameters["factor"] == spec.rope_scaling.factor
        assert model.config.rope_parameters["rope_theta"] == spec.rope_theta
    if family == "mistral":
        assert model.config.sliding_window == spec.sliding_window

    # Every weight transformers holds is the file's tensor, bit for bit.
    checkpoint = open_checkpoint(model_dir)
    expected = checkpoint.load_tensors(checkpoint.tensor_names(), framework="pt")
    assert len(checkpoint.safetensors_files()) == shards
    state = model.state_dict()
    assert set(state) == set(expected) | ({"lm_head.weight"} if tied else set())
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    if tied:
        assert torch.equal(state["lm_head.weight"], expected["model.embed_tokens.weight"])

    # Longer than mistral's sliding window, so the window is exercised too.
    ids = torch.arange(3, 15)[None]  # [1, 12]
    with torch.no_grad():
        logits = model(ids).logits  # [1, 12, vocab]
    assert logits.shape == (1, 12, spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0.1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_are_not_degenerate(made, family, tied):
    """Random weights still give varied greedy tokens and O(1) activations through 16 layers."""
    spec = dataclasses.replace(PRESETS["tiny"], family=family, tie_word_embeddings=tied,
                               num_hidden_layers=16, sliding_window=None)
    model, _ = _load_hf(made(spec))
    contexts = torch.randint(3, spec.vocab_size, (4, 48),
                             generator=torch.Generator().manual_seed(0))  # [4, 48]
    with torch.no_grad():
        out = model(contexts, output_hidden_states=True)
    for layer, hidden in enumerate(out.hidden_states):
        rms = hidden.pow(2).mean().sqrt().item()
        assert 0.05 < rms < 5.0, f"layer {layer}: hidden rms {rms}"
    top1 = out.logits.argmax(-1).flatten()  # [192]
    counts = torch.bincount(top1, minlength=spec.vocab_size)
    assert (counts > 0).sum() >= 20, "next-token argmax barely depends on the context"
    assert counts.max() / top1.numel() < 0.3
    # A tied head must not simply echo the current token.
    assert (top1 == contexts.flatten()).float().mean() < 0.1

    prompt = torch.tensor([[42, 364, 81, 266, 288]])
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=24, min_new_tokens=24, eos_token_id=None,
                               pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert len(set(generated)) >= 3, generated


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    spec = family_spec("qwen3", shards=2, dtype="bfloat16")
    first = make_checkpoint(tmp_path / "a", spec)
    second = make_checkpoint(tmp_path / "b", spec)
    other = make_checkpoint(tmp_path / "c", dataclasses.replace(spec, seed=spec.seed + 1))
    names = sorted(path.name for path in first.iterdir())
    assert names == sorted(path.name for path in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in names:
        same = (first / name).read_bytes() == (other / name).read_bytes()
        assert same == (not name.endswith(".safetensors")), name


def test_values_do_not_depend_on_sharding(made):
    one = open_checkpoint(made(family_spec("qwen2")))
    three = open_checkpoint(made(family_spec("qwen2", shards=3)))
    assert one.tensor_names() == three.tensor_names()
    a = one.load_tensors(one.tensor_names(), framework="numpy")
    b = three.load_tensors(three.tensor_names(), framework="numpy")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_files_are_the_ones_transformers_expects(made):
    spec = family_spec("qwen2", shards=3)
    model_dir = made(spec)
    assert sorted(path.name for path in model_dir.iterdir()) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "model.safetensors.index.json", "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"])
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    plan = tensor_plan(spec)
    assert index["metadata"]["total_size"] == sum(t.element_count * 4 for t in plan)
    assert set(index["weight_map"]) == {t.name for t in plan}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["attention_bias"] is True
    assert config["eos_token_id"] == EOS_TOKEN_ID
    for path in model_dir.glob("*.safetensors"):
        header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
        assert (8 + header_bytes) % 8 == 0, "tensor data must start 8-byte aligned"


def test_family_tensor_names():
    names = {family: {t.name for t in tensor_plan(family_spec(family))} for family in FAMILIES}
    layer = "model.layers.1.self_attn"
    assert f"{layer}.q_proj.bias" in names["qwen2"]
    assert f"{layer}.q_proj.bias" not in names["llama"] | names["mistral"] | names["qwen3"]
    assert f"{layer}.q_norm.weight" in names["qwen3"]
    assert f"{layer}.k_norm.weight" not in names["llama"] | names["mistral"] | names["qwen2"]
    assert "lm_head.weight" in names["llama"]
    tied = {t.name for t in tensor_plan(family_spec("llama", tie_word_embeddings=True))}
    assert tied == names["llama"] - {"lm_head.weight"}


def test_8b_preset_is_llama_3_8b_in_bounded_shards():
    spec = PRESETS["8b"]
    config = config_json(spec)
    assert config["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192,
                                      "rope_type": "llama3"}
    assert config["rope_theta"] == 500000.0 and config["vocab_size"] == 128256
    plan = tensor_plan(spec)
    assert len(plan) == 2 + 9 * 32 + 1
    assert sum(t.element_count for t in plan) == 8_030_261_248  # Llama-3-8B's parameter count
    shards = split_into_shards(plan, spec.shards, 2)
    shard_bytes = [sum(t.element_count * 2 for t in shard) for shard in shards]
    assert all(2e9 < size < 4.5e9 for size in shard_bytes), shard_bytes
    # The embedding (1 GB of bfloat16) is produced in 32 MiB blocks, never whole.
    first_block = next(tensor_blocks(spec, plan[0]))
    assert len(first_block) == (1 << 24) * 2


def test_shards_are_contiguous_and_never_empty():
    plan = tensor_plan(family_spec("llama"))
    for shard_count in range(1, len(plan) + 1):
        shards = split_into_shards(plan, shard_count, 4)
        assert len(shards) == shard_count and all(shards)
        assert list(itertools.chain(*shards)) == plan


def test_progress_reaches_the_total(tmp_path):
    events: list[WriteProgress] = []
    spec = family_spec("llama", shards=2)
    make_checkpoint(tmp_path, spec, progress=events.append)
    done = [event.bytes_done for event in events]
    assert done == sorted(done)
    assert done[-1] == events[-1].bytes_total == sum(t.element_count * 4 for t in tensor_plan(spec))


def test_an_interrupted_shard_stops_every_writer_and_leaves_no_checkpoint(tmp_path):
    """Shards are written by several threads at once; an interruption in one writer (here
    its progress report raising, as Ctrl-C would inside it) is what the caller gets, not
    another writer's stopping because of it, and no shard is left looking complete."""
    spec = family_spec("llama", shards=3)
    second = shard_file_names(3)[1]

    def interrupted(event: WriteProgress) -> None:
        if event.file_name == second:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_checkpoint(tmp_path, spec, progress=interrupted)
    assert len(list(tmp_path.glob("*.safetensors"))) < 3
    assert not (tmp_path / "model.safetensors.index.json").exists()
    make_checkpoint(tmp_path, spec, overwrite=True)  # and the directory can be made again
    assert not list(tmp_path.glob("*.partial"))
    assert len(list(tmp_path.glob("*.safetensors"))) == 3


def test_refuses_a_non_empty_directory_unless_told(tmp_path):
    make_checkpoint(tmp_path, family_spec("llama", shards=3))
    with pytest.raises(CheckpointExistsError, match=str(tmp_path)):
        make_checkpoint(tmp_path, family_spec("llama"))
    (tmp_path / "notes.txt").write_text("kept")
    make_checkpoint(tmp_path, family_spec("llama"), overwrite=True)
    # The old shards and index are gone, so nothing stale can shadow the new single file.
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert (tmp_path / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize(("overrides", "field_name"), [
    (dict(family="gpt2"), "family"),
    (dict(dtype="int8"), "dtype"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_size=30), "hidden_size"),  # llama: hidden must divide by heads
    (dict(head_dim=7), "head_dim"),
    (dict(head_dim=0), "head_dim"),
    (dict(vocab_size=100), "vocab_size"),
    (dict(shards=1000), "shards"),
    (dict(sliding_window=8), "sliding_window"),  # only mistral has one
    (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling"),
    (dict(rope_theta=0.0), "rope_theta"),
])
def test_bad_specs_name_the_field(overrides, field_name):
    with pytest.raises(SpecError, match=rf"CheckpointSpec\.{field_name} = ") as error:
        family_spec("llama", **overrides)
    assert error.value.field_name == field_name


def test_tokenizer_loads_and_chats(made):
    model_dir = made(family_spec("llama"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.bos_token_id == config["bos_token_id"] == tokenizer.pad_token_id
    assert len(tokenizer) <= config["vocab_size"]
    text = "Hello, world!  Ünïcödé 日本語 🎉\n\tcode: x = [1, 2]  "
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(rendered)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHATML_TEMPLATE


_TOKENIZER = build_tokenizer(512)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200))
def test_any_text_round_trips(text):
    ids = _TOKENIZER.encode(text).ids
    assert _TOKENIZER.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_is_deterministic_and_sized(tmp_path):
    assert build_tokenizer(400).to_str() == build_tokenizer(400).to_str()
    assert build_tokenizer(400).get_vocab_size() == 400
    assert Tokenizer.from_str(_TOKENIZER.to_str()).get_vocab_size() == 512
    with pytest.raises(ValueError, match="259"):
        build_tokenizer(258)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.checkpoint", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_make_and_info(tmp_path):
    out = tmp_path / "model"
    made = _cli("make", str(out), "--family", "qwen3", "--layers", "3", "--hidden", "32",
                "--heads", "4", "--kv-heads", "2", "--head-dim", "10", "--intermediate", "48",
                "--vocab", "320", "--dtype", "bfloat16", "--tie", "--shards", "2", "--seed", "5")
    assert made.returncode == 0, made.stderr
    spec = CheckpointSpec(family="qwen3", num_hidden_layers=3, hidden_size=32,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                          intermediate_size=48, vocab_size=320, dtype="bfloat16",
                          tie_word_embeddings=True, shards=2, seed=5)
    assert json.loads((out / "config.json").read_text()) == config_json(spec)

    info = _cli("info", str(out))
    assert info.returncode == 0, info.stderr
    plan = tensor_plan(spec)
    assert "model_type: qwen3" in info.stdout
    assert f"tensors: {len(plan)}" in info.stdout
    assert f"tensor bytes: {sum(t.element_count for t in plan) * 2} " in info.stdout

    again = _cli("make", str(out), "--preset", "tiny")
    assert again.returncode == 2 and "--force" in again.stderr
    forced = _cli("make", str(out), "--preset", "tiny", "--llama3-rope-scaling", "--force")
    assert forced.returncode == 0, forced.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["num_hidden_layers"] == PRESETS["tiny"].num_hidden_layers
    assert not (out / "model.safetensors.index.json").exists()


def test_cli_errors_are_named(tmp_path):
    bad = _cli("make", str(tmp_path / "x"), "--heads", "4", "--kv-heads", "3")
    assert bad.returncode == 2
    assert "num_key_value_heads = 3" in bad.stderr
    assert not (tmp_path / "x").exists()
    missing = _cli("info", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "nowhere" in missing.stderr


def test_checkpoint_tensor_counts_match_the_plan(made):
    for family in FAMILIES:
        spec = family_spec(family)
        checkpoint = open_checkpoint(made(spec))
        plan = tensor_plan(spec)
        assert checkpoint.tensor_names() == sorted(t.name for t in plan)
        for tensor in plan:
            assert checkpoint.tensor_shape(tensor.name) == tensor.shape
            assert math.prod(tensor.shape) == tensor.element_count
