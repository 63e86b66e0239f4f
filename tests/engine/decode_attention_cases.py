"""Cases for the Triton decode kernel (`decode_attention_triton`), each checked against a
float32 softmax written out in torch: shared by the CUDA tests and by the CPU test, which
runs this module as a script under Triton's interpreter (TRITON_INTERPRET=1 has to be set
before triton is imported, so that test starts a process of its own).

The kernel reads a paged cache: each case's slots hold their positions in pages of
`page` positions, shuffled through the pool, and the kernel finds them through the page
table. Every slot's keys outside the window a row may read ([start, length)) are NaN, and
so is every page no slot holds, so a read past a row's length, before its window, into
another slot or through a wrong page shows up as NaN.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    lengths: tuple[int, ...]  # each row's keys: position + 1
    slots: tuple[int, ...]  # each row's slot, in any order
    keys: int  # the bound the caller passes (a graph's bucket): >= every length
    window: int | None = None
    splits: int | None = None  # None: the kernel's own choice
    page: int = 64  # positions a page holds: the cache's (kv_pages.PAGE_POSITIONS), or fewer

    def __str__(self) -> str:
        return (f"heads {self.heads}/{self.kv_heads} dim {self.head_dim} "
                f"{str(self.dtype).removeprefix('torch.')} lengths {self.lengths} slots "
                f"{self.slots} keys {self.keys} window {self.window} splits {self.splits} "
                f"page {self.page}")


F32, BF16 = torch.float32, torch.bfloat16
# Small enough for the interpreter (a few seconds in all): group sizes 1, 4 and 8, head
# dims 18 (padded to 32), 64 and 128, rows of one key and of the whole bound, slots out
# of order and not consecutive, chunks past a row's end, a sliding window, pages smaller
# than the kernel's block of keys (a block over several pages).
CPU_CASES = [
    Case(4, 4, 18, F32, (1, 80, 37), (5, 0, 3), 80, splits=3),
    Case(4, 4, 18, BF16, (1, 80, 37), (5, 0, 3), 80, splits=3, page=16),
    Case(8, 2, 64, BF16, (1, 70, 45, 64), (2, 7, 4, 0), 70, window=20, splits=4),
    Case(8, 2, 64, F32, (70, 9), (6, 1), 70, window=16, splits=2, page=16),
    Case(8, 1, 128, F32, (64, 3), (1, 3), 64),
    Case(8, 1, 128, BF16, (64, 3), (1, 3), 64),
]
# On a GPU, also the shapes that serve: 8B-like heads, head dims 256 and odd ones, 32
# rows, long keys under the kernel's own chunking.
CUDA_CASES = CPU_CASES + [
    Case(32, 8, 128, BF16, (8000, 1, 4097, 7999), (3, 0, 9, 1), 8192),
    Case(32, 8, 128, BF16, (8000, 1, 4097, 7999), (3, 0, 9, 1), 8192, page=16),
    Case(32, 8, 128, F32, (8000, 1, 4097, 7999), (3, 0, 9, 1), 8192),
    Case(16, 2, 256, BF16, (3000, 2048, 17), (0, 2, 1), 3072, window=1024),
    Case(12, 4, 80, BF16, (500, 1), (1, 0), 512),
    Case(12, 4, 96, F32, (500, 1), (1, 0), 512),
    Case(32, 8, 128, BF16, tuple(range(1, 33 * 97, 97))[:32], tuple(range(63, -1, -2)), 3008),
    Case(16, 16, 64, BF16, (30000, 1), (1, 0), 30208, window=4096),
]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """float32 sums either way; 16-bit inputs round the weights and the output once each."""
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def inputs(case: Case, device: str, seed: int = 0):
    """q [n, heads, d]; each slot's keys and values in order, [slots, kv_heads, positions,
    d] (what the reference reads), NaN wherever no row may read; the same in pages: layer
    1 of a [2, pages, kv_heads, page, d] pool (a strided view, as a stage passes), its
    pages shuffled, and the page table cut to the pages the bound of keys needs (a strided
    view too); slots, lengths."""
    generator = torch.Generator().manual_seed(seed)
    n, d, page = len(case.lengths), case.head_dim, case.page
    slots, positions = max(case.slots) + 2, case.keys + 32  # room no row owns
    as_case = dict(dtype=case.dtype, device=device)
    q = torch.randn(n, case.heads, d, generator=generator).to(**as_case)
    pages_a_slot = -(-positions // page)
    k = torch.full((slots, case.kv_heads, pages_a_slot * page, d), float("nan"), **as_case)
    v = torch.full_like(k, float("nan"))
    for slot, length in zip(case.slots, case.lengths, strict=True):
        start = max(0, length - case.window) if case.window else 0
        for cache in (k, v):
            cache[slot, :, start:length] = torch.randn(
                case.kv_heads, length - start, d, generator=generator).to(**as_case)
    pool_pages = slots * pages_a_slot + 3  # three pages no slot holds
    table = torch.randperm(pool_pages, generator=generator)[:slots * pages_a_slot]
    table = table.view(slots, pages_a_slot).to(device)
    paged = []
    for cache in (k, v):
        pool = torch.full((2, pool_pages, case.kv_heads, page, d), float("nan"), **as_case)
        by_page = cache.view(slots, case.kv_heads, pages_a_slot, page, d).transpose(1, 2)
        pool[1, table.flatten()] = by_page.reshape(-1, case.kv_heads, page, d)
        paged.append(pool[1])
    return (q, k, v, *paged, table[:, :-(-case.keys // page)],
            torch.tensor(case.slots, device=device),
            torch.tensor(case.lengths, dtype=torch.int32, device=device))


def reference(case: Case, q, k, v) -> torch.Tensor:
    """Each row's query head h over key head h // group's keys [start, length), in float32."""
    group = case.heads // case.kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for row, (slot, length) in enumerate(zip(case.slots, case.lengths, strict=True)):
        start = max(0, length - case.window) if case.window else 0
        keys = k[slot, :, start:length].float().repeat_interleave(group, 0)  # [heads, L, d]
        values = v[slot, :, start:length].float().repeat_interleave(group, 0)
        scores = (keys @ q[row].float()[:, :, None])[:, :, 0] * case.head_dim ** -0.5
        out[row] = (torch.softmax(scores, dim=-1)[:, None, :] @ values)[:, 0]
    return out


def check(case: Case, device: str) -> None:
    from engine.backends.pytorch.decode_attention_triton import decode_attention

    q, k, v, k_pages, v_pages, table, slots, lengths = inputs(case, device)
    got = decode_attention(q, k_pages, v_pages, table, slots, lengths, case.keys, case.window,
                           case.splits)
    assert got.shape == q.shape and got.dtype == case.dtype, case
    torch.testing.assert_close(got.float(), reference(case, q, k, v), **tolerance(case.dtype),
                               msg=lambda m: f"{case}: {m}")


def interpreter_reads_numpy_scalars() -> None:
    """Triton 3.5's interpreter turns a loaded scalar (a one-element array) into a Python
    int with int(array), which numpy 2.4 refuses; triton's own fix (#9172) squeezes it
    first, which is what this does until that release is the one installed."""
    import inspect

    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(patch):  # a release with the fix
        return

    def patched(tensor, *scope) -> None:  # later releases pass a patch scope too
        patch(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    interpreter._patch_lang_tensor = patched


def check_compiled_block(device: str) -> None:
    """The compiled decode layer (llama.decode_block under torch.compile, fullgraph) with its
    attention through the kernel's operator computes what the eager layer under SDPA does,
    over slots of unequal lengths: Inductor keeps the operator whole instead of tracing into
    it or replacing it (its own attention copied every grouped key head)."""
    import tempfile
    from pathlib import Path

    import engine.backends.pytorch.decode_attention_triton  # noqa: F401 - the operator
    from engine.backends.base import StageSpec, load_stage
    from engine.backends.pytorch.llama import decode_block
    from engine.checkpoint.maker import CheckpointSpec, make_checkpoint
    from engine.harness.local_pipeline import model_config
    from tests.engine.conftest import layout_of

    with tempfile.TemporaryDirectory() as where:
        model_dir = make_checkpoint(Path(where), CheckpointSpec(family="qwen3", seed=5))
        config = model_config(model_dir)
        stage = load_stage(StageSpec(model_dir, (0, config.num_hidden_layers), "torch-cpu",
                                     3, 64, 16))
    model, generator = stage.model, torch.Generator().manual_seed(1)
    positions = torch.tensor([9, 30, 2])  # each row's keys: its position + 1
    model.cache.cover(layout_of([(0, 9), (1, 30), (2, 2)], []))
    pages = model.cache.table[:, :1]  # the run's rows, cut to the one page its keys need
    model.cache.k.copy_(torch.randn(model.cache.k.shape, generator=generator))
    model.cache.v.copy_(torch.randn(model.cache.v.shape, generator=generator))
    x = torch.randn(3, config.hidden_size, generator=generator)
    compiled = torch.compile(decode_block, fullgraph=True)
    outs = {}
    for name, step, kernel in (("sdpa", decode_block, False), ("kernel", decode_block, True),
                               ("compiled kernel", compiled, True)):
        k, v = model.cache.k[0].clone(), model.cache.v[0].clone()  # each way writes its own
        with torch.inference_mode():
            outs[name] = step(x, model.layers[0], config, model.rope.cos, model.rope.sin,
                              k, v, pages, positions, kernel)
    for name in ("kernel", "compiled kernel"):
        torch.testing.assert_close(outs[name], outs["sdpa"], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, name=name: f"decode_block, {name}: {m}")


def main() -> int:
    """Every CPU case under the interpreter (the caller sets TRITON_INTERPRET=1)."""
    interpreter_reads_numpy_scalars()
    failed = 0
    for check_one in [*(lambda c=c: check(c, "cpu") for c in CPU_CASES),
                      lambda: check_compiled_block("cpu")]:
        try:
            check_one()
        except AssertionError as error:
            failed += 1
            print(f"FAILED {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
