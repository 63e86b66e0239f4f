"""The range-only reader and the fingerprints: checked at open, named errors, only what is asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint import reader
from engine.checkpoint.fingerprint import checkpoint_digest, layout_fingerprint
from engine.checkpoint.maker import make_checkpoint, tensor_plan
from engine.checkpoint.reader import CheckpointError, open_checkpoint
from tests.checkpoint.conftest import family_spec

SHARDED = family_spec("qwen2", shards=3)


@pytest.fixture
def sharded_copy(made, tmp_path) -> Path:
    """A private, writable copy of a three-shard checkpoint, for tests that break it."""
    return Path(shutil.copytree(made(SHARDED), tmp_path / "model"))


def test_opens_single_and_sharded(made):
    for shards in (1, 3):
        spec = family_spec("qwen2", shards=shards)
        checkpoint = open_checkpoint(made(spec))
        assert checkpoint.config["model_type"] == "qwen2"
        assert checkpoint.tensor_names() == sorted(t.name for t in tensor_plan(spec))
        assert len(checkpoint.safetensors_files()) == shards
        for name in checkpoint.tensor_names():
            assert checkpoint.tensor_file(name).is_file()


def test_layer_names_keep_global_indices(made):
    spec = family_spec("qwen3", num_hidden_layers=11)
    checkpoint = open_checkpoint(made(spec))
    layer_1 = checkpoint.layer_tensor_names(1)
    assert layer_1 == sorted(t.name for t in tensor_plan(spec)
                             if t.name.startswith("model.layers.1."))
    assert len(layer_1) == 11  # q k v o, q_norm k_norm, gate up down, two layer norms
    assert not any(name.startswith("model.layers.10.") for name in layer_1)


def test_loads_only_the_requested_tensors(made, monkeypatch):
    checkpoint = open_checkpoint(made(SHARDED))
    wanted = checkpoint.layer_tensor_names(1)
    opened: list[str] = []
    read: list[str] = []
    real_safe_open = reader.safe_open

    class Spy:
        def __init__(self, path, **options):
            opened.append(Path(path).name)
            self.handle = real_safe_open(path, **options)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(reader, "safe_open", Spy)
    tensors = checkpoint.load_tensors(wanted, framework="pt")
    assert sorted(read) == sorted(wanted) == sorted(tensors)
    assert sorted(set(opened)) == sorted({checkpoint.tensor_file(n).name for n in wanted})
    assert len(opened) == len(set(opened)), "each file is opened once"
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())


def test_frameworks_agree_and_headers_need_no_data(made):
    checkpoint = open_checkpoint(made(family_spec("llama", dtype="bfloat16", shards=2)))
    name = "model.layers.0.mlp.up_proj.weight"
    assert checkpoint.tensor_shape(name) == (72, 32)
    assert checkpoint.tensor_dtype(name) == "BF16"
    as_torch = checkpoint.load_tensors([name], framework="pt", device="cpu")[name]
    assert as_torch.dtype == torch.bfloat16 and tuple(as_torch.shape) == (72, 32)
    f32 = open_checkpoint(made(family_spec("llama")))
    as_numpy = f32.load_tensors([name], framework="numpy")[name]
    assert isinstance(as_numpy, np.ndarray) and as_numpy.dtype == np.float32
    np.testing.assert_array_equal(as_numpy, f32.load_tensors([name], framework="pt")[name].numpy())


def test_check_shape_names_file_tensor_and_both_shapes(made):
    checkpoint = open_checkpoint(made(SHARDED))
    name = "model.layers.1.mlp.up_proj.weight"
    checkpoint.check_shape(name, (48, 32))
    file_name = checkpoint.tensor_file(name).name
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_shape(name, (48, 33))
    message = str(error.value)
    assert file_name in message and name in message
    assert "(48, 32)" in message and "config.json implies (48, 33)" in message


def test_unknown_tensor_names_the_index(made):
    checkpoint = open_checkpoint(made(SHARDED))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: no tensor "
                                              r"model\.layers\.9\.mlp\.up_proj\.weight"):
        checkpoint.load_tensors(["model.layers.9.mlp.up_proj.weight"])
    single = open_checkpoint(made(family_spec("qwen2")))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no tensor lm_head\.bias"):
        single.tensor_shape("lm_head.bias")


def _edit_json(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def test_missing_tensor_names_the_tensor_and_its_file(sharded_copy):
    ghost = "model.layers.0.mlp.extra_proj.weight"
    _edit_json(sharded_copy / "model.safetensors.index.json",
               lambda index: index["weight_map"].update({ghost: "model-00002-of-00003.safetensors"}))
    checkpoint = open_checkpoint(sharded_copy)
    for read in (lambda: checkpoint.load_tensors([ghost]), lambda: checkpoint.tensor_shape(ghost)):
        with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*"
                                                  + ghost.replace(".", r"\.")):
            read()


def _break(model_dir: Path, how: str) -> None:
    index = model_dir / "model.safetensors.index.json"
    if how == "no config":
        (model_dir / "config.json").unlink()
    elif how == "bad json":
        (model_dir / "config.json").write_text('{"model_type": "qwen2",')
    elif how == "not an object":
        (model_dir / "config.json").write_text("[1, 2]")
    elif how == "no model_type":
        _edit_json(model_dir / "config.json", lambda config: config.pop("model_type"))
    elif how == "unsupported":
        _edit_json(model_dir / "config.json", lambda config: config.update(model_type="gpt2"))
    elif how == "no tokenizer":
        (model_dir / "tokenizer.json").unlink()
    elif how == "no weights":
        for path in model_dir.glob("model*"):
            path.unlink()
    elif how == "missing shard":
        (model_dir / "model-00002-of-00003.safetensors").unlink()
    elif how == "bad index":
        index.write_text('{"weight_map": ')
    elif how == "empty index":
        index.write_text('{"metadata": {}}')
    elif how == "escaping index":
        _edit_json(index, lambda content: content["weight_map"].update(
            {"model.norm.weight": "../elsewhere.safetensors"}))
    elif how == "corrupt shard":
        (model_dir / "model-00001-of-00003.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize(("how", "expected"), [
    ("no config", r"config\.json: missing"),
    ("bad json", r"config\.json: not valid JSON"),
    ("not an object", r"config\.json: expected a JSON object"),
    ("no model_type", r"config\.json: field model_type is missing"),
    ("unsupported", (r"config\.json: model_type 'gpt2' is not supported "
                     r"\(supported: llama, mistral, qwen2, qwen3, qwen3_5_text, qwen3_5\)")),
    ("no tokenizer", r"tokenizer\.json: missing"),
    ("no weights", r"no model\.safetensors and no model\.safetensors\.index\.json"),
    ("missing shard", r"model-00002-of-00003\.safetensors: missing"),
    ("bad index", r"model\.safetensors\.index\.json: not valid JSON"),
    ("empty index", r"model\.safetensors\.index\.json: no weight_map"),
    ("escaping index", r"model\.safetensors\.index\.json: weight_map\['model\.norm\.weight'\]"),
])
def test_bad_checkpoints_are_refused_by_name(sharded_copy, how, expected):
    _break(sharded_copy, how)
    with pytest.raises(CheckpointError, match=expected):
        open_checkpoint(sharded_copy)


def test_a_corrupt_shard_is_named_when_read(sharded_copy):
    _break(sharded_copy, "corrupt shard")
    checkpoint = open_checkpoint(sharded_copy)  # the index alone looks fine
    first = "model.embed_tokens.weight"
    with pytest.raises(CheckpointError, match=r"model-00001-of-00003\.safetensors: not a readable"):
        checkpoint.load_tensors([first])


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        open_checkpoint(tmp_path / "nowhere")


def test_checkpoint_digest_is_stable_and_content_bound(made, tmp_path):
    spec = family_spec("llama", shards=2)
    digest = checkpoint_digest(made(spec))
    assert len(digest) == 32
    assert checkpoint_digest(made(spec)) == digest
    # Same bytes in another directory: the same checkpoint.
    twin = make_checkpoint(tmp_path / "twin", spec)
    assert checkpoint_digest(twin) == digest
    # Same shapes, other weights (a fine-tune of the same base): another checkpoint.
    other_seed = make_checkpoint(tmp_path / "seed", family_spec("llama", shards=2, seed=9))
    assert checkpoint_digest(other_seed) != digest
    # Same weights, other sharding: another layout of files, another digest.
    assert checkpoint_digest(made(family_spec("llama", shards=1))) != digest
    # A config edit (say, rope_theta) changes what the model computes, so the digest too.
    _edit_json(twin / "config.json", lambda config: config.update(rope_theta=1.0))
    assert checkpoint_digest(twin) != digest
    tokenizer = make_checkpoint(tmp_path / "tok", spec)
    (tokenizer / "tokenizer.json").write_text((tokenizer / "tokenizer.json").read_text() + " ")
    assert checkpoint_digest(tokenizer) != digest


def test_layout_fingerprint_binds_every_range():
    digest = bytes(range(32))
    layout = [(0, 2), (2, 5), (5, 8)]
    fingerprint = layout_fingerprint(digest, layout)
    assert len(fingerprint) == 32
    assert layout_fingerprint(digest, list(layout)) == fingerprint
    others = [
        layout_fingerprint(bytes(32), layout),
        layout_fingerprint(digest, [(0, 3), (3, 5), (5, 8)]),
        layout_fingerprint(digest, [(0, 2), (2, 8)]),
        layout_fingerprint(digest, [(2, 5), (0, 2), (5, 8)]),
        layout_fingerprint(digest, [(0, 2), (2, 5), (5, 8), (8, 8)]),
    ]
    assert len({fingerprint, *others}) == 1 + len(others)
    with pytest.raises(ValueError, match="31 bytes"):
        layout_fingerprint(digest[:31], layout)
    with pytest.raises(ValueError, match=r"rank 1: layer range \[5, 2\)"):
        layout_fingerprint(digest, [(0, 2), (5, 2)])
