#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch, Triton and transformers but no internet: what
# bench/cuda_session.sh installs from .whl there (the engine's own dependencies, MLX for the
# CUDA test files' mixed cases, fla-core for the hybrid's kernels, pytest's plugins).
#   bash bench/gpu_wheels.sh [DIR] [PYTHON_VERSION]      # default .whl, 3.12
set -eu
dir=${1:-.whl}
version=${2:-3.12}
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# --no-deps: each package's own needs are named here, so none that the machine has (torch,
# numpy, transformers) is fetched again.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp "${platforms[@]}" -d "$dir" \
  structlog prometheus-client psutil pyyaml rich markdown-it-py mdurl pygments \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna \
  mlx mlx-cpu mlx-lm fla-core einops \
  pytest pluggy iniconfig pytest-timeout hypothesis sortedcontainers
ls "$dir"
