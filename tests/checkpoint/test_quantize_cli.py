"""`python -m engine.checkpoint make --quantize` writes a checkpoint both backends serve."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.backends.base import StageSpec, load_stage


def test_make_quantize_writes_mlx_lm_affine_that_both_backends_load(tmp_path):
    out = tmp_path / "q8"
    made = subprocess.run([sys.executable, "-m", "engine.checkpoint", "make", str(out),
                           "--preset", "tiny", "--quantize", "8", "--group-size", "32"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dense-")]
    for backend in ("torch-cpu", "mlx-cpu"):
        stage = load_stage(StageSpec(out, (0, 2), backend, 1, 32, 16))
        assert stage.is_first


def test_group_size_without_quantize_is_refused(tmp_path):
    made = subprocess.run([sys.executable, "-m", "engine.checkpoint", "make",
                           str(tmp_path / "x"), "--group-size", "32"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert made.returncode == 2 and "--group-size needs --quantize" in made.stderr
