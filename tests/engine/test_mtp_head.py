"""The Qwen3.5 MTP head (engine.draft_head) against a reference built of transformers'
own Qwen3.5 components, on a random checkpoint with a whole head (the maker's --mtp).

transformers loads no MTP head (it drops `mtp.*` by design), so the reference is its
`Qwen3_5DecoderLayer` (a full-attention layer), `Qwen3_5RMSNorm` for the three norms, a
bias-free Linear for `fc` and `Qwen3_5TextRotaryEmbedding`, loaded from the checkpoint's
`mtp.*` tensors and wired as vLLM's Qwen3_5MultiTokenPredictor wires them:
fc([norm_e(embed(next token)); norm_h(hidden)]) -> layer -> norm -> the model's lm_head.
The hidden rows are transformers' own (its text model's last hidden state, after the
final norm), and the tokens its greedy ones. Our head is fed the same rows through a
loaded stage, in pieces (a chunk, then a row at a time, with drafts cut back between), and
its outputs must match the reference's at every position; its k drafts must be the
reference's own greedy chain (each step fed its output and its guess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.base import StageSpec, load_stage
from engine.config import ModelConfig
from engine.draft_head import DraftAsk
from tests.requirements import require

PROMPT = 14
ATOL = 1e-4  # float32, as the other hybrid tests


@pytest.fixture(scope="module")
def model_dir(make_model) -> Path:
    return make_model("qwen3_5", mtp=True, seed=31)


def reference(model_dir: Path):
    """(transformers' causal LM, a function: hidden [n, h], tokens [n], first position ->
    the MTP head's output rows [n, h]) over the whole sequence at once, float64."""
    torch = require("torch")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    config = lm.config
    config._attn_implementation = "eager"
    tensors = {k: v.double() for k, v in load_file(model_dir / "model.safetensors").items()
               if k.startswith("mtp.")}
    full = config.layer_types.index("full_attention")
    layer = q.Qwen3_5DecoderLayer(config, full).double().eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in tensors.items()
                           if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = q.Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps).double()
        norms[name].load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False).double()
    fc.load_state_dict({"weight": tensors["mtp.fc.weight"]})
    rotary = q.Qwen3_5TextRotaryEmbedding(config)

    def mtp(hidden, tokens, first):
        n = len(tokens)
        e = norms["pre_fc_norm_embedding"](lm.model.embed_tokens(tokens))
        x = fc(torch.cat((e, norms["pre_fc_norm_hidden"](hidden)), dim=-1))[None]
        positions = torch.arange(first, first + n)[None]
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = layer(x, rotary(x, positions), attention_mask=mask, position_ids=positions)
        return norms["norm"](out)[0]

    return lm, mtp


def reference_drafts(lm, mtp, hidden, tokens, count: int) -> list[int]:
    """The reference's greedy chain of `count` drafts after the head has read `hidden` [n, h]
    (rows of positions 0..n-1) beside `tokens` [n] (each row's next token): each step one
    more entry (its output and its guess), the whole sequence run again."""
    torch = require("torch")
    chain, seq_h, seq_t = [], hidden, tokens
    last = mtp(seq_h, seq_t, 0)[-1:]
    for _ in range(count):
        token = lm.lm_head(last).argmax(-1)
        chain.append(int(token))
        seq_h, seq_t = torch.cat((seq_h, last)), torch.cat((seq_t, token))
        last = mtp(seq_h, seq_t, 0)[-1:]
    return chain


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_head_matches_transformers_components(model_dir: Path, backend: str) -> None:
    torch = require("torch")
    if backend.startswith("mlx"):
        require("mlx.core")
    with torch.no_grad():
        lm, mtp = reference(model_dir)
        prompt = torch.arange(3, 3 + PROMPT) * 7 % 250 + 5
        out = lm.generate(prompt[None], max_new_tokens=1, do_sample=False)
        ids = torch.cat((prompt, out[0, -1:]))
        hidden = lm.model(ids[None]).last_hidden_state[0]  # [n, h], after the final norm
        n = PROMPT  # row i scored ids[i + 1]
        want = mtp(hidden[:n], ids[1:n + 1], 0)  # [n, h]
        want_logits = lm.lm_head(want).float().numpy()
        chain = reference_drafts(lm, mtp, hidden[:n], ids[1:n + 1], 3)

    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    stage = load_stage(StageSpec(model_dir, (0, config.num_hidden_layers), backend, parallel=4,
                                 context=64, chunk=64, drafting=True, draft_head=True))
    head = stage.draft_head
    rows = _to_backend(backend, hidden.float().numpy())
    tokens = ids.tolist()

    def logits(slot: int, count: int, first: int, stop: int) -> np.ndarray:
        """Rows [first, stop) run again after the slot's first `count` entries."""
        with stage._computing():
            head.count[slot] = count
            out = head.forward([slot] * (stop - first), rows[first:stop],
                               _ids(backend, tokens[first + 1:stop + 1]),
                               list(range(first, stop)))
            return _to_numpy(backend, head.logits(out))

    def draft(slot: int, kept: int, first: int, stop: int, count: int) -> tuple[int, ...]:
        return stage.draft([ask(slot, kept, first, stop, count)])[0]

    def ask(slot: int, kept: int, first: int, stop: int, count: int) -> DraftAsk:
        return DraftAsk(slot, kept, rows, tuple(range(first, stop)),
                        tuple(tokens[first + 1:stop + 1]), first, count)

    # Fed in one call from nothing: every position's output.
    assert np.abs(logits(0, 0, 0, n) - want_logits).max() < ATOL

    # Fed in pieces, 2 drafts after each (their entries cut back by the next call): a chunk
    # of 9 rows, then one row at a time; the last row's output over what the pieces wrote.
    draft(1, 0, 0, 9, 2)
    for i in range(9, n):
        draft(1, i, i, i + 1, 2)
    assert np.abs(logits(1, n - 1, n - 1, n) - want_logits[n - 1:]).max() < ATOL

    # The drafts: the reference's own greedy chain, alone and beside other streams whose
    # draft steps run in the same batches (one feeding only, one drafting fewer).
    assert list(draft(0, 0, 0, n, 3)) == chain
    together = stage.draft([ask(1, 0, 0, 5, 0), ask(0, 0, 0, n, 3), ask(2, 0, 0, 8, 1)])
    assert list(together[0]) == [] and list(together[1]) == chain and len(together[2]) == 1
    assert together[2] == draft(3, 0, 0, 8, 1)


def test_no_head_is_refused_by_name(make_model) -> None:
    require("torch")
    model_dir = make_model("qwen3_5")
    from engine.backends.base import BackendError

    with pytest.raises(BackendError, match="mtp_num_hidden_layers 0"):
        load_stage(StageSpec(model_dir, (0, 4), "torch-cpu", parallel=1, context=16, chunk=16,
                             drafting=True, draft_head=True))


def _to_backend(backend: str, rows: np.ndarray):
    if backend.startswith("mlx"):
        import mlx.core as mx

        return mx.array(rows)
    import torch

    return torch.from_numpy(rows)


def _ids(backend: str, ids: list[int]):
    if backend.startswith("mlx"):
        import mlx.core as mx

        return mx.array(ids, dtype=mx.int32)
    import torch

    return torch.tensor(ids, dtype=torch.int64)


def _to_numpy(backend: str, x) -> np.ndarray:
    return np.array(x) if backend.startswith("mlx") else x.float().numpy()


@pytest.mark.parametrize("backend", ["torch-cpu", "mlx-cpu"])
def test_the_head_drafts_in_bfloat16(make_model, backend: str) -> None:
    """A bfloat16 checkpoint's head loads and drafts on both backends (its cache in the
    model's dtype); what it drafts is held to the reference in float32 above."""
    require("mlx.core" if backend.startswith("mlx") else "torch")
    model_dir = make_model("qwen3_5", mtp=True, dtype="bfloat16", seed=31)
    stage = load_stage(StageSpec(model_dir, (0, 4), backend, parallel=2, context=32, chunk=32,
                                 drafting=True, draft_head=True))
    rows = stage.draft_rows(stage._embed([5, 6, 7]))  # any rows of the model's dtype
    drafts = stage.draft([DraftAsk(0, 0, rows, (0, 1, 2), (6, 7, 8), 0, 3),
                          DraftAsk(1, 0, rows, (2,), (9,), 4, 2)])
    assert [len(d) for d in drafts] == [3, 2]
    assert all(0 <= t < stage.config.vocab_size for d in drafts for t in d)


def test_a_draft_step_by_the_decode_kernel_is_the_gathered_attention():
    """The kernel's way (CUDA, one row a slot) under Triton's interpreter, against SDPA over
    the gathered entries: tests/engine/mtp_head_kernel_case.py. The interpreter is chosen
    when triton is imported, so it runs in a process of its own."""
    require("triton")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.engine.mtp_head_kernel_case"],
                          cwd=root, env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
