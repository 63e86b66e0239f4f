"""The Qwen3.5 hybrid on the PyTorch backend against transformers, and its per-slot state.

Checkpoints come from our maker in both layouts (causal LM; conditional generation with a
vision tower and MTP tensors beside the text weights), tied and untied. transformers runs
each prompt whole (its chunked delta rule) and decodes with its one-step recurrence; we
feed the same tokens one row a stream a round, in prompt chunks of several rounds, and
mixed rounds, and compare logits at every position.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine.backends.base import StageSpec, load_stage
from engine.config import ModelConfig
from engine.harness.driver import RoundDriver
from engine.harness.local_pipeline import model_config
from engine.link.errors import BadEntry
from engine.pipeline.runner import LocalRunner
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.engine.logits_at_every_position import check_logits_at_every_position

ATOL = 1e-4
LENGTHS = (300, 131, 9)  # several 64-token blocks of the chunked rule, and a short one


def hybrid(make_model, *, multimodal: bool = False, tie: bool = False, **kw) -> Path:
    # A seed of its own, not the session's count of models made: random hybrids with small
    # DeltaNet heads differ in conditioning, so a model that hung on test order would make
    # the bound below hold or not by which tests ran first.
    return make_model("qwen3_5", multimodal=multimodal, tie=tie, seed=kw.pop("seed", 24), **kw)


def reference(model_dir: Path, dtype: torch.dtype = torch.float64):
    """transformers' model, by default in float64: the bound then measures our float32
    error alone, not ours plus the reference's own float32 rounding."""
    config = ModelConfig.from_dict(__import__("json").loads((model_dir / "config.json")
                                                              .read_text()))
    cls = (transformers.Qwen3_5ForConditionalGeneration if config.model_type == "qwen3_5"
           else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(model_dir, dtype=dtype).eval()


def ref_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()  # [len, vocab]


def stage_of(model_dir: Path, layers: tuple[int, int] | None = None, parallel: int = 4):
    config = model_config(model_dir)
    spec = StageSpec(model_dir, layers or (0, config.num_hidden_layers), "torch-cpu", parallel,
                     512, 64)
    return load_stage(spec)


def batch(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "conditional"])
def test_logits_match_transformers_at_every_position(make_model, multimodal, tie):
    model_dir = hybrid(make_model, multimodal=multimodal, tie=tie)
    ref = reference(model_dir)
    prompts = batch(1)
    expected = [ref_logits(ref, ids) for ids in prompts]
    driver = RoundDriver(LocalRunner(stage_of(model_dir)))
    check_logits_at_every_position(driver, prompts, expected, atol=ATOL)
    # The same prompts again on the same (reused) slots, as chunks of 50 rows over several
    # rounds: each chunk starts from the state the previous one left.
    driver.close(list(range(len(prompts))))
    for start in range(0, max(LENGTHS), 50):
        feeds = {s: ids[start:start + 50] for s, ids in enumerate(prompts) if start < len(ids)}
        got = driver.round(feeds)
        for slot, ids in feeds.items():
            last = start + len(ids) - 1
            np.testing.assert_allclose(got[slot], expected[slot][last], atol=ATOL, rtol=0,
                                       err_msg=f"stream {slot}, chunk ending at {last}")


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "conditional"])
def test_greedy_generation_matches_transformers(make_model, multimodal):
    """64 greedy steps after a 300-token prompt, on transformers' path: our logits within the
    bound at every step, and our greedy token the argmax of transformers' logits wherever its
    top two are further apart than the two models can differ (a near-tie may go either way).
    The argmax, not `generate`'s token: its cached decode path runs the delta rule in float32
    whatever the model's dtype, and after 300 tokens it may pick the other side of a tie
    that its own full forward pass (the reference here) does not."""
    model_dir = hybrid(make_model, multimodal=multimodal)
    ref = reference(model_dir)
    prompt = batch(2)[0]  # 300 tokens
    # No end-of-stream token: generate neither stops at it nor forbids it (as min_new_tokens
    # would); 64 plain greedy steps.
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                           pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    expected = ref_logits(ref, prompt + generated)[len(prompt) - 1:-1]  # one per greedy step
    driver = RoundDriver(LocalRunner(stage_of(model_dir)))
    feeds = [prompt] + [[token] for token in generated[:-1]]
    decided = 0
    for step, (feed, want) in enumerate(zip(feeds, expected, strict=True)):
        got = driver.round({0: feed})[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"step {step}")
        top_two = np.sort(want)[-2:]
        if top_two[1] - top_two[0] > 2 * ATOL:
            assert int(np.argmax(got)) == int(np.argmax(want)), f"step {step}"
            decided += 1
    assert decided > 48, "nearly every step should have a clear winner"
    assert len(set(generated)) > 3, "a degenerate model would make this test meaningless"


def test_a_round_mixes_prompt_chunks_and_decode_rows_at_unrelated_positions(make_model):
    model_dir = hybrid(make_model)
    ref = reference(model_dir)
    prompts = batch(3)
    expected = [ref_logits(ref, ids) for ids in prompts]
    driver = RoundDriver(LocalRunner(stage_of(model_dir)))
    driver.round({0: prompts[0][:60]})
    driver.round({1: prompts[1][:1]})
    # Slot 0 decodes at 60, slot 1 runs a chunk from 1, slot 2 opens with a chunk, slot 3
    # opens with a single row: one round, both forms of the delta rule.
    got = driver.round({0: prompts[0][60:61], 1: prompts[1][1:100], 2: prompts[2][:7],
                        3: prompts[0][:1]})
    for slot, want in ((0, expected[0][60]), (1, expected[1][99]), (2, expected[2][6]),
                       (3, expected[0][0])):
        np.testing.assert_allclose(got[slot], want, atol=ATOL, rtol=0, err_msg=f"slot {slot}")


@pytest.mark.parametrize("first_prompt", [1, 40], ids=["one-row", "chunk"])
def test_a_reused_slot_starts_clean(make_model, first_prompt):
    """A new stream on a slot a finished stream left gives exactly a fresh stage's bits."""
    model_dir = hybrid(make_model)
    old, new = batch(4)[1], batch(5)[0][:first_prompt]
    fresh = RoundDriver(LocalRunner(stage_of(model_dir))).greedy({2: new}, 8)
    reused = RoundDriver(LocalRunner(stage_of(model_dir)))
    reused.greedy({2: old}, 8)
    reused.close([2])
    assert reused.greedy({2: new}, 8) == fresh


def test_rollback_is_refused_by_name_and_changes_nothing(make_model):
    stage = stage_of(hybrid(make_model))
    ids = batch(6)[0][:5]
    stage.forward(RoundPlan(1, (StreamEntry(0, Op.OPEN, 0, 5, 0, 0, 0),)), None, ids)
    before = stage.slots.snapshot()
    keep = RoundPlan(2, (StreamEntry(0, Op.CONTINUE, 3, 1, 3, 0, 0),))  # accepts 3 of 5
    with pytest.raises(BadEntry, match="recurrent .*cannot be trimmed"):
        stage.forward(keep, None, ids[:1])
    assert stage.slots.snapshot() == before


def test_a_range_reads_only_its_own_tensors(make_model, monkeypatch):
    """A stage of the conditional layout never reads the vision tower, MTP, or other layers."""
    from engine.checkpoint.reader import Checkpoint

    model_dir = hybrid(make_model, multimodal=True)
    read: list[str] = []
    real = Checkpoint.load_tensors

    def spy(self, names, *args, **kwargs):
        read.extend(names)
        return real(self, names, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "load_tensors", spy)
    stage = stage_of(model_dir, layers=(1, 3))
    assert read and all(n.startswith(("model.language_model.layers.1.",
                                      "model.language_model.layers.2.")) for n in read)
    assert {n.split(".")[3] for n in read} == {"1", "2"}
    # Layer 1 is attention, layer 2 DeltaNet: one KV layer and one recurrent state a slot.
    assert stage.model.cache.kv.k.shape[0] == 1
    assert stage.model.cache.recurrent.delta.shape[:2] == (1, 4)
    assert stage.recurrent_states() == 4


def test_bfloat16_follows_transformers_in_bfloat16(make_model):
    """bfloat16 weights and rows, the recurrent matrix kept in float32 as transformers keeps
    it: logits within a few bfloat16 steps, the same next token."""
    model_dir = hybrid(make_model, dtype="bfloat16")
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = batch(7)[1][:120]
    with torch.no_grad():
        expected = ref.eval()(torch.tensor([ids])).logits[0].float().numpy()[59:]
    driver = RoundDriver(LocalRunner(stage_of(model_dir)))
    got = np.stack([driver.round({0: ids[:60]})[0]] +
                   [driver.round({0: [t]})[0] for t in ids[60:]])  # [61, vocab]
    np.testing.assert_allclose(got, expected, atol=0.05, rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.95
