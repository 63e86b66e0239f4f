"""The names every part spells backends, element types and a stage's knobs by: pure Python,
so the wire codec, the environment contract, the agent and the supervisor read one list
without loading a framework or a backend."""

from __future__ import annotations

from enum import IntEnum


class Backend(IntEnum):
    """Where a stage runs; the value is its byte on the wire (DESCRIBE), `label` the
    FLEET_BACKEND spelling."""

    TORCH_CUDA = 1
    TORCH_MPS = 2
    TORCH_CPU = 3
    MLX_METAL = 4
    MLX_CUDA = 5
    MLX_CPU = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_label(cls, label: str) -> Backend:
        try:
            return cls[label.upper().replace("-", "_")]
        except KeyError:
            known = ", ".join(b.label for b in cls)
            raise ValueError(f"unknown backend {label!r}; known: {known}") from None


# FLEET_BACKEND's spellings, in byte order: the one list of backends every part reads.
BACKENDS: tuple[str, ...] = tuple(b.label for b in Backend)


class Dtype(IntEnum):
    """A state or boundary-row element type; the value is its byte on the wire."""

    FLOAT32 = 1
    BFLOAT16 = 2
    FLOAT16 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is Dtype.FLOAT32 else 2

    @property
    def label(self) -> str:
        return self.name.lower()


# Who runs a hybrid's gated delta rule on PyTorch (engine.backends.pytorch.delta_kernels).
DELTA_KERNELS = ("auto", "torch", "fla")
# Whether a PyTorch stage's decode layers run compiled (engine.backends.pytorch.compiled_step).
COMPILE_MODES = ("auto", "off", "on")
# How a PyTorch stage holds mlx-lm's packed weights (engine.backends.quant_policy).
QUANT_MODES = ("auto", "packed", "dense")
# How a PyTorch stage on CUDA attends decode rows over its KV cache
# (engine.backends.pytorch.kv_cache): our Triton kernel, or SDPA under a mask.
DECODE_ATTENTIONS = ("triton", "sdpa")
# How a PyTorch stage on CUDA attends a prompt chunk over its slot
# (engine.backends.pytorch.prompt_attention): SDPA's flash kernel, or cuDNN's.
PROMPT_ATTENTIONS = ("flash", "cudnn")
# Which kernel a PyTorch stage on CUDA runs a packed weight's matmul with
# (engine.backends.pytorch.packed_linear): our Triton kernel, or PyTorch's int4 one.
PACKED_KERNELS = ("triton", "int4")
# What rank 0 drafts a decoding stream's next tokens with: nothing, prompt lookup (n-grams
# of the stream's own tokens, engine.lanes.drafting), or the checkpoint's MTP head
# (engine.lanes.model_drafting; a Qwen3.5 checkpoint with `mtp.*` tensors).
DRAFTERS = ("off", "ngram", "mtp")
# The drafters that run a head of the checkpoint's on rank 0 (its bytes charged there).
HEAD_DRAFTERS = ("mtp",)


def drafts(drafter: str) -> bool:
    """Whether a model with this drafter runs verify rounds (whose hybrid stages keep a
    recurrent state per verify row: engine.families.kinds)."""
    return drafter != "off"
