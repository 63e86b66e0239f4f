"""The Qwen3.5 hybrid (Gated DeltaNet layers between gated full-attention layers) on MLX.

The MLX twin of the PyTorch backend's hybrid family: the same weight names and range rules
(`engine.family`), the same round semantics, state per slot for both layer types
(`recurrent_state.py`). The maths follows transformers' `Qwen3_5*` modules and mlx-lm's
`qwen3_5.py`:

- every RMSNorm of the residual stream and q/k norms scale by (1 + weight); the weights are
  shifted once at load (in float32, then cast), so `mx.fast.rms_norm` runs as for Llama. The
  DeltaNet's gated norm keeps its plain weight.
- full attention: q_proj yields each head's query and then its gate; q/k norms; RoPE on the
  first `rotary_dim` channels only (text positions make multimodal RoPE plain RoPE); the
  output is multiplied by sigmoid(gate) before o_proj.
- Gated DeltaNet: one projection for q, k, v; a depthwise causal convolution over the last
  `kernel` inputs (its window is the conv state) and SiLU; q and k L2-normalised, q scaled
  by k_dim^-1/2; per value head a decay g = exp(-exp(A_log) softplus(a + dt_bias)) and a
  write strength beta = sigmoid(b); the delta rule S <- g S + beta (v - g S k) k^T, read
  as S q; a gated RMSNorm with SiLU(z); out_proj.

Decode rows of unrelated slots run the one-step recurrence batched together; a prompt
chunk runs the chunked (WY) form of the same rule from its slot's state, 16 tokens a block:
a few matmuls and one triangular solve instead of a graph node per token. A verify entry's
rows (engine.rounds) are decode rows, several of one slot: the one step runs them in
steps, row j of every slot at once, and keeps the state after each (recurrent_state.py),
so the next entry may keep any prefix; their projections and MLP stay batched. A
stream's first row starts from zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from engine.backends.mlx.kv_cache import KVCache, kv_cache
from engine.backends.mlx.llama import Rope, linear, mlp
from engine.backends.mlx.quant import QuantizedWeight, Weight
from engine.backends.mlx.recurrent_state import (
    HybridIndex,
    HybridState,
    RecurrentIndex,
    RecurrentState,
)
from engine.config import LINEAR_ATTENTION, ModelConfig
from engine.family import DeltaNetWeights, LayerWeights, load_range
from engine.rounds import RowLayout

if TYPE_CHECKING:
    from engine.backends.base import StageSpec

L2_EPS = 1e-6  # transformers' and fla's l2norm epsilon, added to the sum of squares
# Tokens a prompt chunk's delta rule solves at once. The chunked form takes differences of
# cumulative log decays, which lose float32 precision as they grow: over 64 tokens a strong
# decay left a logit 1e-4 from mlx-lm's per-token scan, over 16 3e-5 (as close as the scan
# itself is to a float64 transformers).
DELTA_BLOCK = 16


def one_plus(weight: mx.array) -> mx.array:
    """A (1 + weight) norm's scale, added in float32 as transformers computes it."""
    return (weight.astype(mx.float32) + 1.0).astype(weight.dtype)


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def l2_normalize(x: mx.array) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32.

    Written as an RMS norm (mean instead of sum, so eps / width, then a 1 / sqrt(width)
    factor): the same value, through the fused op mlx-lm uses, which keeps a long prompt's
    recurrent state within float32 noise of mlx-lm's (2e-5 of a logit, not 1.5e-4).
    """
    width = x.shape[-1]
    return width**-0.5 * mx.fast.rms_norm(x.astype(mx.float32), None, L2_EPS / width)


def delta_step(state: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
               beta: mx.array) -> tuple[mx.array, mx.array]:
    """One token of the gated delta rule for a batch of independent streams.

    state [n, heads, v_dim, k_dim]; q, k [n, heads, k_dim]; v [n, heads, v_dim];
    g, beta [n, heads]. Returns (y [n, heads, v_dim], the new state).
    """
    state = state * g[..., None, None]
    remembered = (state * k[:, :, None, :]).sum(axis=-1)  # [n, heads, v_dim]
    delta = (v - remembered) * beta[..., None]
    state = state + k[:, :, None, :] * delta[..., None]
    return (state * q[:, :, None, :]).sum(axis=-1), state


def delta_chunk(state: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
                beta: mx.array) -> tuple[mx.array, mx.array]:
    """A block of T tokens of the gated delta rule at once (its chunked, WY form).

    state [n, heads, v_dim, k_dim]; q, k [n, T, heads, k_dim]; v [n, T, heads, v_dim];
    g, beta [n, T, heads]. With c_t the cumulative log decay, the rule's corrections
    u_t = beta_t (v_t - g_t S_{t-1} k_t) solve the unit lower-triangular system
    u_t + sum_{j<t} beta_t (k_t . k_j) e^{c_t - c_j} u_j = beta_t (v_t - e^{c_t} S_0 k_t);
    then y_t = e^{c_t} S_0 q_t + sum_{j<=t} e^{c_t - c_j} (q_t . k_j) u_j and
    S_T = e^{c_T} S_0 + sum_j e^{c_T - c_j} u_j k_j^T. Every exponent is <= 0 but the
    masked ones, which are zeroed before exp so they cannot overflow.
    """
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [n, heads, T, dim]
    steps = q.shape[2]
    c = mx.cumsum(mx.log(g).transpose(0, 2, 1), axis=-1)  # [n, heads, T]
    b = beta.transpose(0, 2, 1)[..., None]  # [n, heads, T, 1]
    lower = mx.tril(mx.ones((steps, steps), dtype=mx.bool_))
    gaps = c[..., :, None] - c[..., None, :]  # [n, heads, T, T]: c_t - c_j
    decay = mx.where(lower, mx.exp(mx.where(lower, gaps, 0.0)), 0.0)
    kk = mx.tril((k * b) @ k.swapaxes(-1, -2) * decay, -1)
    system = kk + mx.eye(steps, dtype=kk.dtype)
    grown = mx.exp(c)[..., None]  # [n, heads, T, 1]: e^{c_t}
    rhs = v * b - (k * b * grown) @ state.swapaxes(-1, -2)  # [n, heads, T, v_dim]
    u = mx.linalg.solve_triangular(system, rhs, upper=False, stream=mx.cpu)
    y = (q * grown) @ state.swapaxes(-1, -2) + (q @ k.swapaxes(-1, -2) * decay) @ u
    to_end = mx.exp(c[..., -1:, None] - c[..., None])  # [n, heads, T, 1]: e^{c_T - c_j}
    state = state * grown[..., -1:, :] + u.swapaxes(-1, -2) @ (k * to_end)
    return y.transpose(0, 2, 1, 3), state


class GatedDeltaNet:
    """One DeltaNet layer's token mixer over a round's rows."""

    def __init__(self, config: ModelConfig) -> None:
        self.k_heads = config.linear_num_key_heads
        self.v_heads = config.linear_num_value_heads
        self.k_dim = config.linear_key_head_dim
        self.v_dim = config.linear_value_head_dim
        self.key_width = config.linear_key_width
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps

    def __call__(self, x: mx.array, w: DeltaNetWeights, state: RecurrentState, layer_slot: int,
                 index: HybridIndex) -> mx.array:
        rows = x.shape[0]
        qkv = linear(x, w.qkv)  # [rows, conv width]
        z = linear(x, w.z).reshape(rows, self.v_heads, self.v_dim)
        beta = mx.sigmoid(linear(x, w.b).astype(mx.float32))  # [rows, v_heads]
        a = linear(x, w.a).astype(mx.float32)
        g = mx.exp(-mx.exp(w.a_log.astype(mx.float32))
                   * mx.logaddexp(a + w.dt_bias.astype(mx.float32), 0.0))  # softplus
        att, rec = index.attention, index.recurrent
        parts = []
        if rec.verify_steps is not None:  # several rows of a slot: in steps
            rows_ = att.single_rows
            parts.append(self._verify_steps(qkv[rows_], g[rows_], beta[rows_], w, state,
                                            layer_slot, rec))
        elif att.single_rows is not None:  # one row a slot
            rows_ = att.single_rows
            conv, delta = state.read_singles(layer_slot, att.single_slots, rec.single_fresh)
            y, conv, delta = self._mix(qkv[rows_][:, None], g[rows_][:, None],
                                       beta[rows_][:, None], w, conv, delta)
            state.write(layer_slot, att.single_slots, conv, delta)
            parts.append(y[:, 0])
        for span, fresh in zip(att.spans, rec.span_fresh, strict=True):
            sl = slice(span.start, span.stop)
            conv, delta = state.read_span(layer_slot, span.slot, fresh)
            y, conv, delta = self._mix(qkv[sl][None], g[sl][None], beta[sl][None], w,
                                       conv, delta)
            state.write(layer_slot, slice(span.slot, span.slot + 1), conv, delta)
            parts.append(y[0])
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        if att.order is not None:
            y = y[att.order]  # [rows, v_heads, v_dim] in the round's row order
        y = mx.fast.rms_norm(y.astype(x.dtype), w.norm, self.eps).astype(mx.float32)
        y = (y * silu(z.astype(mx.float32))).astype(x.dtype)
        return linear(y.reshape(rows, self.v_heads * self.v_dim), w.out)

    def _mix(self, qkv: mx.array, g: mx.array, beta: mx.array, w: DeltaNetWeights,
             conv_state: mx.array, delta_state: mx.array,
             ) -> tuple[mx.array, mx.array, mx.array]:
        """Streams of equal length T: qkv [n, T, c], g and beta [n, T, v_heads].

        Returns (y [n, T, v_heads, v_dim] float32, conv state, delta state).
        """
        steps = qkv.shape[1]
        window = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [n, T+k-1, c]
        new_conv = window[:, window.shape[1] - (self.kernel - 1):]
        q, k, v = self._conv_qkv(window, w)
        if steps == 1:  # decode rows: the one-step recurrence, batched over their slots
            y, delta_state = delta_step(delta_state, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                        beta[:, 0])
            return y[:, None], new_conv, delta_state
        ys = []  # a prompt chunk: the chunked form, a block at a time (T^2 memory bounded)
        for at in range(0, steps, DELTA_BLOCK):
            part = slice(at, at + DELTA_BLOCK)
            y, delta_state = delta_chunk(delta_state, q[:, part], k[:, part], v[:, part],
                                         g[:, part], beta[:, part])
            ys.append(y)
        return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), new_conv, delta_state

    def _conv_qkv(self, window: mx.array, w: DeltaNetWeights,
                  ) -> tuple[mx.array, mx.array, mx.array]:
        """The short conv over window [n, T + k - 1, c], then q, k [n, T, v_heads, k_dim]
        (normalised, one per value head) and v [n, T, v_heads, v_dim] float32."""
        n, steps = window.shape[0], window.shape[1] - (self.kernel - 1)
        mixed = silu(mx.conv1d(window, w.conv, groups=window.shape[-1]))  # [n, T, c]
        kw = self.key_width
        q = mixed[..., :kw].reshape(n, steps, self.k_heads, self.k_dim)
        k = mixed[..., kw:2 * kw].reshape(n, steps, self.k_heads, self.k_dim)
        v = mixed[..., 2 * kw:].reshape(n, steps, self.v_heads, self.v_dim).astype(mx.float32)
        q = l2_normalize(q) * self.k_dim**-0.5
        k = l2_normalize(k)
        if self.v_heads != self.k_heads:  # each key head serves consecutive value heads
            q = mx.repeat(q, self.v_heads // self.k_heads, axis=2)
            k = mx.repeat(k, self.v_heads // self.k_heads, axis=2)
        return q, k, v

    def _verify_steps(self, qkv: mx.array, g: mx.array, beta: mx.array, w: DeltaNetWeights,
                      state: RecurrentState, layer_slot: int, rec: RecurrentIndex) -> mx.array:
        """Single rows of which some slots hold several (verify entries'), in the singles'
        order: row j of every slot that has one runs as one batch of decode rows, and the
        state after it is kept (`keep_rows`), so the next entry may keep any prefix of a
        verify entry. The recurrence is a decode row's, step by step: the chunked form
        would give the last row's state alone, and other bits than decode rows give.

        qkv [n, c], g and beta [n, v_heads]. Returns y [n, v_heads, v_dim] float32.
        """
        ys = []
        for at, step in enumerate(rec.verify_steps):
            conv, delta = state.read_singles(layer_slot, step.slots, step.fresh)
            y, conv, delta = self._mix(qkv[step.rows][:, None], g[step.rows][:, None],
                                       beta[step.rows][:, None], w, conv, delta)
            state.write(layer_slot, step.slots, conv, delta)
            state.keep_rows(layer_slot, step.slots, at, conv, delta)
            ys.append(y[:, 0])
        return mx.concatenate(ys, axis=0)[rec.step_order]


def gated_attention(x: mx.array, w: LayerWeights, config: ModelConfig, rope: Rope,
                    cache: KVCache, layer_slot: int, index: HybridIndex) -> mx.array:
    rows, d = x.shape[0], config.head_dim
    heads = config.num_attention_heads
    q_and_gate = linear(x, w.q).reshape(rows, heads, 2 * d)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:].reshape(rows, heads * d)
    k = linear(x, w.k).reshape(rows, config.num_key_value_heads, d)
    v = linear(x, w.v).reshape(rows, config.num_key_value_heads, d)
    q = mx.fast.rms_norm(q, w.q_norm, config.rms_norm_eps)
    k = mx.fast.rms_norm(k, w.k_norm, config.rms_norm_eps)
    att = index.attention
    q = rope.apply(q, att.positions)
    k = rope.apply(k, att.positions)
    cache.write(layer_slot, att, k, v)
    out = cache.attend(layer_slot, att, q, d**-0.5).reshape(rows, heads * d)
    return linear(out * mx.sigmoid(gate), w.o)


class Qwen35Range:
    """Layers [start, end) of a Qwen3.5 hybrid, plus the ends when it is the first range."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int],
                 load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]],
                 cache: HybridState, rope: Rope, on_layer: Callable[[int], None] | None = None):
        self.config = config
        self.layer_range = layer_range
        self.cache = cache
        self.rope = rope
        self.mixer = GatedDeltaNet(config)
        layers, ends = load_range(config, layer_range, load, on_layer)
        self.layers = [_shift_norms(w) for w in layers]
        embed, norm, head = ends
        self.embed, self.head = embed, head
        self.norm = None if norm is None else one_plus(norm)
        # Evaluated here: a lazy op keeps the stream of the thread that made it, and rounds
        # run on another thread (the lane host's), which has no such stream.
        mx.eval([a for w in self.layers for a in vars(w).values() if isinstance(a, mx.array)],
                [] if self.norm is None else self.norm)
        # Each layer's index into the state of its type: KV for attention, recurrent for DeltaNet.
        self.state_slots, counts = [], {True: 0, False: 0}
        for layer in range(*layer_range):
            linear_ = config.layer_type(layer) == LINEAR_ATTENTION
            self.state_slots.append(counts[linear_])
            counts[linear_] += 1

    @staticmethod
    def state_for(config: ModelConfig, layer_range: tuple[int, int], slots: int, context: int,
                  dtype: mx.Dtype, verify_states: int, pages: int = 0) -> HybridState:
        """KV for the range's attention layers (a pool of `pages`, else whole windows),
        recurrent state for the rest."""
        types = [config.layer_type(i) for i in range(*layer_range)]
        deltanet = types.count(LINEAR_ATTENTION)
        kv = kv_cache(len(types) - deltanet, slots, config.num_key_value_heads, context,
                      config.head_dim, dtype, pages)
        recurrent = RecurrentState(deltanet, slots, config.linear_conv_kernel_dim,
                                   config.linear_conv_width, config.linear_num_value_heads,
                                   config.linear_value_head_dim, config.linear_key_head_dim,
                                   dtype, verify_states)
        return HybridState(kv, recurrent)

    def round_index(self, layout: RowLayout) -> HybridIndex:
        """Where a round's rows sit, for both layer types, built once a round."""
        return HybridIndex.build(layout)

    def embed_tokens(self, token_ids: mx.array) -> mx.array:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(token_ids)  # [rows, hidden]
        return self.embed[token_ids]  # [rows, hidden]

    def run_layers(self, x: mx.array, index: HybridIndex) -> mx.array:
        eps = self.config.rms_norm_eps
        for w, state_slot in zip(self.layers, self.state_slots):
            h = mx.fast.rms_norm(x, w.input_norm, eps)
            if isinstance(w, DeltaNetWeights):
                x = x + self.mixer(h, w, self.cache.recurrent, state_slot, index)
            else:
                x = x + gated_attention(h, w, self.config, self.rope, self.cache.kv, state_slot,
                                        index)
            x = x + mlp(mx.fast.rms_norm(x, w.post_norm, eps), w)
        return x

    def logits(self, x: mx.array) -> mx.array:
        x = mx.fast.rms_norm(x, self.norm, self.config.rms_norm_eps)
        return linear(x, self.head).astype(mx.float32)  # [rows, vocab]


def _shift_norms(w: LayerWeights | DeltaNetWeights) -> LayerWeights | DeltaNetWeights:
    """(1 + weight) norms as plain scales; the conv weight as mx.conv1d wants it."""
    w.input_norm = one_plus(w.input_norm)
    w.post_norm = one_plus(w.post_norm)
    if isinstance(w, DeltaNetWeights):
        w.conv = w.conv.transpose(0, 2, 1)  # [c, 1, kernel] -> [c, kernel, 1]
    else:
        w.q_norm = one_plus(w.q_norm)
        w.k_norm = one_plus(w.k_norm)
    return w


def build_range(config: ModelConfig, spec: StageSpec,
                load: Callable[[dict[str, tuple[int, ...]]], dict[str, Weight]],
                dtype: mx.Dtype, on_layer: Callable[[int], None] | None = None) -> Qwen35Range:
    """The stage's range, KV for its attention layers and recurrent state for its DeltaNet
    layers: this family's entry for the MLX stage."""
    state = Qwen35Range.state_for(config, spec.layer_range, spec.parallel, spec.context, dtype,
                                  spec.verify_states, spec.kv_pages)
    return Qwen35Range(config, spec.layer_range, load, state, Rope(config), on_layer)
