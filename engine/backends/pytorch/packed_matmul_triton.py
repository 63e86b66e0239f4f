"""x @ w.T straight from mlx-lm's packed words on CUDA: Triton kernels that read the stored bytes.

mlx-lm stores a weight [out, in] as codes `bits` wide packed into uint32 words little end
first along the input dim ([out, in * bits / 32]), with `w = q * scale + bias` per group of
`group_size` inputs ([out, in / group_size] each). That layout is row-major by output, which
is what a GEMV wants, so it is read as stored: no repacking, and the weight in memory is the
checkpoint's own bytes.

Decode rows (up to DOT_ROWS_MAX): each program takes a tile of output features and a fixed
chunk of the inputs (split-K, so a narrow projection still fills the GPU), unpacks the codes
in registers, dequantizes them in float32 and accumulates in float32: one row as products
summed in registers (GEMV_ROWS_MAX), more through tl.dot on the weights rounded to
the activation dtype. The chunks' partial sums are added by a second kernel in chunk order,
so for given shapes the result is the same bytes on every run: the grid and the order of
the sums depend on the shapes only, not on the device or timing (atomics would). Larger row counts (prompt chunks) dequantize
the weight to the activation dtype tile-wise and run the dense matmul (cuBLAS): its cost
over dense is one write and read of the weight, small beside a chunk's FLOPs, where the dot
kernel's tiles are not tuned for large rows (the bench times both at 2048 rows).

The tile sizes and split counts were chosen without a GPU to measure on; the bench
(bench/quantized.py --triton) times each linear shape, both unpackings (Launch.gather)
and the packed floor, to tune them by.

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

BITS = (2, 4, 8)  # widths whose codes never straddle a word
GEMV_ROWS_MAX = 1  # a single row: products in registers (tl.dot pads rows to 16)
DOT_ROWS_MAX = 64  # up to this many rows: the fused kernel; above: dequantize, then cuBLAS
UNPACK_GATHER = False  # plan's unpacking (Launch.gather); the bench times both
# Programs a launch aims for: a few per SM of an H200 (132), so a narrow projection still
# keeps every SM busy. A constant, not the device's count, so the partial sums (and the
# bytes) are the same on every GPU that runs the same shapes.
PROGRAMS_WANTED = 512


@triton.jit
def _codes_to_float(q):
    # 0x4B000000 is 2**23 as float32 bits: with a code (< 2**23) in its mantissa it is
    # 2**23 + q, and subtracting 2**23 converts without I2F, a fraction of the ALU's rate.
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _packed_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N,
                          stride_xm, stride_wn, stride_sn,
                          BITS: tl.constexpr, GROUP: tl.constexpr, K_SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                          PARTIAL: tl.constexpr, GATHER: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    """out[m, n] (or chunk pid_s's partial sum) = sum over k of x[m, k] * w[n, k]."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // PER_WORD)
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = offs_n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One row: products summed elementwise over the loop, across lanes once at the end.
    acc_1 = tl.zeros((BLOCK_N, BLOCK_K // PER_WORD), dtype=tl.float32)
    k_start = pid_s * K_SPLIT
    for step in range(K_SPLIT // BLOCK_K):  # the same trip count in every program
        k0 = k_start + step * BLOCK_K
        # Code j of a word sits at bits j * BITS up; the arithmetic shift's smeared sign
        # bit is masked off with the rest.
        if GATHER:
            # Each input reads its own word, scale and bias: a word's PER_WORD inputs read
            # one address (one transaction), one [BLOCK_N, BLOCK_K] tile.
            k = k0 + offs_k
            words = tl.load(w_rows + (k // PER_WORD)[None, :], mask=n_ok[:, None], other=0)
            q = (words >> ((k % PER_WORD) * BITS)[None, :]) & ((1 << BITS) - 1)
            g = s_rows + (k // GROUP)[None, :]
            scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            w = _codes_to_float(q) * scale + bias  # [BLOCK_N, BLOCK_K] float32
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            if USE_DOT:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
            else:  # BLOCK_M == 1
                acc += tl.reshape(tl.sum(x.to(tl.float32) * w, axis=1), (1, BLOCK_N))
        else:
            # One word per thread, each word's codes taken as PER_WORD planes (plane j holds
            # inputs word * PER_WORD + j): every tile stays [BLOCK_N, words], no reshape.
            kw = k0 // PER_WORD + offs_w
            words = tl.load(w_rows + kw[None, :], mask=n_ok[:, None], other=0)
            g = s_rows + (kw // (GROUP // PER_WORD))[None, :]  # a word's group
            scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
            for j in tl.static_range(PER_WORD):
                q = (words >> (j * BITS)) & ((1 << BITS) - 1)
                w = _codes_to_float(q) * scale + bias  # [BLOCK_N, BLOCK_K / PER_WORD]
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (kw * PER_WORD + j)[None, :],
                            mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K / PER_WORD]
                if USE_DOT:
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
                else:  # BLOCK_M == 1
                    acc_1 += x.to(tl.float32) * w
    if not USE_DOT and not GATHER:
        acc = tl.reshape(tl.sum(acc_1, axis=1), (BLOCK_M, BLOCK_N))
    out = offs_m[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:  # float32 [splits, M, N], added up in chunk order by _sum_splits_kernel
        tl.store(out_ptr + pid_s * M * N + out, acc, mask=ok)
    else:
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
    """How one matmul shape runs: tiles, the input chunk each program takes, warps."""

    block_m: int
    block_n: int
    block_k: int
    splits: int  # input chunks (split-K); 1: the kernel writes the output itself
    use_dot: bool
    num_warps: int
    num_stages: int
    # Unpack by reading each input's word (True) or one word per thread taken apart into
    # planes of codes (False: no reshape, fewer registers and instructions in the sm_90 code
    # ptxas gives); bench/quantized.py --triton times both.
    gather: bool = False


def _block_k(in_features: int, group_size: int, widest: int) -> int:
    """The widest tile of inputs up to `widest` that divides the inputs, whole groups each."""
    block = group_size
    while block * 2 <= widest and in_features % (block * 2) == 0:
        block *= 2
    return block


@functools.cache
def plan(rows: int, out_features: int, in_features: int, group_size: int, bits: int,
         gather: bool = False) -> Launch:
    """The launch for x [rows, in] @ w.T [in, out]: a function of the shapes alone, so every
    process running these shapes adds the same partial sums in the same order."""
    use_dot = rows > GEMV_ROWS_MAX
    per_word = 32 // bits
    if use_dot:
        block_m = max(16, triton.next_power_of_2(rows))
        block_n, block_k, warps = 64, _block_k(in_features, group_size, 16 * per_word), 4
        # The planes' dots take block_k / per_word inputs each, and tl.dot wants 16 or
        # more: where the inputs allow no such tile, each input reads its own word.
        gather = gather or block_k // per_word < 16
    else:
        block_m = triton.next_power_of_2(rows)
        block_n, block_k, warps = 32, _block_k(in_features, group_size, 256), 4
    tiles = triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m)
    k_blocks = in_features // block_k
    # Chunks enough to bring the grid to the programs wanted, but their float32 partial
    # sums (written and read again) at most a quarter of the weight's bytes; a number that
    # divides the inputs' tiles, so every program runs the same loop.
    want = triton.cdiv(PROGRAMS_WANTED, tiles)
    bound = max(1, in_features * bits // (128 * rows))  # splits * rows * 4 <= in * bits / 32
    splits = max(s for s in range(1, min(want, bound, k_blocks) + 1) if k_blocks % s == 0)
    return Launch(block_m, block_n, block_k, splits, use_dot, warps, 3, gather)


def packed_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                  biases: torch.Tensor, bits: int, group_size: int,
                  launch: Launch | None = None) -> torch.Tensor:
    """x [rows, in] (bfloat16, float16 or float32) @ w.T with w in mlx-lm's packed form:
    words int32 [out, in * bits / 32] (the stored uint32 bits), scales and biases
    [out, in / group_size] -> [rows, out] in x's dtype. `launch`: instead of `plan`'s."""
    rows, in_features = x.shape
    out_features = words.shape[0]
    if launch is None and rows > DOT_ROWS_MAX:  # prompt chunks: dequantize, then cuBLAS
        return torch.nn.functional.linear(x, dequantize(words, scales, biases, bits,
                                                        group_size, x.dtype))
    x = x.contiguous()
    launch = launch or plan(rows, out_features, in_features, group_size, bits, UNPACK_GATHER)
    out = x.new_empty(rows, out_features)
    partial = launch.splits > 1
    target = (torch.empty(launch.splits, rows, out_features, device=x.device,
                          dtype=torch.float32) if partial else out)
    grid = (triton.cdiv(out_features, launch.block_n), triton.cdiv(rows, launch.block_m),
            launch.splits)
    _packed_matmul_kernel[grid](
        x, words, scales, biases, target, rows, out_features,
        x.stride(0), words.stride(0), scales.stride(0),
        BITS=bits, GROUP=group_size, K_SPLIT=in_features // launch.splits,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        USE_DOT=launch.use_dot, PARTIAL=partial, GATHER=launch.gather,
        # float32 rows in full float32, not TF32; half types ignore it (triton's default).
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if partial:
        size, block = rows * out_features, 1024
        _sum_splits_kernel[(triton.cdiv(size, block),)](target, out, size,
                                                        SPLITS=launch.splits, BLOCK=block)
    return out


def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [out, in] in `dtype` (each weight rounded once from float32)."""
    out_features = words.shape[0]
    in_features = words.shape[1] * 32 // bits
    out = torch.empty(out_features, in_features, device=words.device, dtype=dtype)
    block_n, block_k = 32, _block_k(in_features, group_size, 256)
    grid = (triton.cdiv(out_features, block_n), in_features // block_k)
    _dequantize_kernel[grid](words, scales, biases, out, out_features, in_features,
                             words.stride(0), scales.stride(0), BITS=bits, GROUP=group_size,
                             BLOCK_N=block_n, BLOCK_K=block_k)
    return out


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, words_split, steps,
                 stride_wn, stride_sn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr, PARTIAL: tl.constexpr):
    """One row: out[n] (or chunk pid_s's partial sum) = sum over k of x[k] * w[n, k].

    Each word's codes are taken apart as a [.., words, codes] tile, against the inputs
    loaded whole (PER_WORD contiguous inputs a word: one vector load each); the group's
    scale and bias are applied per word, not per code: sum_j x_j (q_j s + b) =
    s * sum_j x_j q_j + b * sum_j x_j."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, PER_WORD)
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = offs_n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    w_start = pid_s * words_split
    for step in range(steps):
        kw = w_start + step * BLOCK_W + offs_w
        words = tl.load(w_rows + kw[None, :], mask=n_ok[:, None], other=0)
        x = tl.load(x_ptr + kw[:, None] * PER_WORD + offs_j[None, :]).to(tl.float32)
        q = (words[:, :, None] >> (offs_j * BITS)[None, None, :]) & ((1 << BITS) - 1)
        dots = tl.sum(_codes_to_float(q) * x[None, :, :], axis=2)  # [BLOCK_N, BLOCK_W]
        g = s_rows + (kw // WORDS_PER_GROUP)[None, :]
        scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        acc += dots * scale + tl.sum(x, axis=1)[None, :] * bias
    total = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + pid_s * N + offs_n, total, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, k_split, steps,
                stride_xm, stride_wn, stride_sn,
                BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """A few rows: each tile of weights dequantized in registers (float32, rounded once to
    the activation dtype), then one tl.dot against the rows' inputs."""
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
    out = offs_m[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * M * N + out, acc, mask=ok)
    else:
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
def _gemv_planes_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, words_split, steps,
                        stride_wn, stride_sn,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr, PARTIAL: tl.constexpr):
    """One bfloat16 row, every tile two-dimensional [outputs, words] so each thread keeps
    its words' codes and their inputs in its own registers: code j of the words is one
    plane, and the inputs of plane j (input word * PER_WORD + j) come from 64-bit loads of
    four inputs each (x_ptr: the row's bfloat16 viewed as int64), taken apart with shifts."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    QUADS: tl.constexpr = PER_WORD // 4  # int64 loads of inputs per word
    WORDS_PER_GROUP: tl.constexpr = GROUP // PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = offs_n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    w_start = pid_s * words_split
    for step in range(steps):
        kw = w_start + step * BLOCK_W + offs_w
        words = tl.load(w_rows + kw[None, :], mask=n_ok[:, None], other=0)
        dots = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        xsum = tl.zeros((1, BLOCK_W), dtype=tl.float32)
        for c in tl.static_range(QUADS):
            # [1, BLOCK_W], not [BLOCK_W]: loaded in the words' own layout where that spreads
            # the warps along the words (BLOCK_W = 32 * num_warps), not converted to it.
            quad = tl.load(x_ptr + (kw * QUADS + c)[None, :])  # inputs 4c .. 4c + 3
            x0, x1 = _bf16_pair(quad.to(tl.int32))
            x2, x3 = _bf16_pair((quad >> 32).to(tl.int32))
            dots += _plane(words, 4 * c, BITS) * x0
            dots += _plane(words, 4 * c + 1, BITS) * x1
            dots += _plane(words, 4 * c + 2, BITS) * x2
            dots += _plane(words, 4 * c + 3, BITS) * x3
            xsum += (x0 + x1) + (x2 + x3)
        g = s_rows + (kw // WORDS_PER_GROUP)[None, :]
        scale = tl.load(s_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
        acc += dots * scale + xsum * bias
    total = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + pid_s * N + offs_n, total, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class Tiles:
    """A launch of the gemv (block_m 1) or dot kernel: tiles, split-K chunks, warps."""

    block_m: int
    block_n: int
    block_k: int  # inputs per loop step
    splits: int
    num_warps: int
    num_stages: int
    planes: bool = False  # one row: the two-dimensional planes kernel (bfloat16 rows)


def run_tiles(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
              biases: torch.Tensor, bits: int, group_size: int, tiles: Tiles) -> torch.Tensor:
    rows, in_features = x.shape
    out_features = words.shape[0]
    x = x.contiguous()
    out = x.new_empty(rows, out_features)
    partial = tiles.splits > 1
    target = (torch.empty(tiles.splits, rows, out_features, device=x.device,
                          dtype=torch.float32) if partial else out)
    k_split = in_features // tiles.splits
    steps = k_split // tiles.block_k
    per_word = 32 // bits
    if tiles.block_m == 1:
        assert rows == 1
        grid = (triton.cdiv(out_features, tiles.block_n), tiles.splits)
        kernel = _gemv_planes_kernel if tiles.planes else _gemv_kernel
        if tiles.planes:
            assert x.dtype == torch.bfloat16
            x = x.view(torch.int64)
        kernel[grid](x, words, scales, biases, target, out_features,
                     k_split // per_word, steps, words.stride(0), scales.stride(0),
                     BITS=bits, GROUP=group_size, BLOCK_N=tiles.block_n,
                     BLOCK_W=tiles.block_k // per_word, PARTIAL=partial,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    else:
        grid = (triton.cdiv(out_features, tiles.block_n), triton.cdiv(rows, tiles.block_m),
                tiles.splits)
        _dot_kernel[grid](x, words, scales, biases, target, rows, out_features, k_split, steps,
                          x.stride(0), words.stride(0), scales.stride(0),
                          BITS=bits, GROUP=group_size, BLOCK_M=tiles.block_m,
                          BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PARTIAL=partial,
                          DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if partial:
        size, block = rows * out_features, 1024
        _sum_splits_kernel[(triton.cdiv(size, block),)](target, out, size,
                                                        SPLITS=tiles.splits, BLOCK=block)
    return out
