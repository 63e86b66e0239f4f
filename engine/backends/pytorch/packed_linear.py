"""mlx-lm's affine-quantized weights held packed on PyTorch: PyTorch's int4 matmul and a row lookup.

mlx-lm stores a weight as codes q (`bits` wide) with `w = q * scale + bias` per group of
`group_size` inputs (format: engine.checkpoint.quantize). PyTorch's int4 kernels
(`_weight_int4pack_mm` on CUDA and MPS, `_weight_int4pack_mm_for_cpu` on the CPU) take
codes 0..15 with a scale and a zero per group and compute `(q - 8) * scale + zero`, so an
affine group maps onto them with `zero = bias + 8 * scale`, rounded once to the model dtype
(the only rounding this adds to the weights; in float32 it is exact to 1 ulp). Codes of 2 or
3 bits fit a nibble as they are; codes of 5 to 8 bits are split into a high and a low
nibble, q = 16 * hi + lo, and run as two int4 passes whose outputs add up: the high pass
with scale 16 * scale and zero 128 * scale (so it adds 16 * scale * hi and no bias), the
low pass with the group's own scale and bias (powers of two: no rounding added). Neither
pass ever forms the dense matrix.

The kernels want the output width a multiple of 16 (CPU; CUDA asks 8), so a weight whose
width is not is padded with zero rows and its output cut back. An embedding is looked up
from the checkpoint's own bytes (gather the rows, then dequantize only those, as
`mx.dequantize` does, bit for bit); a tied head keeps both forms.

On CUDA the matmul instead reads the stored words themselves, through our Triton kernels
(packed_matmul_triton.py, codes of 2, 4 or 8 bits): the weight is held as the checkpoint's
bytes (one copy for a tied table's lookups and head), read once per matmul, where PyTorch's
int4 kernel measured slower than the dense matmul at decode (bench/quantized.py --triton
sets the two side by side). `FLEET_PACKED_KERNEL=int4` (or no triton, or a Triton that
fails its check at load) keeps the int4 kernel there; the CPU always runs it.

`PackedWeight` stands where a dense tensor stood in the family code: `F.linear(x, w, b)`
and `F.embedding(ids, w)` reach it through `__torch_function__` (the protocol torchao's
quantized tensors use), so the Llama and Qwen3.5 files keep one code path for both. Dynamo
follows that protocol into `matmul`, so the compiled decode step takes a packed stage whose
matmul is the Triton kernels' operator (it cannot trace their launches, nor the int4 passes).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from engine.backends import quant_policy
from engine.checkpoint.quant_config import QuantConfig, QuantParams
from engine.checkpoint.quantize import pack_bits
from engine.env import VARIABLE_OF, read_switch

log = structlog.get_logger()

NIBBLE = 4
PAD_ROWS = quant_policy.INT4_PAD_ROWS  # output widths the CPU kernel takes (CUDA's 8 divides it)
# On CUDA: "triton" (the default where it imports) or "int4"; the contract's `packed_kernel`
# (engine.env), read from the environment as each weight picks its kernel.
KERNEL_ENV = VARIABLE_OF["packed_kernel"]


@functools.cache
def _triton_kernels() -> Any:
    """engine.backends.pytorch.packed_matmul_triton, or None where triton does not import."""
    try:
        return importlib.import_module("engine.backends.pytorch.packed_matmul_triton")
    except ImportError as exc:
        log.info("packed matmuls on CUDA use the int4 kernel", reason=f"no triton: {exc}")
        return None


def matmul_kernel(device: torch.device, bits: int) -> str:
    """Which kernel a packed weight of `bits` on `device` runs its matmul with: "triton"
    (mlx-lm's words as stored) or "int4" (PyTorch's int4 layout)."""
    if device.type != "cuda" or read_switch("packed_kernel") == "int4":
        return "int4"
    kernels = _triton_kernels()
    if kernels is None or bits not in kernels.BITS:
        return "int4"
    return "triton" if _triton_serves(device.type) else "int4"


@functools.cache
def _triton_serves(device_type: str) -> bool:
    """Whether our Triton kernel compiles and agrees with the dense product here (once)."""
    refusal = _kernel_refusal(device_type, torch.bfloat16, "triton")
    if refusal is not None:
        log.warning("packed matmuls on CUDA use the int4 kernel", reason=refusal)
    return refusal is None


@dataclass(frozen=True)
class Int4Pass:
    """One int4 matmul: codes in PyTorch's packed layout with a scale and zero per group."""

    packed: torch.Tensor  # the device's int4pack layout (opaque)
    scales_and_zeros: torch.Tensor  # [in / group_size, padded out, 2], the model dtype


class PackedWeight:
    """A packed [out, in] weight: int4 passes or the stored words for x @ w.T, the stored
    bytes for row lookups."""

    def __init__(self, out_features: int, in_features: int, params: QuantParams,
                 dtype: torch.dtype, passes: tuple[Int4Pass, ...] = (),
                 rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.params = params
        self.dtype = dtype
        self.passes = passes  # int4 passes; empty where `words` serve or lookups only
        self.rows = rows  # (bytes uint8 [out, in * bits / 8], scales, biases); None: matmul only
        # (int32 [out, in * bits / 32] (the stored uint32 bits), scales, biases) for the Triton
        # kernels; a tied table's words are a view of its rows' bytes.
        self.words = words

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        held = [t for p in self.passes for t in (p.packed, p.scales_and_zeros)]
        held += list(self.rows or ()) + list(self.words or ())
        # Counted once each: a tied table's words and rows are the same bytes.
        return sum({t.data_ptr(): t.nbytes for t in held}.values())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], as x @ w.T."""
        if not self.passes and self.words is None:
            raise TypeError("this packed weight holds rows for lookups only, not a matmul")
        flat = x.reshape(-1, self.in_features)
        if self.words is not None:  # the operator, which the compiled step keeps whole
            # (no test of the row count here: the compiled step's is a symbol)
            out = torch.ops.ringfleet.packed_matmul(flat, *self.words, self.params.bits,
                                                    self.params.group_size)
            return out.view(*x.shape[:-1], self.out_features)
        if flat.shape[0] == 0:  # CUDA's int4 kernel refuses an empty grid
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = None
        for one in self.passes:
            y = _int4_mm(flat, one, self.params.group_size)
            out = y if out is None else out + y
        if out.shape[-1] != self.out_features:  # padded rows cut back
            out = out[:, :self.out_features].contiguous()
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def traceable(self) -> bool:
        """Whether torch.compile can take this weight's matmul: the Triton kernels' operator,
        not PyTorch's int4 passes."""
        return self.words is not None or not self.passes

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` [n] -> [n, in]: only those rows are ever unpacked."""
        if self.rows is None:
            raise TypeError("this packed weight was packed for matmuls only, not lookups")
        stored, scales, biases = self.rows
        codes = unpack_codes(stored[ids], self.params.bits)  # [n, in] int64
        groups = self.in_features // self.params.group_size
        w = codes.to(self.dtype).view(-1, groups, self.params.group_size)
        w = w * scales[ids][..., None]  # rounded to the dtype, as MLX rounds its multiply
        w = w + biases[ids][..., None]  # then its add
        return w.view(-1, self.in_features)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> torch.Tensor:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            out = weight.matmul(x)
            return out if bias is None else out + bias
        if func is F.embedding:
            ids, weight = args[:2]
            return weight.lookup(ids.reshape(-1)).view(*ids.shape, weight.in_features)
        raise TypeError(f"a packed weight supports F.linear and F.embedding, not {func}")


def traceable(layers: Iterable[Any]) -> bool:
    """Whether torch.compile can take every packed weight of these layers' weights."""
    return all(w.traceable for layer in layers for w in vars(layer).values()
               if isinstance(w, PackedWeight))


def _int4_mm(x: torch.Tensor, one: Int4Pass, group_size: int) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, one.packed, group_size,
                                                          one.scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, one.packed, group_size, one.scales_and_zeros)


def unpack_codes(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [rows, in * bits / 8] (mlx-lm's little-endian bit stream) -> codes int64 [rows, in].

    Eight codes fill exactly `bits` bytes, so each run of `bits` bytes becomes one integer
    and the codes are shifted out of it (as `engine.checkpoint.quantize.unpack_bits` does).
    """
    rows, width = stored.shape[0], stored.shape[1] * 8 // bits
    runs = stored.view(rows, width // 8, bits).to(torch.int64)  # [rows, in / 8, bits]
    word = torch.zeros(runs.shape[:2], dtype=torch.int64, device=stored.device)
    for byte in range(bits):
        word |= runs[..., byte] << (8 * byte)
    shifts = torch.arange(8, device=stored.device) * bits
    # An 8-byte run sets the sign bit: the arithmetic shift smears it, the mask drops it.
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(rows, width)


# Codes are unpacked and packed this many bytes of int64 codes at a time (rows a multiple of
# CHUNK_ROWS). Unpacking a whole weight at once made int64 and int32 temporaries 16 and 8 times
# its packed bytes: for a 128k x 1536 tied table, 2.4 GB at once and a 4.6 GB peak for a stage
# whose weights are 335 MiB, and the allocator kept part of what was freed resident.
CHUNK_CODE_BYTES = 16 << 20
# The CPU's int4pack layout is blocked by 64 rows, so chunks of a multiple of 64 rows packed
# one by one and laid end to end are the bytes of the whole weight packed at once
# (tests/engine/test_packed_linear.py checks it). CUDA's and MPS's layouts were not checked
# chunk by chunk on a GPU, so there a weight is still packed whole (on CUDA the default
# Triton kernels hold the stored words and unpack nothing at load).
CHUNK_ROWS = 64


def _pack_codes(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """codes int32 [rows, in] (0..15; rows a multiple of PAD_ROWS) -> the device's int4pack."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    # CUDA and MPS take two codes a byte, the even one in the high nibble, and tile K by
    # inner_k_tiles * 16: the largest of 8, 4, 2 that divides the width.
    pairs = ((codes[:, ::2] << NIBBLE) | codes[:, 1::2]).to(device, torch.uint8)
    tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (t * 16) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor,
                      padded_rows: int) -> torch.Tensor:
    """scales and zeros [out, groups] -> [groups, padded_rows, 2]; padded rows scale 0, zero 0
    (their outputs are cut off again)."""
    pad = padded_rows - scales.shape[0]
    scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
    return torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()


def int4_passes(stored: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                params: QuantParams, device: torch.device) -> tuple[Int4Pass, ...]:
    """mlx-lm's bytes uint8 [out, in * bits / 8] (any width up to 8 bits) with scales and
    biases [out, groups] in the model dtype -> the int4 passes whose outputs add up to
    x @ w.T, unpacked and packed CHUNK_CODE_BYTES of codes at a time."""
    out_features, in_features = stored.shape[0], stored.shape[1] * 8 // params.bits
    padded_rows = out_features + -out_features % PAD_ROWS
    step = max(CHUNK_ROWS, CHUNK_CODE_BYTES // (in_features * 8) // CHUNK_ROWS * CHUNK_ROWS) \
        if device.type == "cpu" else out_features
    nibbles = 1 if params.bits <= NIBBLE else 2
    packed: list[torch.Tensor | None] = [None] * nibbles
    for start in range(0, out_features, step):
        codes = unpack_codes(stored[start:start + step], params.bits).to(torch.int32)
        rows = codes.shape[0]
        if start + rows == out_features and padded_rows > out_features:  # the last chunk
            codes = F.pad(codes, (0, 0, 0, padded_rows - out_features))
        parts = (codes,) if nibbles == 1 else (codes & 15, codes >> NIBBLE)
        for i, part in enumerate(parts):
            chunk = _pack_codes(part, device)
            rows_each = part.shape[0] // chunk.shape[0]  # dim 0: rows (CPU), tiles (CUDA)
            if packed[i] is None:  # the whole weight's int4pack, filled chunk by chunk
                packed[i] = chunk.new_empty((padded_rows // rows_each, *chunk.shape[1:]))
            at = start // rows_each
            packed[i][at:at + chunk.shape[0]] = chunk
        del codes, parts  # before the next chunk's, so two are never held
    dtype = scales.dtype
    # zero = bias + 8 * scale, formed in float32 and rounded once to the dtype.
    low_zero = (biases.float() + 8 * scales.float()).to(dtype)
    low = Int4Pass(packed[0], _scales_and_zeros(scales, low_zero, padded_rows).to(device))
    if nibbles == 1:
        return (low,)
    high_scale = scales * 16  # a power of two: exact in every float dtype
    return (low, Int4Pass(packed[1], _scales_and_zeros(high_scale, high_scale * 8,
                                                       padded_rows).to(device)))


def pack_weight(words: Any, scales: torch.Tensor, biases: torch.Tensor, params: QuantParams,
                device: torch.device, *, matmul: bool, lookup: bool,
                kernel: str | None = None) -> PackedWeight:
    """mlx-lm's stored tensors (words: uint32 numpy [out, in * bits / 32]; scales and biases
    [out, groups] in the model dtype, on `device`) -> a PackedWeight with the forms asked.
    `kernel`: "triton" or "int4" for the matmul (None: `matmul_kernel`'s choice)."""
    # No copy on the CPU: the array read from the checkpoint is this weight's own.
    stored = torch.from_numpy(np.ascontiguousarray(words).view("u1")).to(device)
    out_features = stored.shape[0]
    in_features = stored.shape[1] * 8 // params.bits
    passes: tuple[Int4Pass, ...] = ()
    held_words = None
    if matmul and (kernel or matmul_kernel(device, params.bits)) == "triton":
        _triton_kernels()  # registers the operator `matmul` calls
        # The stored bytes as they are (a view: no copy); scales and biases contiguous.
        held_words = (stored.view(torch.int32), scales.contiguous(), biases.contiguous())
    elif matmul:
        passes = int4_passes(stored, scales, biases, params, device)  # unpacked on the device
    rows = (stored, scales, biases) if lookup else None
    return PackedWeight(out_features, in_features, params, scales.dtype, passes, rows,
                        held_words)


def quantize_and_pack(weight: torch.Tensor, params: QuantParams, dtype: torch.dtype,
                      device: torch.device) -> PackedWeight:
    """A dense float weight [out, in] quantized as mlx-lm would and packed for matmuls
    (calibration's random weights: timed as a quantized checkpoint's stage runs)."""
    from engine.checkpoint.quantize import affine_quantize

    words, scales, biases = affine_quantize(weight.float().cpu().numpy(), params.group_size,
                                            params.bits)
    return pack_weight(words, torch.from_numpy(scales).to(device, dtype),
                       torch.from_numpy(biases).to(device, dtype), params, device,
                       matmul=True, lookup=False)


def kernel_refusal(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the packed matmul kernel cannot serve this device and dtype (None: it can).

    Tried once per process on a small weight against the dense product, so a device whose
    PyTorch lacks the kernel, refuses the dtype (CUDA's takes bfloat16 only) or packs
    differently falls back to dense with its reason named instead of answering wrong.
    """
    return _kernel_refusal(device_type, dtype, matmul_kernel(torch.device(device_type), NIBBLE))


@functools.cache
def _kernel_refusal(device_type: str, dtype: torch.dtype, kernel: str) -> str | None:
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    params = QuantParams(32, NIBBLE)
    codes = torch.randint(0, 16, (16, 64), generator=generator)
    scales = (torch.rand(16, 2, generator=generator) * 0.01 + 0.001).to(dtype)
    biases = (torch.randn(16, 2, generator=generator) * 0.05).to(dtype)
    x = torch.randn(3, 64, generator=generator).to(dtype)
    dense = (codes.to(dtype).view(16, 2, 32) * scales[..., None] + biases[..., None]).view(16, 64)
    want = x.float() @ dense.float().T
    want = torch.cat([want[:1], want])  # one row and three: the GEMV and the dot kernels
    name = "our Triton kernel" if kernel == "triton" else "PyTorch's int4 kernel"
    try:
        words = pack_bits(codes.numpy().astype(np.uint8), NIBBLE)
        weight = pack_weight(words, scales.to(device), biases.to(device), params, device,
                             matmul=True, lookup=False, kernel=kernel)
        x = x.to(device)
        got = torch.cat([weight.matmul(x[:1]), weight.matmul(x)]).float().cpu()
    except (RuntimeError, NotImplementedError) as exc:
        return f"{name} on {device_type} refused {dtype}: {exc}".splitlines()[0]
    except Exception as exc:  # a JIT compiler's failure (triton raises its own errors)
        if kernel != "triton":
            raise
        return f"{name} on {device_type} failed for {dtype}: {exc}".splitlines()[0]
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    error = (got - want).abs().max().item()
    if not error <= tolerance * max(1.0, want.abs().max().item()):
        return (f"{name} on {device_type} disagreed with the dense product "
                f"by {error:.3g} for {dtype}")
    return None


def dense_cost(params: QuantParams, dtype: torch.dtype) -> float:
    """How many times its packed bytes a weight takes once dequantized to `dtype`."""
    dtype_bits = torch.finfo(dtype).bits
    return dtype_bits / (params.bits + 2 * dtype_bits / params.group_size)


def holds_packed(mode: str, backend: str, device: torch.device, dtype: torch.dtype,
                 quant: QuantConfig) -> bool:
    """Whether a stage keeps its packed weights packed: as `FLEET_QUANT` and the measured
    table decide (engine.backends.quant_policy) and where the device's int4 kernel serves the
    dtype. A dense fallback is said once, at load, with what it costs."""
    if mode == "dense":  # asked for: no notice
        return False
    dtype_name = str(dtype).removeprefix("torch.")
    cost = (f"{dense_cost(quant.default, dtype):.1f}x the packed bytes in memory and read "
            "per token")
    if not quant_policy.runs_packed(backend, dtype_name, mode):
        log.warning("quantized weights held dense", backend=backend, dtype=dtype_name,
                    reason="the int4 kernel measured slower than the dense matmul here "
                           "(FLEET_QUANT=packed keeps them packed)", cost=cost)
        return False
    refusal = kernel_refusal(device.type, dtype)
    if refusal is None:
        return True
    log.warning("quantized weights held dense", backend=backend, dtype=dtype_name,
                reason=refusal, cost=cost)
    return False
