"""Reading a Hugging Face checkpoint: validated at open, and only the tensors a stage asks for.

A stage opens the checkpoint, checks each tensor's shape against `config.json` from the
safetensors headers alone, then loads just its own range: resident memory follows the
range, not the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from engine.config import SUPPORTED_FAMILIES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and the tensor."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _safe_open(path: Path, framework: str, **options: Any) -> Any:
    """safe_open, with its untyped errors (no file, bad header) turned into CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return safe_open(path, framework=framework, **options)
    except Exception as exc:  # safetensors raises SafetensorError, OSError or ValueError
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint directory: its raw config.json and which file holds each tensor."""

    dir: Path
    config: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> safetensors file name
    # file name -> {tensor name -> (dtype, shape)}, filled from headers on first use.
    _headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = field(
        default_factory=dict, repr=False, compare=False)

    def tensor_names(self) -> list[str]:
        return sorted(self.weight_map)

    def safetensors_files(self) -> list[Path]:
        return [self.dir / name for name in sorted(set(self.weight_map.values()))]

    def tensor_file(self, name: str) -> Path:
        if name not in self.weight_map:
            expected = INDEX_FILE if len(set(self.weight_map.values())) > 1 else SINGLE_FILE
            raise CheckpointError(f"{self.dir / expected}: no tensor {name}")
        return self.dir / self.weight_map[name]

    def layer_tensor_names(self, layer: int) -> list[str]:
        prefix = f"model.layers.{layer}."
        return [n for n in self.tensor_names() if n.startswith(prefix)]

    def _header(self, file_name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) for one file, from its header only."""
        if file_name not in self._headers:
            path = self.dir / file_name
            with _safe_open(path, "numpy") as f:
                self._headers[file_name] = {
                    name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                    for name in f.keys()  # noqa: SIM118 - safe_open is not a mapping
                }
        return self._headers[file_name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._header_entry(name)[1]

    def tensor_dtype(self, name: str) -> str:
        return self._header_entry(name)[0]

    def _header_entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        path = self.tensor_file(name)
        entry = self._header(path.name).get(name)
        if entry is None:
            raise CheckpointError(f"{path}: the index names tensor {name}, the file lacks it")
        return entry

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        shape = self.tensor_shape(name)
        if shape != tuple(expected):
            raise CheckpointError(f"{self.tensor_file(name)}: tensor {name} has shape {shape}, "
                                  f"config.json implies {tuple(expected)}")

    def load_tensors(self, names: list[str], framework: str = "pt",
                     device: str | None = None) -> dict[str, Any]:
        """Read only `names`, file by file (framework "pt" or "numpy"; MLX uses `mx.load`)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensor_file(name), []).append(name)
        out: dict[str, Any] = {}
        for path, wanted in by_file.items():
            kwargs = {"device": device} if framework == "pt" and device else {}
            with _safe_open(path, framework, **kwargs) as f:
                present = set(f.keys())
                for name in wanted:
                    if name not in present:
                        raise CheckpointError(f"{path}: the index names tensor {name}, "
                                              "the file lacks it")
                    out[name] = f.get_tensor(name)
        return out


def open_checkpoint(directory: Path | str) -> Checkpoint:
    """Check that `directory` holds a servable checkpoint; read its config and tensor map."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    config = _read_json(directory / "config.json")
    if "model_type" not in config:
        raise CheckpointError(f"{directory / 'config.json'}: field model_type is missing")
    family = config["model_type"]
    if family not in SUPPORTED_FAMILIES:
        raise CheckpointError(f"{directory / 'config.json'}: model_type {family!r} is not "
                              f"supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    if not (directory / "tokenizer.json").exists():
        raise CheckpointError(f"{directory / 'tokenizer.json'}: missing")
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        for name, file_name in weight_map.items():
            # A bare file name only: the index must not point outside the checkpoint.
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise CheckpointError(f"{index_path}: weight_map[{name!r}] = {file_name!r} "
                                      "is not a file name in the checkpoint directory")
        for file_name in sorted(set(weight_map.values())):
            if not (directory / file_name).exists():
                raise CheckpointError(f"{directory / file_name}: missing (named by {INDEX_FILE})")
    elif (directory / SINGLE_FILE).exists():
        with _safe_open(directory / SINGLE_FILE, "numpy") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
    else:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")
    return Checkpoint(directory, config, weight_map)
