"""The MTP head's two ways of attending, side by side on one call's rows: the decode kernel
over each slot's live entries (CUDA's way for draft steps) against SDPA over gathered
entries under a mask. Run as a module under Triton's interpreter on a CPU
(test_mtp_head.py); test_kernels_cuda.py runs `check` on a GPU."""

from __future__ import annotations

import sys

import torch

from engine.backends.pytorch.mtp_head import _RowsAt, over_gathered_entries, over_live_entries


def check(device: str, dtype: torch.dtype, atol: float) -> None:
    generator = torch.Generator().manual_seed(3)
    slots_held, capacity, kv_heads, heads, d = 5, 40, 2, 6, 16  # 3 query heads a key head

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    k, v = random(slots_held, capacity, kv_heads, d), random(slots_held, capacity, kv_heads, d)
    pages = torch.arange(slots_held, device=device)[:, None]
    # A draft step: one row a slot, at entries far apart (a short and a long conversation),
    # the slots out of order, one left out.
    slots, entries = [3, 0, 4, 1], [0, 37, 6, 21]
    at = _RowsAt.of(slots, entries, [e + 100 for e in entries], pages)
    assert at.one_a_slot
    q = random(len(slots), heads, d)
    want = over_gathered_entries(q, k, v, at)
    got = over_live_entries(q, k, v, at)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    # A feed's rows (two in one slot) take the gathered way: the kernel is not asked.
    assert not _RowsAt.of([2, 2], [4, 5], [4, 5], pages).one_a_slot


def main() -> int:
    """On the CPU, under the interpreter (the caller sets TRITON_INTERPRET=1)."""
    check("cpu", torch.float32, 1e-4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
