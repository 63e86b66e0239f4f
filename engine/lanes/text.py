"""Text in and out: the checkpoint's tokenizer, its chat template, and stop strings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer

from engine.checkpoint.chat_template import compile_chat_template, read_chat_template


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the checkpoint's chat template."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


class TextCodec:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = read_chat_template(model_dir, config)
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None
        self.stop_token_ids = self._stop_token_ids(model_dir)

    def _stop_token_ids(self, model_dir: Path) -> frozenset[int]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.exists():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.eos_token is not None and (tid := self.tokenizer.token_to_id(self.eos_token)) is not None:
            ids.add(tid)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids; `add_special_tokens` applies tokenizer.json's own post-processor (a
        Llama BOS, say), as transformers does for plain text. A rendered chat template
        already holds its special tokens, so it is encoded without.

        `encode_batch` of one, because it releases the GIL while `encode` holds it: the API
        tokenizes on a worker thread, and a 1 MB prompt must not stall the event loop."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._template is None:
            raise ChatTemplateError("this checkpoint has no chat template (no "
                                    "chat_template.jinja, and no default chat_template in "
                                    "tokenizer_config.json): use /v1/completions")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc


@dataclass
class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may be a stop.

    Text that ends in an incomplete UTF-8 sequence, or in the start of a stop string, is
    held until the next token decides it.
    """

    codec: TextCodec
    stops: tuple[str, ...]
    ids: list[int]
    sent: int = 0  # characters already handed out
    stopped: bool = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.codec.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        if text.endswith("\ufffd"):
            return ""
        hold = max((_overlap(text, stop) for stop in self.stops), default=0)
        return self._take(text[: len(text) - hold])

    def flush(self) -> str:
        """The rest of the text once the stream ends for a reason other than a stop string."""
        return "" if self.stopped else self._take(self.codec.decode(self.ids))

    def _take(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
