"""Where each backend holds mlx-lm's packed weights packed, and the bytes it then holds.

One rule for the engine (which form a stage loads) and the supervisor (what placement charges),
framework-free so the supervisor needs neither PyTorch nor MLX. MLX always runs the packed
weights as stored. A PyTorch stage runs them through PyTorch's int4 kernels
(engine.backends.pytorch.packed_linear) where that was measured to beat or match the dense
matmul (bench/quantized.py, docs/benchmarks.md), else dequantizes them at load:

- CUDA: bfloat16 (the only dtype its int4 kernel takes).
- CPU: bfloat16. Its kernel's float32 and float16 paths measured 5 to 15x slower than the
  dense matmul, so those stay dense unless `FLEET_QUANT=packed` asks for memory over speed.
- MPS: bfloat16 and float16 (not measured here; the kernel is checked at load).

`FLEET_QUANT` ("auto" by default) picks: auto follows the table, packed keeps every weight
packed wherever the kernel runs at all, dense dequantizes everywhere.
"""

from __future__ import annotations

from engine.checkpoint.quant_config import QuantParams, packed_params  # noqa: F401 - the supervisor's and calibration's name for it

PACKED_DTYPES = {"torch-cuda": ("bfloat16",), "torch-cpu": ("bfloat16",),
                 "torch-mps": ("bfloat16", "float16")}
INT4_PAD_ROWS = 16  # output widths PyTorch's int4 kernels take (CPU: 16, CUDA and MPS: 8)
# Widths our Triton kernels read as stored on CUDA (packed_matmul_triton.py): such a weight is
# held once, as the checkpoint's bytes, for its matmuls and lookups alike.
TRITON_BITS = (2, 4, 8)


def runs_packed(backend: str, dtype: str, mode: str = "auto") -> bool:
    """Whether `backend` holds a packed weight of a `dtype` model packed, under `mode`."""
    if backend.startswith("mlx-"):
        return True
    if mode == "dense":
        return False
    if mode == "packed":
        return True  # where the kernel runs at all (the stage checks it at load)
    return dtype in PACKED_DTYPES.get(backend, ())


def int4_passes(bits: int) -> int:
    """PyTorch runs codes of up to 4 bits as one int4 pass, of 5 to 8 bits as two."""
    return 1 if bits <= 4 else 2


def held_bytes(backend: str, out_features: int, in_features: int, params: QuantParams,
               dtype_bytes: int, *, packed: bool, matmul: bool = True,
               lookup: bool = False) -> int:
    """Bytes `backend` holds for one packed [out, in] weight of the checkpoint.

    `packed`: as `runs_packed` decided. `matmul` / `lookup`: the forms it is used in (an
    embedding is looked up; tied, it is the head's matmul too). MLX, and CUDA where our
    Triton kernels take the width, hold the stored tensors once for both; elsewhere PyTorch
    holds the stored bytes for lookups and its int4 layout for matmuls, both for a tied
    table. (A CUDA stage told FLEET_PACKED_KERNEL=int4 holds that layout: placement charges
    the default.)
    """
    groups = in_features // params.group_size
    stored = out_features * in_features * params.bits // 8 + 2 * out_features * groups * dtype_bytes
    if not packed:
        return out_features * in_features * dtype_bytes
    if backend.startswith("mlx-") or (backend == "torch-cuda" and params.bits in TRITON_BITS):
        return stored
    held = stored if lookup else 0
    if matmul:
        rows = -(-out_features // INT4_PAD_ROWS) * INT4_PAD_ROWS
        held += int4_passes(params.bits) * (rows * in_features // 2 + rows * groups * 2
                                            * dtype_bytes)
    return held
