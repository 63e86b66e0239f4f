"""The memory model of a stage: a model's byte counts per layer type, and what one layer range
costs a node.

A stage's memory is the sum over its layers of each layer's weights and per-stream state,
plus what the stage holds besides its layers: every stage keeps a receive and a send buffer
of rows, and rank 0 also holds the embeddings, the final norm, the head and the logits it
samples from. Layers differ by type: a full-attention layer keeps K and V for every cached
position of every stream; a Gated DeltaNet layer (the Qwen3.5 hybrid's linear attention)
keeps a fixed recurrent state per stream, whatever the context. A dense family has one type.
Where every stage keeps its KV in a pool of pages (`kv_pages`, FLEET_KV_PAGES), an
attention layer holds the pool's positions instead of a whole context for every slot; the
recurrent states stay one per slot.
Compute workspace (attention scores, MLP activations) is not modelled: it must fit in the
margin the agent keeps out of "usable".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from engine.backend_names import BACKENDS
from engine.backends.quant_policy import held_bytes, packed_params, runs_packed
from engine.checkpoint.quant_config import QuantConfig, QuantConfigError
from engine.config import FULL_ATTENTION, ConfigError, ModelConfig
from engine.families.description import draft_head_bytes
from engine.family import end_tensor_shapes, layer_tensor_shapes
from engine.kv_pages import PAGE_POSITIONS

# The most kept slots a byte budget buys: past it a slot table is long for rank 0 to search
# and the stages preallocate more than a fleet's conversations need (a small model on a big
# node; under a pool of pages, where a dense model's kept slot costs no bytes of its own).
# A count set in prompt_cache_slots is not capped.
MAX_BUDGET_SLOTS = 64
LOGIT_BYTES = 4  # rank 0 samples from float32 logits, whatever the weights' dtype
GB = 1e9


class ShapeError(ValueError):
    """A model shape with a byte count that cannot be right (negative, or zero where it matters)."""


def _check_counts(owner: object, names: tuple[str, ...], positive: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShapeError(f"{type(owner).__name__}.{name} = {value!r}: "
                             "expected an integer >= 0")
    for name in positive:
        if getattr(owner, name) == 0:
            raise ShapeError(f"{type(owner).__name__}.{name} = 0: expected a positive integer")


@dataclass(frozen=True)
class LayerType:
    """The bytes of one type of decoder layer (config.json's `layer_types` names it)."""

    name: str
    weight_bytes: int
    kv_bytes_per_position: int = 0  # K and V of one cached position (attention layers)
    state_bytes_per_slot: int = 0  # a fixed recurrent state per stream (DeltaNet layers)

    def __post_init__(self) -> None:
        if not self.name:
            raise ShapeError("LayerType.name is empty")
        _check_counts(self, ("weight_bytes", "kv_bytes_per_position", "state_bytes_per_slot"),
                      ("weight_bytes",))


@dataclass(frozen=True)
class ModelShape:
    """What placement needs to know about a model: its layers, in order, and its bytes."""

    layers: tuple[LayerType, ...]  # one per decoder layer, global index order
    embedding_bytes: int
    final_norm_bytes: int
    head_bytes: int  # 0 when the head is tied to the embeddings (rank 0 holds those anyway)
    hidden_size: int
    row_bytes: int  # one hidden row as it travels the ring
    vocab_size: int
    # Rank 0's draft head where the model drafts with one (`drafter: mtp`): its weights and
    # its KV per cached position (engine.draft_head); 0 elsewhere.
    draft_head_weight_bytes: int = 0
    draft_head_kv_bytes_per_position: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ShapeError("ModelShape.layers is empty: expected at least one layer")
        _check_counts(self, tuple(f.name for f in fields(self) if f.name != "layers"),
                      ("hidden_size", "row_bytes", "vocab_size"))
        by_name: dict[str, LayerType] = {}
        for i, layer in enumerate(self.layers):
            if by_name.setdefault(layer.name, layer) != layer:
                raise ShapeError(f"ModelShape.layers[{i}]: type {layer.name!r} has two byte "
                                 f"counts ({by_name[layer.name]} and {layer})")

    @classmethod
    def uniform(cls, n_layers: int, layer_weight_bytes: int,
                kv_bytes_per_position_per_layer: int, **rest: int) -> ModelShape:
        """A dense decoder: `n_layers` full-attention layers of one shape."""
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ShapeError(f"ModelShape.n_layers = {n_layers!r}: expected a positive integer")
        layer = LayerType(FULL_ATTENTION, layer_weight_bytes, kv_bytes_per_position_per_layer)
        return cls(layers=(layer,) * n_layers, **rest)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def types(self) -> tuple[LayerType, ...]:
        """Each layer type once, in the order the layers first use them."""
        return tuple({layer.name: layer for layer in self.layers}.values())

    @property
    def is_uniform(self) -> bool:
        """Every layer the same type: a stage's cost then depends only on its layer count."""
        return len(self.types) == 1

    def type_counts(self, layer_range: tuple[int, int]) -> dict[str, int]:
        """How many layers of each type (all of them named, zeros too) lie in `layer_range`."""
        counts = dict.fromkeys((t.name for t in self.types), 0)
        for layer in self.layers[layer_range[0]:layer_range[1]]:
            counts[layer.name] += 1
        return counts

    @cached_property
    def _prefix(self) -> dict[str, tuple[int, ...]]:
        """Running sums over the layers: weights, KV per position, state per slot."""
        return {name: (0, *itertools.accumulate(getattr(layer, name) for layer in self.layers))
                for name in ("weight_bytes", "kv_bytes_per_position", "state_bytes_per_slot")}

    def range_sum(self, what: str, layer_range: tuple[int, int]) -> int:
        """The sum of LayerType field `what` over the layers of `layer_range`."""
        prefix = self._prefix[what]
        return prefix[layer_range[1]] - prefix[layer_range[0]]

    @property
    def total_weight_bytes(self) -> int:
        return (self.range_sum("weight_bytes", (0, self.n_layers)) + self.embedding_bytes
                + self.final_norm_bytes + self.head_bytes)


@dataclass(frozen=True)
class StageMemory:
    """The bytes one stage needs, by what they are for."""

    weights_bytes: int
    kv_bytes: int
    staging_bytes: int  # rows in and out; on rank 0 also the logits it samples from
    embedding_bytes: int = 0
    final_norm_bytes: int = 0
    head_bytes: int = 0
    state_bytes: int = 0  # recurrent states of its DeltaNet layers, one per stream
    draft_head_bytes: int = 0  # rank 0's draft head: weights and KV for every slot

    @property
    def rank0_extras_bytes(self) -> int:
        return (self.embedding_bytes + self.final_norm_bytes + self.head_bytes
                + self.draft_head_bytes)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.state_bytes + self.staging_bytes
                + self.rank0_extras_bytes)


@dataclass(frozen=True)
class ExecutionShape:
    """The model spec's execution shape: what every stage sizes its state and buffers for."""

    context: int  # positions per stream
    parallel: int  # streams served at once
    chunk: int  # prompt rows per round
    prompt_cache_slots: int = 0  # slots past `parallel` that keep finished conversations
    # KV pages of PAGE_POSITIONS every stage's pool holds (FLEET_KV_PAGES), shared by the
    # streams and the kept conversations; 0: a whole context for every slot.
    kv_pages: int = 0

    @property
    def slots(self) -> int:
        """Slots whose state every stage holds: the streams' and the kept conversations'."""
        return self.parallel + self.prompt_cache_slots

    @property
    def kv_positions(self) -> int:
        """Positions each attention layer of a stage keeps K and V for: the pool's, else a
        whole context for every slot. A pool is charged as set, even one larger than every
        slot's whole context (the engine then allocates only those): how many slots the
        budget buys is not known while the ranges are searched, and the charge must not
        grow once it is."""
        if self.kv_pages:
            return self.kv_pages * PAGE_POSITIONS
        return self.context * self.slots


def layer_bytes(layer: LayerType, execution: ExecutionShape) -> int:
    """One layer's weights plus its KV (`kv_positions`) and its recurrent state for every
    slot."""
    kv = layer.kv_bytes_per_position * execution.kv_positions
    return layer.weight_bytes + kv + layer.state_bytes_per_slot * execution.slots


def kept_slot_bytes(shape: ModelShape, context: int, layer_range: tuple[int, int],
                    kv_in_pool: bool = False) -> int:
    """What one more slot costs a stage of `layer_range`: KV for `context` positions and the
    recurrent states. A kept slot costs all of it, whatever it keeps: the state is
    preallocated. With `kv_in_pool` its KV lives in the stage's pool of pages, which is
    charged as a whole, so a kept slot costs its recurrent states alone (nothing, for a
    dense model)."""
    kv = 0 if kv_in_pool else shape.range_sum("kv_bytes_per_position", layer_range) * context
    return kv + shape.range_sum("state_bytes_per_slot", layer_range)


def slots_bought(budgets: Sequence[int], slot_bytes: Sequence[int]) -> int:
    """Kept slots a byte budget per stage buys: as many as the tightest stage holds (every
    stage keeps the same slot table), at most MAX_BUDGET_SLOTS. A slot of no bytes (a dense
    model's under a pool) costs a budget nothing: any budget buys the most, and a budget of
    0 (`prompt_cache_bytes: 0`) still buys none."""
    def bought(budget: int, size: int) -> int:
        if size == 0:
            return MAX_BUDGET_SLOTS if budget > 0 else 0
        return budget // size

    return min(MAX_BUDGET_SLOTS, *(bought(budget, size)
                                   for budget, size in zip(budgets, slot_bytes, strict=True)))


def fixed_bytes(shape: ModelShape, execution: ExecutionShape, is_rank0: bool) -> StageMemory:
    """What a stage holds whatever its layers (layers themselves left at zero)."""
    rows = max(execution.chunk, execution.parallel)
    staging = 2 * rows * shape.row_bytes  # receive and send buffers of one round
    if not is_rank0:
        return StageMemory(weights_bytes=0, kv_bytes=0, staging_bytes=staging)
    logits = execution.parallel * shape.vocab_size * LOGIT_BYTES
    # The draft head's KV is not paged (engine.draft_head): a whole context a slot, pool or not.
    draft_head = (shape.draft_head_weight_bytes + shape.draft_head_kv_bytes_per_position
                  * execution.context * execution.slots)
    return StageMemory(weights_bytes=0, kv_bytes=0, staging_bytes=staging + logits,
                       embedding_bytes=shape.embedding_bytes,
                       final_norm_bytes=shape.final_norm_bytes, head_bytes=shape.head_bytes,
                       draft_head_bytes=draft_head)


def stage_memory(shape: ModelShape, execution: ExecutionShape, layer_range: tuple[int, int],
                 is_rank0: bool) -> StageMemory:
    """Memory of a stage holding the layers of `layer_range` (and rank 0's extras on rank 0)."""
    fixed = fixed_bytes(shape, execution, is_rank0)
    return StageMemory(
        weights_bytes=shape.range_sum("weight_bytes", layer_range),
        kv_bytes=shape.range_sum("kv_bytes_per_position", layer_range) * execution.kv_positions,
        state_bytes=shape.range_sum("state_bytes_per_slot", layer_range) * execution.slots,
        staging_bytes=fixed.staging_bytes, embedding_bytes=fixed.embedding_bytes,
        final_norm_bytes=fixed.final_norm_bytes, head_bytes=fixed.head_bytes,
        draft_head_bytes=fixed.draft_head_bytes)


def layers_that_fit(shape: ModelShape, execution: ExecutionShape, usable_memory_bytes: int,
                    is_rank0: bool) -> int:
    """The most layers of a uniform model a node can hold as a stage; 0 when not even its
    fixed bytes fit. (A hybrid's answer depends on where the range starts.)"""
    if not shape.is_uniform:
        raise ShapeError("layers_that_fit: the layers differ by type; ask stage_memory "
                         "about a layer range instead")
    room = usable_memory_bytes - fixed_bytes(shape, execution, is_rank0).total_bytes
    return max(0, room // layer_bytes(shape.layers[0], execution))


def format_bytes(count: float) -> str:
    """Bytes for people: GB (10^9) above 1 GB, MB below; one decimal."""
    if abs(count) >= GB:
        return f"{count / GB:.1f} GB"
    return f"{count / 1e6:.1f} MB"


def model_shape_from_config(config_json: dict[str, Any], dtype_bytes: int,
                            backends: Sequence[str] = (), drafting: bool = False,
                            draft_head: bool = False) -> ModelShape:
    """Byte counts of a decoder from its Hugging Face `config.json`, per layer type.

    Every count is the family's description's (`engine.families`): each layer kind's tensors
    (exactly those a stage loads) and its state per position (KV) and per slot (a DeltaNet
    layer's conv window and delta-rule state); the embeddings, the final norm, and the head
    unless `tie_word_embeddings`. Every weight is taken to be `dtype_bytes` per element,
    unless the checkpoint is mlx-lm-quantized: then each packed weight counts what the stage
    will hold (`packed_weight_bytes`). With `draft_head` (`drafter: mtp`), rank 0 also
    holds the checkpoint's draft head (the description's `draft_head_tensors`, counted at
    `dtype_bytes` each, as the stage loads them dense) and its KV.
    """
    if not isinstance(dtype_bytes, int) or isinstance(dtype_bytes, bool) or dtype_bytes < 1:
        raise ShapeError(f"dtype_bytes = {dtype_bytes!r}: expected a positive integer")
    try:
        config = ModelConfig.from_dict(config_json)
    except (ConfigError, TypeError) as exc:
        raise ShapeError(str(exc)) from exc
    types = {kind.name: LayerType(kind.name, kind.weight_elements(config) * dtype_bytes,
                                  kind.state_bytes(config, dtype_bytes, "position"),
                                  kind.state_bytes(config, dtype_bytes, "slot", drafting))
             for kind in config.family.layer_kinds if kind.name in config.layer_types}
    ends = {t.field: t.elements * dtype_bytes for t in config.family.end_tensors(config)}
    embedding, head = ends["embed"], ends.get("head", 0)
    try:
        quant = QuantConfig.from_config(config_json)
    except QuantConfigError as exc:
        raise ShapeError(str(exc)) from exc
    if quant is not None:
        packed = packed_weight_bytes(config, quant, dtype_bytes, backends)
        types = {name: replace(t, weight_bytes=packed[name]) for name, t in types.items()}
        embedding, head = packed["embedding"], packed["head"]
    return ModelShape(
        layers=tuple(types[name] for name in config.layer_types),
        embedding_bytes=embedding,
        final_norm_bytes=ends["norm"],
        head_bytes=head,
        hidden_size=config.hidden_size,
        row_bytes=config.hidden_size * dtype_bytes,
        vocab_size=config.vocab_size,
        **(_draft_head_bytes(config, dtype_bytes) if draft_head else {}),
    )


def _draft_head_bytes(config: ModelConfig, dtype_bytes: int) -> dict[str, int]:
    """The draft head's weights and KV per position, as engine.families.description's
    `draft_head_bytes` counts them; a model with none drafts with none (the engine refuses
    `drafter: mtp` on it by name)."""
    weights = draft_head_bytes(config, 0, dtype_bytes, 0)
    per_position = draft_head_bytes(config, 1, dtype_bytes, 1) - weights
    return {"draft_head_weight_bytes": weights,
            "draft_head_kv_bytes_per_position": per_position}


def packed_weight_bytes(config: ModelConfig, quant: QuantConfig, dtype_bytes: int,
                        backends: Sequence[str]) -> dict[str, int]:
    """Weight bytes of an mlx-lm-quantized checkpoint as the stages will hold them: per layer
    type, and "embedding" and "head".

    A weight is packed as mlx-lm's loader packs it (a 2-D linear or embedding whose input
    width the group size divides, unless a per-path entry says otherwise); its bytes are
    what each backend holds (engine.backends.quant_policy: MLX the stored tensors, PyTorch
    its int4 layout where it runs packed, else the dense matrix), the most over `backends`
    (all of them when empty), since the one shape is charged on every node. A layer type's
    bytes are its largest layer's, as a mixed recipe (mlx-lm's mixed_3_6) packs some layers
    wider.
    """
    backends = tuple(backends) or BACKENDS
    packed_on = {b: runs_packed(b, config.dtype) for b in backends}

    def held(tensors: dict[str, tuple[int, ...]], lookups: dict[str, bool]) -> int:
        total = 0
        for name, shape in tensors.items():
            params = packed_params(quant, name, shape)
            if params is None:
                total += math.prod(shape) * dtype_bytes
                continue
            total += max(held_bytes(b, *shape, params, dtype_bytes, packed=packed_on[b],
                                    matmul=lookups.get(name, True), lookup=name in lookups)
                         for b in backends)
        return total

    out: dict[str, int] = {}
    for layer in range(config.num_hidden_layers):
        kind = config.layer_type(layer)
        out[kind] = max(out.get(kind, 0), held(layer_tensor_shapes(config, layer), {}))
    embed_name = f"{config.weight_prefix}embed_tokens.weight"
    ends = end_tensor_shapes(config)
    out["embedding"] = held({embed_name: ends[embed_name]},
                            {embed_name: config.tie_word_embeddings})
    out["head"] = held({"lm_head.weight": ends["lm_head.weight"]}, {}) \
        if "lm_head.weight" in ends else 0
    return out
