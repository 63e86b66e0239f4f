"""Chat templates and end-of-turn tokens read where real checkpoints keep them, rendered as
transformers' apply_chat_template renders them on the same directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.checkpoint.chat_template import CHAT_TEMPLATE_FILE
from engine.lanes.text import ChatTemplateError, TextCodec

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?  "},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? \"quoted\" <b>ü</b>"},
]


def template(marker: str) -> str:
    """A template that says which copy was read and uses what real templates use from
    transformers' environment: loop controls, its tojson, raise_exception, special tokens."""
    return (
        "{{- bos_token + '" + marker + "\\n' }}"
        "{%- if messages[0]['role'] != 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
        "{%- for message in messages %}"
        "{%- if loop.index > 3 and message['role'] == 'assistant' %}{% break %}{% endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{{- '<|im_start|>meta\\n' + (messages[-1] | tojson) + '<|im_end|>\\n' }}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _layout(source: Path, out: Path, *, config_template=None, jinja: str | None = None,
            extra_named: dict[str, str] | None = None) -> Path:
    """A copy of a made checkpoint's tokenizer with the chat template stored one way."""
    out.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(source / name, out / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if config_template is not None:
        config["chat_template"] = config_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if jinja is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(jinja)
    for name, text in (extra_named or {}).items():
        (out / "additional_chat_templates").mkdir(exist_ok=True)
        (out / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return out


def _transformers_render(model_dir: Path, messages=MESSAGES) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


LAYOUTS = {
    # transformers < 4.43: one string in tokenizer_config.json
    "config-string": dict(config_template=template("config-string")),
    # named templates in tokenizer_config.json: the one called "default" is used
    "config-named": dict(config_template=[
        {"name": "tool_use", "template": template("tool-use")},
        {"name": "default", "template": template("config-named")},
    ]),
    # transformers >= 4.43 and 5.x: chat_template.jinja beside the tokenizer
    "jinja-file": dict(jinja=template("jinja-file")),
    # both: the file wins, as in transformers
    "jinja-over-config": dict(config_template=template("config-loses"),
                              jinja=template("jinja-over-config")),
    # transformers 5 with several templates: the default in the file, others in a folder
    "jinja-with-named-folder": dict(jinja=template("jinja-with-named-folder"),
                                    extra_named={"tool_use": template("tool-use")}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_renders_as_transformers_does(make_model, tmp_path, layout):
    model_dir = _layout(make_model("qwen3"), tmp_path / layout, **LAYOUTS[layout])
    ours = TextCodec(model_dir).render_chat(MESSAGES)
    assert ours == _transformers_render(model_dir)
    marker = "jinja-over-config" if layout == "jinja-over-config" else layout
    assert ours.splitlines()[0].endswith(marker)
    assert "\\u00fc" not in ours and "ü" in ours  # transformers' tojson, not Jinja's


def test_a_template_raising_is_a_chat_template_error(make_model, tmp_path):
    model_dir = _layout(make_model("qwen3"), tmp_path / "m", jinja=template("x"))
    with pytest.raises(ChatTemplateError, match="no system turn"):
        TextCodec(model_dir).render_chat(MESSAGES[1:])


def test_named_templates_without_a_default_give_no_template(make_model, tmp_path):
    model_dir = _layout(make_model("qwen3"), tmp_path / "m",
                        config_template=[{"name": "tool_use", "template": template("t")}])
    codec = TextCodec(model_dir)
    assert codec.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        codec.render_chat(MESSAGES)
    with pytest.raises(ValueError):  # transformers will not choose one either
        _transformers_render(model_dir)


def test_no_template_anywhere_names_both_places(make_model, tmp_path):
    model_dir = _layout(make_model("qwen3"), tmp_path / "m")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja.*tokenizer_config.json"):
        TextCodec(model_dir).render_chat(MESSAGES)


@pytest.mark.parametrize("eos", [1, [1, 2], [2, 1, 0]])
def test_generation_config_end_of_turn_tokens_stop_generation(make_model, tmp_path, eos):
    from transformers import GenerationConfig

    model_dir = _layout(make_model("qwen3"), tmp_path / "m", jinja=template("x"))
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(
        json.dumps(dict(generation_config, eos_token_id=eos)))
    stops = TextCodec(model_dir).stop_token_ids
    theirs = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert set(theirs if isinstance(theirs, list) else [theirs]) <= stops
    # the tokenizer's eos (<|im_end|>, id 2) stops too, whatever generation_config says
    assert stops == set(eos if isinstance(eos, list) else [eos]) | {2}
