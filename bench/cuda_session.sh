#!/usr/bin/env bash
# One GPU session's checks and benchmarks, each step bounded, every log under $OUT (or ./out).
#   bash bench/cuda_session.sh tests kernels decode        # steps to run, in order
# Steps: tests (the CUDA tests), kernel-checks (the Triton kernels' CUDA tests), kernels (bench/decode_kernels.py), decode (whole 8B decode
# rounds at long conversations, Triton kernel against SDPA), tuning (bench/packed_tuning.py:
# the packed kernels' launches), packed (bench/quantized.py), profile (bench/stage_profile.py:
# a packed stage's round kernel by kernel),
# stacking (projections stacked at load against apart: anchor, packed, hybrid),
# anchor (short conversations against the compiled anchor), anchor-modes (the same with
# the compiled step's deterministic mode and without), anchor-profile (its rounds
# kernel by kernel), hybrid (bench/qwen3_5_decode.py),
# verify (drafting on CUDA, and bench/verify_rounds.py: a verify round against a decode
# round, the dense 8B), verify-hybrid (the same at the 27B hybrid's layer shape),
# verify-mtp (the MTP head's round at that shape against a plain round), verify-mtp-long
# (the same after 8,000 tokens, the head's draft steps by the decode kernel and gathered),
# exactness-modes (a ring against one process, each path off in turn),
# hop-two-gpus (a boundary's cost with the two stages on two GPUs, then on one),
# hybrid-verify-checks and graph-checks (the CUDA tests of verify rows and captured graphs),
# packed-checks (the packed kernels' and 4-bit stages' CUDA tests), prompt (an 8,192-token
# prompt's rate by chunk size, and its profile), prompt-attention (flash against cuDNN for
# a prompt chunk's attention: bench/prompt_attention.py, prompt rates, exactness),
# prompt-kernels (its kernels and one chunk size's rates, without the tests),
# placement (issue 24's placement bench on this host's idle CPUs, three at once, each node
# pinned to cores of its own; needs the openai client carried: openai distro jiter
# pydantic pydantic-core annotated-types typing-inspection sniffio httpx2 httpcore2 h11
# anyio truststore certifi typing-extensions).
# The GPU image has PyTorch, Triton and transformers but not the engine's other
# dependencies, nor MLX (the CUDA test files hold MLX cases too, which fail without it:
# tests/requirements.py): `bash bench/gpu_wheels.sh` downloads them into .whl, to carry.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
# Every step imports the engine: one missing package would fail them all, one by one.
missing=$(python3 - <<'PY'
import importlib.util
names = ("structlog", "aiohttp", "prometheus_client", "psutil", "yaml", "rich", "pytest",
         "pytest_timeout", "hypothesis", "mlx.core", "mlx_lm")
print(" ".join(n for n in names if importlib.util.find_spec(n.split(".")[0]) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing here: $missing (bash bench/gpu_wheels.sh, then carry .whl)" | tee -a "$OUT/steps.log"
  exit 2
fi
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), at most ${limit}s): $*" | tee -a "$OUT/steps.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  echo "=== $name: exit $status ($(date +%T))" | tee -a "$OUT/steps.log"
  tail -25 "$OUT/$name.log"
  return $status
}
for what in "$@"; do
  case $what in
    tests)  # each file bounded on its own, so one slow file leaves the others their time
      for f in tests/engine/test_kernels_cuda.py tests/engine/test_packed_triton_cuda.py \
          tests/engine/test_cuda.py tests/engine/test_packed_cuda.py \
          tests/pipeline/test_cuda_exactness.py tests/engine/test_qwen3_5_cuda.py \
          tests/engine/test_compiled_cuda.py tests/engine/test_sampling.py; do
        step "$(basename "$f" .py)" 150 python3 -m pytest -q -x -p no:cacheprovider -rs "$f"
      done ;;
    quick-tests)  # the kernels' own checks, the compiled step and exactness across stages
      for f in tests/engine/test_kernels_cuda.py tests/engine/test_compiled_cuda.py \
          tests/pipeline/test_cuda_exactness.py; do
        step "$(basename "$f" .py)" 130 python3 -m pytest -q -x -p no:cacheprovider -rs "$f"
      done ;;
    kernel-checks) step test_kernels_cuda 240 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_kernels_cuda.py ;;
    kernels) step kernels 240 python3 bench/decode_kernels.py --streams 1,8,32 \
        --lengths 96,8000,30000 ;;
    decode)
      step decode-triton 300 python3 bench/decode.py --preset 8b --device cuda \
        --contexts 32768 --prompt 8000 --batches 1,8 --repeats 2 --no-reference
      FLEET_DECODE_ATTENTION=sdpa step decode-sdpa 200 python3 bench/decode.py --preset 8b \
        --device cuda --contexts 32768 --prompt 8000 --batches 1,8 --repeats 2 \
        --no-reference ;;
    tuning) step tuning 420 python3 bench/packed_tuning.py ${TUNING_ARGS:-} ;;
    anchor-profile)  # a short conversation's decode round kernel by kernel, 1 and 8 streams:
      # the kernels' sum against the step the anchor bench times shows the host's share
      for streams in 1 8; do
        step "anchor-profile-$streams" 150 python3 bench/decode_profile.py --preset 8b \
          --streams "$streams" --prompt 32 --context 32768 --rounds 10 --top 30
      done ;;
    profile)
      step profile-graphs 250 python3 bench/stage_profile.py --rows 1 --top 14
      step profile-eager 300 python3 bench/stage_profile.py --rows 8 --no-graphs --top 12 ;;
    prompt)  # one stream's 8,192-token prompt by chunk size, and where a chunk's time goes
      for chunk in 512 2048 8192; do
        step "prompt-$chunk" 150 python3 bench/decode.py --preset 8b --device cuda \
          --prompt-rate 8192 --chunk "$chunk" --repeats 3 --no-reference
      done
      step prompt-profile 150 python3 bench/decode_profile.py --preset 8b --prompt-only \
        --prompt 8192 --prompt-chunk 2048 --top 30 ;;
    prompt-attention)  # a prompt chunk's attention by flash and by cuDNN: kernels, checks,
      # an 8,192-token prompt's rate by each, and a ring against one process under cuDNN
      step test_prompt_attention 200 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_prompt_attention.py
      step prompt-attention 120 python3 bench/prompt_attention.py
      for kernel in flash cudnn; do
        for chunk in 2048 8192; do
          FLEET_PROMPT_ATTENTION=$kernel step "prompt-$kernel-$chunk" 100 python3 \
            bench/decode.py --preset 8b --device cuda --prompt-rate 8192 --chunk "$chunk" \
            --repeats 3 --no-reference
        done
      done
      FLEET_PROMPT_ATTENTION=cudnn step test_cuda_exactness_cudnn 240 python3 -m pytest -q -x \
        --tb=short -p no:cacheprovider -rs tests/pipeline/test_cuda_exactness.py ;;
    prompt-kernels)  # the short form of prompt-attention: the kernels side by side and an
      # 8,192-token prompt's rate by each at 2,048-row chunks
      step prompt-attention 120 python3 bench/prompt_attention.py
      for kernel in flash cudnn; do
        FLEET_PROMPT_ATTENTION=$kernel step "prompt-$kernel-2048" 100 python3 bench/decode.py \
          --preset 8b --device cuda --prompt-rate 8192 --chunk 2048 --repeats 3 --no-reference
      done ;;
    placement)  # predicted against measured placements on a quiet many-core host: the
      # generated dense and hybrid models on two torch-cpu nodes and on torch + MLX, every
      # node calibrated again before each placement. The three benches run at once, each on
      # four cores of its own (two a node), so that they fit one call; cores 12 and up stay
      # free for GPU steps run beside them (`taskset -c 12-15 bash bench/cuda_session.sh ...`).
      # PLACEMENTS (bench/placement.py --placements) and PLACEMENT_S (each bench's limit)
      # shorten it for a call with less device time
      i=0
      for nodes in "small torch-cpu" "small-hybrid torch-cpu" "small-hybrid mlx-cpu"; do
        read -r preset node_b <<< "$nodes"
        step "placement-$preset-$node_b" "${PLACEMENT_S:-540}" \
          taskset -c "$((4 * i))-$((4 * i + 3))" env OMP_NUM_THREADS=1 \
          python3 bench/placement.py --preset "$preset" --node-b "$node_b" \
          --prompt-tokens 256 --chunk 64 --context 320 \
          --checkpoints "/tmp/checkpoints-$i" --pin --remeasure \
          ${PLACEMENTS:+--placements "$PLACEMENTS"} &
        i=$((i + 1))
      done
      wait ;;
    packed-checks)  # the packed kernels and 4-bit stages on CUDA (compiled where auto)
      for f in tests/engine/test_packed_triton_cuda.py tests/engine/test_packed_cuda.py; do
        step "$(basename "$f" .py)" 150 python3 -m pytest -q -x -p no:cacheprovider -rs "$f"
      done ;;
    hop-two-gpus)  # issue 25's hop with each stage on a GPU of its own (a machine of two:
      # run with kind nvidia-h100-x2), where one GPU's two processes took turns; then the same
      # split on one GPU, as before, for the ratio in one run
      for devices in 0,1 0,0; do
        step "hop-$devices" 280 python3 bench/pipeline.py --preset 8b \
          --backends torch-cuda,torch-cuda --devices "$devices" --prompt 2048 --chunk 512 \
          --repeats 2 --steps 16
      done ;;
    packed) step packed 330 python3 bench/quantized.py --device cuda --shape 8b --triton \
        --layers 16 --stage-layers 32 ;;
    anchor) step anchor 300 python3 bench/decode.py --preset 8b --device cuda --anchor \
        --batches 1,8 --no-reference ;;
    anchor-modes)  # what the compiled step's deterministic mode costs: the anchor's table
      # with the mode (as served), then with Inductor timing its choices (as before it)
      step anchor 300 python3 bench/decode.py --preset 8b --device cuda --anchor \
        --batches 1,8 --no-reference
      step anchor-timed 300 python3 bench/decode.py --preset 8b --device cuda --anchor \
        --batches 1,8 --no-reference --inductor-timed ;;
    stacking)  # q/k/v, gate/up and a DeltaNet layer's inputs stacked (served) against
      # each projection apart (--unstacked): the anchor's table, packed 4-bit rounds, the hybrid
      for way in stacked unstacked; do
        flag=$([ $way = unstacked ] && echo --unstacked)
        step "anchor-$way" 300 python3 bench/decode.py --preset 8b --device cuda --anchor \
          --batches 1,8 --no-reference $flag
        step "packed-$way" 330 python3 bench/quantized.py --device cuda --shape 8b --triton \
          --layers 16 --stage-layers 32 $flag
        step "hybrid-$way" 300 python3 bench/qwen3_5_decode.py --layers 8 --no-transformers \
          $flag
      done ;;
    compiled) step test_compiled_cuda 130 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_compiled_cuda.py ;;
    exactness)  # a ring against one process; where it fails, the first case eagerly too
      step test_cuda_exactness 300 python3 -m pytest -q -x --tb=short -p no:cacheprovider \
        -rs tests/pipeline/test_cuda_exactness.py \
      || FLEET_COMPILE=off step test_cuda_exactness_eager 150 python3 -m pytest -q -x \
        --tb=short -p no:cacheprovider -rs tests/pipeline/test_cuda_exactness.py \
        -k "llama and float32" ;;
    exactness-modes)  # a ring against one process with graphs, then the compiled step, off
      step test_cuda_exactness_modes 300 python3 -m pytest -q --tb=short -p no:cacheprovider \
        -rs tests/pipeline/test_cuda_exactness_modes.py ;;
    hybrid) step hybrid 300 python3 bench/qwen3_5_decode.py --layers 8 ;;
    verify)  # speculative rounds: exactness on CUDA, and their cost against a decode round
      step test_drafting 150 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/pipeline/test_drafting.py -k cuda
      step verify-8b 240 python3 bench/verify_rounds.py --device cuda --preset 8b
      ;;
    gpu-checks)  # this session's changes on CUDA: hybrids, drafting, the kernels' checks
      step test_qwen3_5_cuda 120 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_qwen3_5_cuda.py
      step test_drafting 100 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/pipeline/test_drafting.py -k cuda
      step test_kernels_cuda 130 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_kernels_cuda.py ;;
    verify-hybrid) step verify-hybrid 240 python3 bench/verify_rounds.py --device cuda ${VERIFY_ARGS:-} \
        --hybrid --layers 8 ;;
    verify-mtp) step verify-mtp 300 python3 bench/verify_rounds.py --device cuda --mtp \
        --layers 8 --drafts 1,2,3 --streams 1,4 ;;
    verify-mtp-long)  # the head's draft steps after 8,000 tokens: by the decode kernel (the
      # default), then gathered under SDPA's mask (which the model's decode rows take too)
      for way in triton sdpa; do
        FLEET_DECODE_ATTENTION=$way step "verify-mtp-long-$way" 280 python3 \
          bench/verify_rounds.py --device cuda --mtp --layers 8 --drafts 1,3 --streams 1,4 \
          --prompt 8000
      done ;;
    hybrid-verify-checks)  # a hybrid's verify rows as decode rows, in captured graphs
      step test_qwen3_5_verify 150 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_qwen3_5_verify.py -k cuda
      step test_qwen3_5_cuda 120 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/engine/test_qwen3_5_cuda.py ;;
    graph-checks)  # the graphs' keys and the dense paths after a change to them
      for f in tests/engine/test_cuda.py tests/engine/test_compiled_cuda.py; do
        step "$(basename "$f" .py)" 150 python3 -m pytest -q -x -p no:cacheprovider -rs "$f"
      done
      step test_drafting 100 python3 -m pytest -q -x -p no:cacheprovider -rs \
        tests/pipeline/test_drafting.py -k cuda ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
