"""The decode step's layer compiled by torch.compile (Inductor), and when a stage uses it;
the same stage compiles the halves of a layer around its attention for its other rounds.

Eager, a decode layer is some forty small kernels (RMSNorm alone is six, RoPE eight) and
a CUDA graph replays every one of them; compiled, Inductor fuses each norm, the rotary
embedding with its table lookup, the cache write and the SwiGLU activation into a few
kernels, leaving the matmuls to cuBLAS and attention to the Triton decode kernel on CUDA
(an operator it keeps whole: `decode_attention_triton.decode_attention_op`), SDPA
elsewhere. One graph serves every layer (a layer's weights and its run of the cache are
inputs, not constants) and every decode round: the sizes a round varies (rows, slots, keys)
are marked unbacked, so Inductor compiles them symbolic once and sizes its kernels by a
fixed hint, never by the first shape it happened to see. That makes a kernel's bits a
function of the round alone: a process that served other shapes first (the whole-model run
beside a ring's rank 0 in one test, a stage after calibration) computes the bytes a fresh
one does, which Dynamo's automatic dynamic shapes did not promise (static kernels for the
first shape, symbolic ones after; measured different on an H100). On CUDA the compiled step
is then captured in the stage's own CUDA graphs (graphs.py) exactly as the eager one was:
compile, then capture. Packed weights on our Triton kernels compile too: their matmul is an
operator Inductor keeps whole (`packed_matmul_triton.packed_matmul_op`).

A cold compile costs seconds to tens of seconds per shape (docs/benchmarks.md has the
figures); Inductor's caches make a restart cheap, so they live in a directory that
survives reboots (`inductor_cache_dir`), not the default under /tmp.

FLEET_COMPILE decides (`compiles`): `off` never, `on` wherever the stage's layers can be
compiled (the CPU included, which is how the tests exercise it), `auto` only where the
fused kernels pay: CUDA with decode graphs. Hybrids and packed weights on PyTorch's int4
kernel run eagerly (their kernels are not traceable), and `on` refuses them by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.backends.base import BackendError
from engine.backends.pytorch.llama import (
    DecodeBlock,
    LayerParts,
    attention_inputs,
    decode_block,
    layer_output,
)
from engine.config import ModelConfig

COMPILE_ENV = "FLEET_COMPILE"
# Recompiles Dynamo allows the layer before it gives up on compiling (its default is 8):
# one per model config and dtype (the weights' sizes stay static) and per decode form, but
# the count is the process's, shared by every stage in it (a bench or a test loads several).
RECOMPILE_LIMIT = 64


def compiles(mode: str, device: torch.device, config: ModelConfig, int4_packed: bool,
             cuda_graphs: bool) -> bool:
    """Whether a stage runs its decode layers compiled: FLEET_COMPILE's decision.
    `int4_packed`: packed weights on PyTorch's int4 kernel (our Triton kernels' operator
    compiles; those passes do not)."""
    unsupported = ("a hybrid's layers" if config.is_hybrid
                   else "packed weights on PyTorch's int4 kernel" if int4_packed else None)
    if mode == "on" and unsupported:
        raise BackendError(f"{COMPILE_ENV}=on: {unsupported} cannot be compiled; set "
                           f"{COMPILE_ENV}=auto or off")
    if mode == "on":
        return True
    return (mode == "auto" and not unsupported and device.type == "cuda" and cuda_graphs)


def inductor_cache_dir() -> Path:
    """Where Inductor keeps compiled kernels: TORCHINDUCTOR_CACHE_DIR if the user set it,
    else the user's cache directory (XDG), which a reboot keeps."""
    # Imported here: Inductor's modules add about 74 MB to a process that never compiles.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its own default (under /tmp) back into the variable once it has
    # looked, so that value is not a choice anyone made.
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ringfleet" / "inductor"


def _prepare() -> None:
    # Inductor reads the variable each time it looks for a cached kernel.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    # Where a kernel has several launch configurations whose sums run in different orders
    # (a norm's reduction split one way or another), Inductor would time them on the
    # device and keep the fastest: a choice by the clock, so two processes compiling the
    # same step (a ring's stages, one process beside them) could keep different ones and
    # round differently. The deterministic mode chooses without timing where numerics
    # depend on it (RFC section 5: the same bits per placement).
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)


def _compiled(fn: Callable[..., torch.Tensor], sizes: dict[int, tuple[int, ...]]
              ) -> Callable[..., torch.Tensor]:
    """`fn` compiled whole (no graph breaks, no automatic dynamic shapes), with the
    dimensions in `sizes` (argument position: its dims) marked unbacked at every call:
    one compile serves every value of them (module docstring)."""
    # Dynamo is imported here, when a stage compiles, not with this module: importing it
    # costs a process some 180 MB, which a stage that never compiles (the CPU default, a
    # packed 4-bit stage) should not hold.
    from torch._dynamo.decorators import mark_unbacked

    _prepare()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def any_size(*args: object) -> torch.Tensor:
        for position, dims in sizes.items():
            if position < len(args) and isinstance(args[position], torch.Tensor):
                for dim in dims:
                    mark_unbacked(args[position], dim)
        return compiled(*args)

    return any_size


def compiled_decode_block() -> DecodeBlock:
    """`decode_block` compiled: rows (x, positions, offsets), the run's slots and the pages
    read (its rows of the page table) symbolic. Arguments by position, as `run_decode`
    passes them."""
    rows = (0,)
    return _compiled(decode_block, {0: rows, 7: (0, 1), 8: rows, 10: rows})


def compiled_layer_parts() -> LayerParts:
    """A layer's halves around its attention compiled, for the rounds the graphs do not
    take (prompt chunks, rounds that mix them with decode rows): each half's norms, rotary,
    activation and residual adds fused, which eagerly are some forty kernels a layer that
    each read and write every row (a sixth of an 8,192-token prompt's time on an H100,
    docs/benchmarks.md). The attention over the cache stays eager (SDPA's flash kernel);
    the row count (x, positions; x and o after it) is symbolic."""
    return LayerParts(_compiled(attention_inputs, {0: (0,), 5: (0,)}),
                      _compiled(layer_output, {0: (0,), 1: (0,)}))
