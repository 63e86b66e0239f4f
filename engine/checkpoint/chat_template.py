"""Where a checkpoint keeps its chat template, and the Jinja environment it renders in, as
transformers reads and renders them.

Checkpoints saved by transformers 4.43 and later keep the default template in
`chat_template.jinja` beside the tokenizer (other named templates go to
`additional_chat_templates/`); older ones keep it in `tokenizer_config.json` under
`chat_template`, as a string or as a list of `{"name": ..., "template": ...}` records. Where
both exist the file wins, as it does in transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE_NAME = "default"


class ChatTemplateFileError(ValueError):
    """A checkpoint's chat template is present but cannot be used; the message names the file."""


def read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The checkpoint's default chat template source, or None when it has none (or only
    named templates, none of them "default")."""
    template_file = model_dir / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template
                 if isinstance(entry, dict)}
        # Without a default, transformers refuses to choose for the caller; so do we.
        template = named.get(DEFAULT_TEMPLATE_NAME)
    if template is not None and not isinstance(template, str):
        raise ChatTemplateFileError(
            f"{model_dir / 'tokenizer_config.json'}: chat_template is a "
            f"{type(template).__name__}, not a string or a list of named templates")
    return template or None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> Template:
    """The template in a sandbox with the globals, filters and loop controls that real
    templates expect from transformers (`raise_exception`, `strftime_now`, `tojson`, `break`).
    A template's `raise_exception` raises jinja2's TemplateError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
