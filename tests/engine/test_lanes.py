"""Text: stop strings hold text back, chat templates, special tokens (sampling: test_sampling.py)."""

from __future__ import annotations

from engine.lanes.text import TextCodec, TextStream


def test_stop_strings_split_across_tokens_are_held_back(make_model):
    codec = TextCodec(make_model("qwen3"))
    ids = codec.encode("the cat sat on the mat. END here")
    stream = TextStream(codec, ("END",))
    out = "".join(stream.push(t) for t in ids if not stream.stopped)
    assert stream.stopped and out == "the cat sat on the mat. "
    assert stream.flush() == ""


def test_text_without_a_stop_comes_out_whole(make_model):
    codec = TextCodec(make_model("qwen3"))
    text = "héllo wörld — ünïcode ✓ 北京"
    stream = TextStream(codec, ("zzz-never",))
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
