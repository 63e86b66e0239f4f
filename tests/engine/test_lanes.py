"""Sampling and text: seeded draws repeat, top-k / top-p cut, stop strings hold text back."""

from __future__ import annotations

import numpy as np
import pytest

from engine.lanes.sampler import Sampler, SamplingParams
from engine.lanes.text import TextCodec, TextStream


def test_greedy_takes_the_argmax_with_its_logprob():
    logits = np.array([0.1, 3.0, -1.0, 2.5], dtype=np.float32)
    choice = Sampler(SamplingParams(temperature=0)).choose(logits, top_logprobs=2)
    assert choice.token_id == 1
    assert [t for t, _ in choice.top] == [1, 3]
    assert choice.logprob == pytest.approx(np.log(np.exp(3.0) / np.exp(logits).sum()))


def test_a_seed_repeats_and_top_k_top_p_cut():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [Sampler(params).choose(logits).token_id for _ in range(3)]
    assert len(set(draws)) == 1
    top3 = set(np.argsort(-logits)[:3].tolist())
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=1))
    assert {sampler.choose(logits).token_id for _ in range(200)} <= top3
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))
    assert {nucleus.choose(logits).token_id for _ in range(50)} == {int(np.argmax(logits))}


def test_stop_strings_split_across_tokens_are_held_back(make_model):
    codec = TextCodec(make_model("qwen3"))
    ids = codec.encode("the cat sat on the mat. END here")
    stream = TextStream(codec, ("END",), [])
    out = "".join(stream.push(t) for t in ids if not stream.stopped)
    assert stream.stopped and out == "the cat sat on the mat. "
    assert stream.flush() == ""


def test_text_without_a_stop_comes_out_whole(make_model):
    codec = TextCodec(make_model("qwen3"))
    text = "héllo wörld — ünïcode ✓ 北京"
    stream = TextStream(codec, ("zzz-never",), [])
    out = "".join(stream.push(t) for t in codec.encode(text)) + stream.flush()
    assert out == text


def test_the_chat_template_renders_with_a_generation_prompt(make_model):
    codec = TextCodec(make_model("qwen3"))
    text = codec.render_chat([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


def test_plain_text_gets_the_tokenizers_own_special_tokens_as_transformers_does(
        make_model, tmp_path):
    import shutil

    import transformers
    from tokenizers import Tokenizer, processors

    model = tmp_path / "bos"
    shutil.copytree(make_model("llama"), model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tokenizer.save(str(model / "tokenizer.json"))
    text = "a prompt for a model with a BOS"
    codec = TextCodec(model)
    assert codec.encode(text, add_special_tokens=True)[0] == 0
    assert codec.encode(text)[0] != 0  # a rendered chat template carries its own
    reference = transformers.AutoTokenizer.from_pretrained(model)
    assert codec.encode(text, add_special_tokens=True) == reference(text).input_ids


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-9, 9.99e-6, 1e-5, 1e-3])
def test_every_accepted_temperature_draws_without_nan(temperature):
    logits = np.random.default_rng(1).normal(scale=30, size=300).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=0.9, top_k=50, seed=0))
    choices = {sampler.choose(logits).token_id for _ in range(20)}
    assert choices == {int(np.argmax(logits))}  # this cold, the draw is the argmax


def test_extreme_logits_sample_without_nan():
    logits = np.full(300, -3e38, dtype=np.float32)
    logits[7] = 3e38
    for temperature in (2.0, 1e-5, 0.5):
        assert Sampler(SamplingParams(temperature=temperature, seed=1)).choose(logits).token_id == 7


def test_non_finite_logits_are_refused_by_name():
    from engine.lanes.sampler import SamplingError

    logits = np.zeros(10, dtype=np.float32)
    logits[3] = np.nan
    with pytest.raises(SamplingError, match="1 non-finite logits"):
        Sampler(SamplingParams(temperature=0.7)).choose(logits)


def test_logit_bias_moves_the_draw_but_not_the_reported_logprob():
    logits = np.array([5.0, 1.0, 0.0, -1.0], dtype=np.float32)
    biased = Sampler(SamplingParams(temperature=0, logit_bias=((2, 100.0),))).choose(logits)
    assert biased.token_id == 2
    assert biased.logprob == pytest.approx(float(np.log(np.exp(0) / np.exp(logits).sum())))
    banned = Sampler(SamplingParams(temperature=1.0, seed=4, logit_bias=((0, -100.0),)))
    assert 0 not in {banned.choose(logits).token_id for _ in range(200)}
