"""x @ w.T straight from mlx-lm's packed words on CUDA: Triton kernels that read the stored bytes.

mlx-lm stores a weight [out, in] as codes `bits` wide packed into uint32 words little end
first along the input dim ([out, in * bits / 32]), with `w = q * scale + bias` per group of
`group_size` inputs ([out, in / group_size] each). That layout is row-major by output, which
is what a GEMV wants, so it is read as stored: no repacking, and the weight in memory is the
checkpoint's own bytes.

- One bfloat16 row (a decode step of one stream): the planes kernel. Its tiles stay
  two-dimensional, [outputs, words], so every thread keeps its words, their codes and the
  inputs they meet in its own registers (a [.., words, codes] tile puts a word's codes on
  different threads and its sums become shuffles: twice as slow, measured). Code j of the
  words is one plane; each thread's four words sit side by side (one 16-byte load), and the
  inputs come as 64-bit loads of four bfloat16 each. The group's scale and bias apply per
  word: sum_j x_j (q_j s + b) = s * sum_j x_j q_j + b * sum_j x_j.
- Up to DOT_ROWS_MAX rows (a few streams, or a row of another dtype): the dot kernel
  dequantizes a tile of weights in registers (float32, rounded once to the activation
  dtype) and runs one tl.dot against the rows' inputs.
- More rows (prompt chunks): the weight is dequantized to the activation dtype tile-wise and
  the dense matmul (cuBLAS) runs: one write and read of the weight, small beside a chunk's
  FLOPs.

Each program takes a tile of outputs and a fixed chunk of the inputs (split-K, so a narrow
projection still fills the GPU); the chunks' float32 partial sums are added by a second
kernel in chunk order, so for given shapes the result is the same bytes on every run: the
grid and the order of the sums depend on the shapes only, not on the device or timing
(atomics would). The tiles and split counts are what bench/packed_tuning.py measured best
over the 8B's and the 27B hybrid's linear shapes (docs/benchmarks.md): the dot kernel's on
an H200, the planes kernel's on an H100.

Every launch has a grid fixed by the shapes and no host synchronisation, so decode rounds
capture as CUDA graphs. Kernels compile on first use (a stage's warm-up steps, before any
capture). With TRITON_INTERPRET=1 set before triton is imported the same kernels run on CPU
tensors (how CI checks them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine.backends import quant_policy

BITS = quant_policy.TRITON_BITS  # codes that never straddle a word, four or more a word
DOT_ROWS_MAX = 64  # up to this many rows: the dot kernel; above: dequantize, then cuBLAS
PLANES_ROWS_MAX = 16  # the most rows the planes kernel's rows form takes
# The planes kernel: a warp over 4 outputs and 128 words a step (4 words a thread, side by
# side), up to PLANES_WARPS_MAX warps of a program sharing its inputs.
PLANES_OUTPUTS, PLANES_WORDS, PLANES_WARPS_MAX = 4, 128, 4
# Warps the planes kernel's launch aims for (a narrow projection's programs get more warps,
# then split-K chunks), and programs the dot kernel's aims for at most (split-K chunks are
# added until it would pass them). Constants, not the device's SM count, so the partial
# sums (and the bytes) are the same on every GPU that runs the same shapes.
PLANES_WARPS, DOT_PROGRAMS = 1024, 1536
DOT_SPLITS_MAX = 8


@triton.jit
def _codes_to_float(q):
    # 0x4B000000 is 2**23 as float32 bits: with a code (< 2**23) in its mantissa it is
    # 2**23 + q, and subtracting 2**23 converts without I2F, a fraction of the ALU's rate.
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _bf16_pair(half):
    """The two bfloat16 in a 32-bit word as float32 (low, high): a bfloat16 is a float32's
    top 16 bits."""
    low = (half << 16).to(tl.float32, bitcast=True)
    high = (half & -65536).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _plane(words, j: tl.constexpr, BITS: tl.constexpr):
    """Code j of every word, as float32."""
    return _codes_to_float((words >> (j * BITS)) & ((1 << BITS) - 1))


@triton.jit
def _store_rows(out_ptr, total, offs_m, offs_n, m_ok, n_ok, pid_s, M, N,
                PARTIAL: tl.constexpr):
    """A program's [rows, outputs] sums: chunk pid_s's float32 partials (split-K), or the
    result in the output's dtype."""
    out = offs_m[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * M * N + out, total, mask=ok)
    else:
        tl.store(out_ptr + out, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_planes_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, words_split, steps,
                        stride_wn, stride_sn,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr, PARTIAL: tl.constexpr, TMA: tl.constexpr,
                        STAGES: tl.constexpr):
    """One bfloat16 row: out[n] (or chunk pid_s's partial sum) = sum over k of x[k] * w[n, k].
    x_ptr is the row viewed as int64: four inputs a load, taken apart with shifts.
    STAGES: steps whose tiles are loaded at once (into shared memory, ahead of their sums;
    1: each step's loads, then its sums). TMA: w_ptr, s_ptr and b_ptr are tensor
    descriptors, and the tiles come by Hopper's copy engine."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    QUADS: tl.constexpr = PER_WORD // 4  # int64 loads of inputs per word
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    GROUPS: tl.constexpr = BLOCK_W // WORDS_PER_GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    w_start = pid_s * words_split
    for step in tl.range(0, steps, num_stages=STAGES):
        kw = w_start + step * BLOCK_W + offs_w
        if TMA:
            k0 = w_start + step * BLOCK_W
            words = w_ptr.load([pid_n * BLOCK_N, k0])
            # A group's scale and bias, repeated for each of its words.
            scale = tl.reshape(tl.broadcast_to(
                s_ptr.load([pid_n * BLOCK_N, k0 // WORDS_PER_GROUP])[:, :, None],
                (BLOCK_N, GROUPS, WORDS_PER_GROUP)), (BLOCK_N, BLOCK_W)).to(tl.float32)
            bias = tl.reshape(tl.broadcast_to(
                b_ptr.load([pid_n * BLOCK_N, k0 // WORDS_PER_GROUP])[:, :, None],
                (BLOCK_N, GROUPS, WORDS_PER_GROUP)), (BLOCK_N, BLOCK_W)).to(tl.float32)
        else:
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + kw[None, :],
                            mask=n_ok[:, None], other=0)
            g = offs_n[:, None] * stride_sn + (kw // WORDS_PER_GROUP)[None, :]
            scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        dots = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        xsum = tl.zeros((1, BLOCK_W), dtype=tl.float32)
        for c in tl.static_range(QUADS):
            # [1, BLOCK_W], not [BLOCK_W]: loaded straight in the words' own layout (threads
            # along the words), where a vector would be loaded in its own and converted.
            quad = tl.load(x_ptr + (kw * QUADS + c)[None, :])  # inputs 4c .. 4c + 3
            x0, x1 = _bf16_pair(quad.to(tl.int32))
            x2, x3 = _bf16_pair((quad >> 32).to(tl.int32))
            dots += _plane(words, 4 * c, BITS) * x0
            dots += _plane(words, 4 * c + 1, BITS) * x1
            dots += _plane(words, 4 * c + 2, BITS) * x2
            dots += _plane(words, 4 * c + 3, BITS) * x3
            xsum += (x0 + x1) + (x2 + x3)
        acc += dots * scale + xsum * bias
    total = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + pid_s * N + offs_n, total, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, words_split, steps,
                      stride_xq, stride_wn, stride_sn,
                      BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PARTIAL: tl.constexpr,
                      STAGES: tl.constexpr):
    """A few bfloat16 rows on the planes kernel's tiles: each plane dequantized once
    (q * scale + bias, float32) and met by every row's inputs, the rows a leading dimension
    each thread holds whole, so a word's codes stay in its thread as for one row. x_ptr: the
    rows viewed as int64, stride_xq apart; ROWS: M rounded up to a power of two."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    QUADS: tl.constexpr = PER_WORD // 4
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_ok, r_ok = offs_n < N, offs_r < M
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_W), dtype=tl.float32)
    w_start = pid_s * words_split
    for step in tl.range(0, steps, num_stages=STAGES):
        kw = w_start + step * BLOCK_W + offs_w
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + kw[None, :],
                        mask=n_ok[:, None], other=0)
        g = offs_n[:, None] * stride_sn + (kw // WORDS_PER_GROUP)[None, :]
        scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        for c in tl.static_range(QUADS):
            quad = tl.load(x_ptr + offs_r[:, None, None] * stride_xq
                           + (kw * QUADS + c)[None, None, :],
                           mask=r_ok[:, None, None], other=0)  # [rows, 1, words]
            x0, x1 = _bf16_pair(quad.to(tl.int32))
            x2, x3 = _bf16_pair((quad >> 32).to(tl.int32))
            acc += (_plane(words, 4 * c, BITS) * scale + bias)[None, :, :] * x0
            acc += (_plane(words, 4 * c + 1, BITS) * scale + bias)[None, :, :] * x1
            acc += (_plane(words, 4 * c + 2, BITS) * scale + bias)[None, :, :] * x2
            acc += (_plane(words, 4 * c + 3, BITS) * scale + bias)[None, :, :] * x3
    _store_rows(out_ptr, tl.sum(acc, axis=2), offs_r, offs_n, r_ok, n_ok, pid_s, M, N,
                PARTIAL)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, k_split, steps,
                stride_xm, stride_wn, stride_sn,
                BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BY_PLANE: tl.constexpr):
    """A few rows: out[m, n] (or chunk pid_s's partial sum) = sum over k of x[m, k] * w[n, k],
    each tile of weights dequantized in registers (float32, rounded once to the activation
    dtype), then tl.dot against the rows' inputs. BY_PLANE: one tl.dot a plane (code j of
    every word of the tile, against the inputs j, j + codes a word, ...), so the codes never
    leave the thread that loaded their word; else the codes are laid out along the inputs
    (a [outputs, words, codes] tile reshaped) and one tl.dot takes the whole tile."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_kw = tl.arange(0, BLOCK_K // PER_WORD)
    shifts = tl.arange(0, PER_WORD) * BITS
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = offs_n[:, None] * stride_sn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_split
    for step in range(steps):
        k0 = k_start + step * BLOCK_K
        words = tl.load(w_rows + (k0 // PER_WORD + offs_kw)[None, :], mask=n_ok[:, None],
                        other=0)
        if BY_PLANE:
            # Each word's group, its scale and bias beside it: [outputs, words].
            g = s_rows + ((k0 // PER_WORD + offs_kw) // (GROUP // PER_WORD))[None, :]
            scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            for j in tl.static_range(PER_WORD):
                x = tl.load(x_rows + (k0 + offs_kw * PER_WORD + j)[None, :],
                            mask=m_ok[:, None], other=0.0)
                w = _plane(words, j, BITS) * scale + bias
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        else:
            q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            q = tl.reshape(q, (BLOCK_N, GROUPS, GROUP))
            g = s_rows + (k0 // GROUP + tl.arange(0, GROUPS))[None, :]
            scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            w = tl.reshape(_codes_to_float(q) * scale[:, :, None] + bias[:, :, None],
                           (BLOCK_N, BLOCK_K))
            x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_ok[:, None],
                        other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    _store_rows(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, pid_s, M, N, PARTIAL)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the chunks' partial sums, always added in chunk order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(partial_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_wn, stride_sn,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """out [N, K] in the activation dtype = q * scale + bias (float32, rounded once)."""
    PER_WORD: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = offs_n < N
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn
                    + (k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD))[None, :],
                    mask=n_ok[:, None], other=0)
    q = (words[:, :, None] >> (tl.arange(0, PER_WORD) * BITS)[None, None, :]) \
        & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, GROUPS, GROUP))
    g = offs_n[:, None] * stride_sn + (k0 // GROUP + tl.arange(0, GROUPS))[None, :]
    scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
    w = tl.reshape(_codes_to_float(q) * scale[:, :, None] + bias[:, :, None],
                   (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


@dataclass(frozen=True)
class Launch:
    """How one matmul shape runs: block_m 1 is the planes kernel (block_k inputs a step as
    32 * num_warps threads' words; for several bfloat16 rows, its rows form), else the dot
    kernel; splits input chunks (split-K).
    num_stages: the planes kernel's steps loaded at once (1: none ahead), the dot kernel's
    software pipeline."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int
    # The planes kernel: tiles by tensor descriptors (Hopper's copy engine) where the weight's
    # alignment allows (else pointer loads: the same sums, the same bytes).
    tma: bool = False
    # The dot kernel: one tl.dot a plane of codes (else one a tile, its codes reshaped).
    by_plane: bool = False


def _largest_power_of_two_dividing(n: int, most: int) -> int:
    block = 1
    while block * 2 <= most and n % (block * 2) == 0:
        block *= 2
    return block


def _splits(k_blocks: int, tiles: int, programs: int, most: int) -> int:
    """The most input chunks that divide the inputs' tiles (every program runs the same
    loop) while the grid stays within `programs`."""
    return max(s for s in range(1, min(most, k_blocks) + 1)
               if k_blocks % s == 0 and (s == 1 or tiles * s <= programs))


@functools.cache
def plan(rows: int, out_features: int, in_features: int, group_size: int, bits: int,
         dtype: torch.dtype = torch.bfloat16) -> Launch:
    """The launch for x [rows, in] @ w.T [in, out]: a function of the shapes alone, so every
    process running these shapes adds the same partial sums in the same order."""
    per_word = 32 // bits
    if rows == 1 and dtype == torch.bfloat16:
        # Measured (docs/benchmarks.md, the tuning sweeps): one warp a program and each
        # program's inputs whole, where the outputs give PLANES_WARPS warps; a narrower
        # projection's programs take more warps side by side along the inputs (summed within
        # the program) before split-K programs, whose parts a second kernel adds.
        per_row = in_features // per_word
        tiles = triton.cdiv(out_features, PLANES_OUTPUTS)
        warps = 1
        while (warps < PLANES_WARPS_MAX and tiles * warps < PLANES_WARPS
               and per_row % (2 * warps * PLANES_WORDS) == 0):
            warps *= 2
        words = _largest_power_of_two_dividing(per_row, warps * PLANES_WORDS)
        splits = _splits(per_row // words, tiles, PLANES_WARPS // warps, 32)
        # The next step's words loaded while this one's are summed (tl.range's pipeline):
        # 15-28 % off the one-stage launch where the sweep timed it (2026-12-07, H100),
        # and the best launch of every linear with more than one step loads ahead.
        stages = 2 if per_row // words // splits >= 2 else 1
        return Launch(1, PLANES_OUTPUTS, words * per_word, splits, warps, stages)
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = group_size * _largest_power_of_two_dividing(in_features // group_size,
                                                          max(1, 128 // group_size))
    tiles = triton.cdiv(out_features, 64) * triton.cdiv(rows, block_m)
    splits = _splits(in_features // block_k, tiles, DOT_PROGRAMS, DOT_SPLITS_MAX)
    return Launch(block_m, 64, block_k, splits, 4, 3)


def _descriptors_fit(launch: Launch, words: torch.Tensor, scales: torch.Tensor,
                     biases: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the planes kernel's tiles can come by tensor descriptor: TMA wants 16-byte
    aligned bases and row strides, rows contiguous, and a tile 16 bytes to 256 values wide."""
    tile_words, tile_groups = launch.block_k * bits // 32, launch.block_k // group_size
    return (all(t.data_ptr() % 16 == 0 and t.stride(1) == 1
                and t.stride(0) * t.element_size() % 16 == 0 for t in (words, scales, biases))
            and 4 <= tile_words <= 256 and 16 // scales.element_size() <= tile_groups <= 256
            and launch.block_n <= 256)


def packed_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                  biases: torch.Tensor, bits: int, group_size: int,
                  launch: Launch | None = None) -> torch.Tensor:
    """x [rows, in] (bfloat16, float16 or float32) @ w.T with w in mlx-lm's packed form:
    words int32 [out, in * bits / 32] (the stored uint32 bits), scales and biases
    [out, in / group_size] -> [rows, out] in x's dtype. `launch`: instead of `plan`'s."""
    rows, in_features = x.shape
    out_features = words.shape[0]
    if rows == 0:  # a kernel refuses an empty grid
        return x.new_empty(0, out_features)
    if launch is None and rows > DOT_ROWS_MAX:  # prompt chunks: dequantize, then cuBLAS
        return torch.nn.functional.linear(x, dequantize(words, scales, biases, bits,
                                                        group_size, x.dtype))
    x = x.contiguous()
    launch = launch or plan(rows, out_features, in_features, group_size, bits, x.dtype)
    out = x.new_empty(rows, out_features)
    partial = launch.splits > 1
    target = (torch.empty(launch.splits, rows, out_features, device=x.device,
                          dtype=torch.float32) if partial else out)
    k_split = in_features // launch.splits
    steps = k_split // launch.block_k
    if launch.block_m == 1:  # the planes kernel, one row or its rows form
        if x.dtype != torch.bfloat16 or rows > PLANES_ROWS_MAX:
            raise ValueError(f"the planes kernel takes 1 to {PLANES_ROWS_MAX} bfloat16 rows, "
                             f"not {rows} of {x.dtype}")
        if x.data_ptr() % 8:  # read as int64: a view at an odd offset is copied first
            x = x.clone()
        per_word = 32 // bits
        grid = (triton.cdiv(out_features, launch.block_n), launch.splits)
    if launch.block_m == 1 and rows > 1:
        _gemv_rows_kernel[grid](x.view(torch.int64), words, scales, biases, target, rows,
                                out_features, k_split // per_word, steps, x.stride(0) // 4,
                                words.stride(0), scales.stride(0), BITS=bits,
                                GROUP=group_size, ROWS=triton.next_power_of_2(rows),
                                BLOCK_N=launch.block_n, BLOCK_W=launch.block_k // per_word,
                                PARTIAL=partial, STAGES=launch.num_stages,
                                num_warps=launch.num_warps, num_stages=launch.num_stages)
    elif launch.block_m == 1:
        stride_wn, stride_sn = words.stride(0), scales.stride(0)
        if launch.tma and _descriptors_fit(launch, words, scales, biases, bits, group_size):
            w_tile = [launch.block_n, launch.block_k // per_word]
            s_tile = [launch.block_n, launch.block_k // group_size]
            words, scales, biases = (TensorDescriptor.from_tensor(words, w_tile),
                                     TensorDescriptor.from_tensor(scales, s_tile),
                                     TensorDescriptor.from_tensor(biases, s_tile))
        _gemv_planes_kernel[grid](x.view(torch.int64), words, scales, biases, target,
                                  out_features, k_split // per_word, steps, stride_wn,
                                  stride_sn, BITS=bits, GROUP=group_size,
                                  BLOCK_N=launch.block_n, BLOCK_W=launch.block_k // per_word,
                                  PARTIAL=partial, TMA=isinstance(words, TensorDescriptor),
                                  STAGES=launch.num_stages,
                                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    else:
        grid = (triton.cdiv(out_features, launch.block_n), triton.cdiv(rows, launch.block_m),
                launch.splits)
        _dot_kernel[grid](x, words, scales, biases, target, rows, out_features, k_split, steps,
                          x.stride(0), words.stride(0), scales.stride(0),
                          BITS=bits, GROUP=group_size, BLOCK_M=launch.block_m,
                          BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PARTIAL=partial,
                          # float32 rows in full float32, not TF32; half types ignore it.
                          DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                          BY_PLANE=launch.by_plane,
                          num_warps=launch.num_warps, num_stages=launch.num_stages)
    if partial:
        size, block = rows * out_features, 1024
        _sum_splits_kernel[(triton.cdiv(size, block),)](target, out, size,
                                                        SPLITS=launch.splits, BLOCK=block)
    return out



@torch.library.custom_op("ringfleet::packed_matmul", mutates_args=())
def packed_matmul_op(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                     biases: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """`packed_matmul` (with `plan`'s launch) as an operator torch.compile keeps whole, so
    the compiled decode step takes packed stages too: Dynamo cannot trace the launches (their
    grids are host values), and the layer's norms, rotary and residual adds around them are
    what compiling fuses (about 2 ms of an 8B round at one stream, docs/benchmarks.md).
    PackedWeight.matmul calls it, eager or compiled."""
    return packed_matmul(x, words, scales, biases, bits, group_size)


@packed_matmul_op.register_fake
def _(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
      bits: int, group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], words.shape[0])

def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [out, in] in `dtype` (each weight rounded once from float32)."""
    out_features = words.shape[0]
    in_features = words.shape[1] * 32 // bits
    out = torch.empty(out_features, in_features, device=words.device, dtype=dtype)
    block_n = 32
    block_k = group_size * _largest_power_of_two_dividing(in_features // group_size,
                                                          max(1, 256 // group_size))
    grid = (triton.cdiv(out_features, block_n), in_features // block_k)
    _dequantize_kernel[grid](words, scales, biases, out, out_features, in_features,
                             words.stride(0), scales.stride(0), BITS=bits, GROUP=group_size,
                             BLOCK_N=block_n, BLOCK_K=block_k)
    return out
