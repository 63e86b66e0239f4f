"""The packed matmul's interpreter cases (packed_matmul_triton_cases.py) in a pytest of their
own, with TRITON_INTERPRET=1 set before triton is imported there and nowhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.requirements import require

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs these kernels compiled "
                    "instead (test_packed_triton_cuda.py)")
def test_the_packed_kernels_under_the_interpreter():
    require("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/engine/packed_matmul_triton_cases.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
