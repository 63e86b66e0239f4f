"""Decode attention read straight from the KV cache: split-K flash-decoding in Triton.

One query row a slot (decode), q [n, heads, head_dim] over a layer of the paged cache
k, v [pages, kv_heads, page, head_dim], each row at its own slot and length, a slot's
positions found through its row of the page table (position p lies in page
table[slot, p // page] at p % page). The SDPA path gathers a slot's pages into one run of
keys and carries a [n, 1, 1, keys] mask; its masked kernel is far from the memory floor
over long conversations. Here nothing is copied or masked: each program reads one chunk of
one row's keys for one key head through the table, and every query head of that key
head's group rides along (GQA), so each key is read once.

Two kernels: `_partial` writes each chunk's running max, sum and weighted values in
float32; `_combine` merges a row's chunks. The chunk count depends only on the rows, the
key heads and the upper bound of keys the caller passes (a captured graph's bucket), never
on the live lengths, which stay on the device: a chunk past a row's length reads nothing
and writes an empty partial. So one launch shape serves every round of a bucket and the
pair can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels work in base 2: exp2 is one instruction
BLOCK_KEYS = 64  # keys a program loads at a time
MIN_KEYS_PER_SPLIT = 128  # shorter chunks cost more in partials than they win in spread
MAX_SPLITS = 64  # the combine kernel holds every chunk of a row in registers
PROGRAMS_PER_SM = 4  # splits are chosen so that rows x kv_heads x splits fill the GPU this often
CPU_SMS = 4  # Triton's interpreter on a CPU: any small number of "SMs" will do


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, table_ptr, slots_ptr, lengths_ptr, m_ptr, l_ptr, acc_ptr,
             stride_q_row, stride_q_head, stride_table,
             stride_k_page, stride_k_head, stride_k_pos,
             stride_v_page, stride_v_head, stride_v_pos,
             scale_log2, window, keys_per_split,
             PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
             HAS_WINDOW: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    heads = tl.num_programs(1) * GROUP
    slot = tl.load(slots_ptr + row).to(tl.int64)  # its row of the page table
    length = tl.load(lengths_ptr + row).to(tl.int32)  # keys [0, length): position + 1
    first = split * keys_per_split
    stop = tl.minimum(first + keys_per_split, length)
    if HAS_WINDOW:
        first = tl.maximum(first, length - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_g  # the query heads of this key head
    g_in = offs_g < GROUP
    d_in = offs_d < HEAD_DIM  # head dims that are not a power of two are padded
    q = tl.load(q_ptr + row * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                mask=g_in[:, None] & d_in[None, :], other=0.0)
    pages = table_ptr + slot * stride_table
    k_base = k_ptr + kv_head * stride_k_head
    v_base = v_ptr + kv_head * stride_v_head

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # An empty chunk (past the row's length, or before its window) runs no iteration.
    for start in range(first, stop, BLOCK_N):
        pos = start + offs_n
        n_in = pos < stop
        tile = n_in[:, None] & d_in[None, :]
        # Each key's page from the slot's row of the table (a block of keys may span pages:
        # a window starts anywhere, and a page may hold fewer keys than a block). int64:
        # page x page stride can pass 2^31.
        page = tl.load(pages + pos // PAGE, mask=n_in, other=0).to(tl.int64)
        within = pos % PAGE
        k = tl.load(k_base + (page * stride_k_page + within * stride_k_pos)[:, None]
                    + offs_d[None, :], mask=tile, other=0.0)
        if WIDEN:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = s * scale_log2  # [G, N]
        s = tl.where(n_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a live key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (page * stride_v_page + within * stride_v_pos)[:, None]
                    + offs_d[None, :], mask=tile, other=0.0)
        p = p.to(v.dtype)  # the tensor cores' operand type; its products sum in float32
        if WIDEN:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    part = (row * heads + head) * splits + split  # [n, heads, splits]
    tl.store(m_ptr + part, m_i, mask=g_in)
    tl.store(l_ptr + part, l_i, mask=g_in)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=g_in[:, None] & d_in[None, :])


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, stride_o_row, stride_o_head, splits,
             HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_in = offs_s < splits
    d_in = offs_d < HEAD_DIM
    part = (row * heads + head) * splits + offs_s
    m = tl.load(m_ptr + part, mask=s_in, other=float("-inf"))
    l_part = tl.load(l_ptr + part, mask=s_in, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_in[:, None] & d_in[None, :], other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # empty chunks weigh 0
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_part * weight, 0)
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_in)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_keys(rows: int, kv_heads: int, keys: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) for rows reading at most `keys` keys: host values of the
    call's shape only, so every round of one (rows, bucket) launches the same grid."""
    wanted = math.ceil(PROGRAMS_PER_SM * _sm_count(device) / (rows * kv_heads))
    splits = max(1, min(wanted, math.ceil(keys / MIN_KEYS_PER_SPLIT), MAX_SPLITS))
    per_split = math.ceil(math.ceil(keys / splits) / BLOCK_KEYS) * BLOCK_KEYS
    return math.ceil(keys / per_split), per_split


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, keys: int,
                     window: int | None = None, splits: int | None = None) -> torch.Tensor:
    """Row i of q [n, heads, head_dim] attends over positions [start, lengths[i]) of slot
    slots[i], start = max(0, lengths[i] - window) under a sliding window. k, v
    [pages, kv_heads, page, head_dim]: a layer of the paged cache (strided views are fine);
    table [slots, pages a slot]: the page holding each slot's positions [j x page,
    (j + 1) x page) at column j (a view of some of the cache's rows is fine).

    `keys` bounds every length (a graph's key bucket) and sets the chunking; `splits`
    overrides the chunk count (tests). table, slots, lengths: integer device tensors, read
    on the device only. Returns [n, heads, head_dim] in q's dtype, softmax in float32.
    """
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if (heads % kv_heads or k.shape[-1] != head_dim or v.shape != k.shape
            or not q.dtype == k.dtype == v.dtype):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} {q.dtype} does not fit k "
                         f"{tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or table.stride(-1) != 1:
        raise ValueError("decode_attention: k and v need unit stride along head_dim, and "
                         "the table along its pages")
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = heads // kv_heads
    if splits is None:
        splits, per_split = split_keys(n, kv_heads, keys, q.device)
    else:
        per_split = math.ceil(keys / splits)
    m = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(n, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    # Triton's interpreter (a CPU running the kernel in numpy, for tests) multiplies a
    # 16-bit float's raw bits in tl.dot (triton 3.5), so there the operands are widened
    # to float32 first, after the same rounding a GPU gives them.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot's least size is 16
    block_n = BLOCK_KEYS if block_d <= 128 else BLOCK_KEYS // 2  # registers for 256 dims
    _partial[(n, kv_heads, splits)](
        q, k, v, table, slots, lengths, m, l_sum, acc,
        q.stride(0), q.stride(1), table.stride(0), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        head_dim ** -0.5 * LOG2E, window or 0, per_split,
        PAGE=k.shape[2], GROUP=group, HEAD_DIM=head_dim, HAS_WINDOW=bool(window),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        # float32 caches keep float32 products (tf32 would cost 3 digits); 16-bit ones
        # take the tensor cores with float32 sums either way.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=interpreting, num_warps=4, num_stages=2)
    _combine[(n, heads)](
        m, l_sum, acc, out, out.stride(0), out.stride(1), splits,
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        num_warps=4)
    return out


@torch.library.custom_op("ringfleet::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        table: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                        keys: int, window: int | None) -> torch.Tensor:
    """`decode_attention` as an operator torch.compile keeps whole: Inductor neither traces
    into the launches (their grids are host values) nor replaces them with its own
    attention (which expanded every grouped key head into a copy of the cache)."""
    return decode_attention(q, k, v, table, slots, lengths, keys, window)


@decode_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
      slots: torch.Tensor, lengths: torch.Tensor, keys: int,
      window: int | None) -> torch.Tensor:
    return torch.empty_like(q)
