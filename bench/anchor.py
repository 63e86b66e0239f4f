"""The anchor: a minimal gpt-fast-style decode step of our model's shape, compiled whole.

What the best plain PyTorch does with the same checkpoint, so that our stage's decode
step has a figure to be measured against in the same process run (`bench/decode.py
--anchor`): one `nn.Module` (embedding, RMSNorm, fused q/k/v, RoPE, SDPA over a static
KV cache under gpt-fast's causal-mask row, SwiGLU MLP, head), a decode function that
takes a token per stream and returns the next greedy token on the device, compiled with
`torch.compile(mode="reduce-overhead", fullgraph=True)` (on CUDA: Inductor's fused
kernels replayed as one CUDA graph). It runs Llama-style dense checkpoints (Llama,
Mistral without its window, Qwen2's biases, Qwen3's q/k norms); hybrids are refused.

It follows gpt-fast's `model.py` and `generate.py` rather than our engine's code, so
that it also serves as an independent answer for our logits (tests/bench/test_anchor.py).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import fresh_inductor_cache

from engine.checkpoint.reader import open_checkpoint
from engine.config import ModelConfig, rope_inv_freq
from engine.family import load_range


class AnchorError(ValueError):
    """A checkpoint the anchor cannot run (a hybrid, a sliding window)."""


def frozen(t: torch.Tensor) -> nn.Parameter:
    # Parameters, not buffers: "reduce-overhead" keeps parameters at static addresses
    # instead of copying them into the graph's inputs each replay.
    return nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = frozen(weight), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                + self.eps)).type_as(x)


class KVCache(nn.Module):
    """gpt-fast's static cache: [batch, kv_heads, max_seq, head_dim], written at input_pos."""

    def __init__(self, batch: int, max_seq: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, input_pos] = k  # k: [batch, kv_heads, seq, head_dim]
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, w, cache: KVCache) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        eps = config.rms_norm_eps
        self.attention_norm = RMSNorm(w.input_norm, eps)
        self.ffn_norm = RMSNorm(w.post_norm, eps)
        self.wqkv = frozen(torch.cat((w.q, w.k, w.v)))  # one matmul for q, k and v
        biases = (w.q_bias, w.k_bias, w.v_bias)
        self.bqkv = frozen(torch.cat(biases)) if w.q_bias is not None else None
        self.q_norm = RMSNorm(w.q_norm, eps) if w.q_norm is not None else None
        self.k_norm = RMSNorm(w.k_norm, eps) if w.k_norm is not None else None
        self.wo = frozen(w.o)
        self.w1, self.w3, self.w2 = frozen(w.gate), frozen(w.up), frozen(w.down)
        self.kv_cache = cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.attention_norm(x)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = F.linear(h, self.wqkv, self.bqkv).split([q_width, kv_width, kv_width], -1)
        q = q.view(batch, seq, self.heads, self.head_dim)
        k = k.view(batch, seq, self.kv_heads, self.head_dim)
        v = v.view(batch, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (t * cos + rotate_half(t) * sin for t in (q, k))  # cos: [seq, 1, head_dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + F.linear(y.transpose(1, 2).reshape(batch, seq, q_width), self.wo)
        h = self.ffn_norm(x)
        return x + F.linear(F.silu(F.linear(h, self.w1)) * F.linear(h, self.w3), self.w2)


class Anchor(nn.Module):
    """The whole model for `batch` streams of up to `max_seq` positions."""

    def __init__(self, config: ModelConfig, weights: tuple, batch: int, max_seq: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        layers, (embed, norm, head) = weights
        self.embed = frozen(embed)
        self.layers = nn.ModuleList(
            Block(config, w, KVCache(batch, max_seq, config.num_key_value_heads,
                                     config.head_dim, dtype, device)) for w in layers)
        self.norm = RMSNorm(norm, config.rms_norm_eps)
        self.head = frozen(head)
        inv_freq = torch.tensor(rope_inv_freq(config), dtype=torch.float32, device=device)
        freqs = torch.arange(max_seq, dtype=torch.float32, device=device)[:, None] * inv_freq
        table = torch.cat((freqs, freqs), dim=-1)  # [max_seq, head_dim]
        self.register_buffer("cos", table.cos().to(dtype))
        self.register_buffer("sin", table.sin().to(dtype))
        self.register_buffer("causal_mask", torch.tril(torch.ones(
            max_seq, max_seq, dtype=torch.bool, device=device)))

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """idx: [batch, seq] token ids at positions input_pos [seq] -> [batch, seq, vocab]."""
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, seq, max_seq]
        cos, sin = self.cos[input_pos][:, None], self.sin[input_pos][:, None]
        x = F.embedding(idx, self.embed)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return F.linear(self.norm(x), self.head).float()


def decode_one_token(model: Anchor, token: torch.Tensor,
                     input_pos: torch.Tensor) -> torch.Tensor:
    """token: [batch, 1] at position input_pos [1] -> the greedy next token [batch, 1]."""
    return model(token, input_pos)[:, -1].argmax(-1, keepdim=True)


def load_anchor(model_dir: Path, batch: int, max_seq: int, dtype: torch.dtype,
                device: torch.device) -> Anchor:
    checkpoint = open_checkpoint(model_dir)
    config = ModelConfig.from_dict(checkpoint.config)
    if config.is_hybrid or config.sliding_window or config.attn_output_gate:
        raise AnchorError(f"{model_dir}: the anchor runs Llama-style dense checkpoints "
                          "without a sliding window")

    def load(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        tensors = checkpoint.load_tensors(list(shapes), "pt", str(device))
        return {name: t.to(dtype) for name, t in tensors.items()}

    weights = load_range(config, (0, config.num_hidden_layers), load)
    with torch.no_grad():
        return Anchor(config, weights, batch, max_seq, dtype, device).eval()


@dataclass
class AnchorTiming:
    ms_per_step: float  # median over the repeats
    # The compiled step's first calls: compile, warm-up, graph record; from empty caches
    # when timed `cold`, else whatever Inductor's caches hold.
    cold_start_s: float


def time_anchor(model_dir: Path, device: torch.device, dtype: torch.dtype, batch: int,
                prompt: int, steps: int, repeats: int, *, compile: bool = True,
                cold: bool = False) -> AnchorTiming:
    """ms per decode step of `batch` streams after a `prompt`-token prefill, gpt-fast's way:
    the next token stays on the device and the host waits only at the end of `steps`."""
    model = load_anchor(model_dir, batch, prompt + steps + 1, dtype, device)
    step = decode_one_token
    if compile:
        step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(256, model.embed.shape[0]), (batch, prompt),
                        generator=generator).to(device)
    with torch.no_grad():
        first = model(ids, torch.arange(prompt, device=device))[:, -1].argmax(-1, keepdim=True)
        sync()

        def run() -> float:
            token = first
            # On the device and advanced in place, gpt-fast's way: a new host tensor each
            # step would be a copy from pageable memory, which waits for the queue to drain.
            position = torch.tensor([prompt], device=device)
            start = time.perf_counter()
            for _ in range(steps):
                token = step(model, token, position).clone()  # the graph reuses its output
                position += 1
            sync()
            return time.perf_counter() - start

        start = time.perf_counter()
        with fresh_inductor_cache() if cold else nullcontext():
            for i in range(3):  # compile, warm-up, record (reduce-overhead's first calls)
                step(model, first, torch.tensor([prompt + i], device=device))
            sync()
        cold_start_s = time.perf_counter() - start
        run()
        times = sorted(run() for _ in range(repeats))
    return AnchorTiming(times[len(times) // 2] * 1000 / steps, cold_start_s)
