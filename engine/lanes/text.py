"""Text in and out: the checkpoint's tokenizer, its chat template, incremental decoding and stop strings."""

from __future__ import annotations

import json
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
        self.byte_tokens = byte_fallback_ids(self.tokenizer)

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


# Tokens the decoder holds unsettled before it hands text out anyway, keeping the last
# CHARACTER_TOKENS (each token is at least a byte; a character is at most four).
MAX_UNSETTLED = 32
CHARACTER_TOKENS = 4


class IncrementalDecoder:
    """Token ids to text one token at a time, at a cost that does not grow with the output.

    The prefix-offset scheme (as vLLM's): decode only a window that starts at the tokens of
    the last text handed out, and hand out what the new tokens add to that context's text
    once it is stable. Decoding the context with them keeps every decoder's rule that looks
    at neighbours (a SentencePiece leading space, bytes that make up one character).

    Stable means: the window's text does not end in U+FFFD (a character whose bytes are
    still arriving) and, for a byte-fallback tokenizer, the last token decoded is not a
    byte token (`<0xE5>`; a skipped special token between bytes does not end their run):
    that decoder turns a whole run of byte tokens into U+FFFDs when the run is not valid
    UTF-8, so a later byte can change text an earlier one made. Joined with
    `flush`, the pieces are exactly the full decode. The window grows only while text
    stays unstable (a run of byte tokens, an invalid sequence), and at most to
    MAX_UNSETTLED tokens: past that the text is handed out, so garbage output still
    streams; a byte-fallback run that long may then show its U+FFFDs differently from a
    full decode (a valid start of the run as its characters).

    `tokenizers`' own DecodeStream does the same windowing, but has no flush for a tail
    that never becomes stable and hands out a byte-fallback run before it is final.
    """

    def __init__(self, tokenizer: Tokenizer, *, byte_tokens: frozenset[int] = frozenset(),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.byte_tokens = byte_tokens  # byte_fallback_ids(tokenizer), read once per tokenizer
        # Tokens the decode drops: they neither end nor extend a run of byte tokens.
        self.skipped = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        ) if byte_tokens and skip_special_tokens else frozenset()
        self.in_byte_run = False
        self.window: list[int] = []  # the context tokens, then the tokens not yet handed out
        self.context = 0  # how many of `window` are context (their text is already out)
        self.context_text = ""  # the window's context decoded on its own

    def push(self, token_id: int) -> str:
        """The text this token settles (often "", then several tokens' text at once)."""
        self.window.append(token_id)
        if token_id not in self.skipped:
            self.in_byte_run = token_id in self.byte_tokens
        if len(self.window) - self.context > MAX_UNSETTLED:
            # Output that never settles (a model emitting invalid bytes): hand out all but
            # the last few tokens, which one character's bytes could still be arriving in,
            # so the stream keeps flowing and the window stays bounded.
            return self._settle(len(self.window) - CHARACTER_TOKENS)
        if self.in_byte_run:
            return ""
        text = self._decode(self.window)
        if len(text) <= len(self.context_text) or text.endswith("\ufffd"):
            return ""
        self.window = self.window[self.context:]
        self.context = len(self.window)
        added, self.context_text = text[len(self.context_text):], self._decode(self.window)
        return added

    def _settle(self, upto: int) -> str:
        """Hand out the text of window[:upto] past the context; those tokens become it."""
        added = self._decode(self.window[:upto])[len(self.context_text):]
        self.window = self.window[self.context:]
        self.context = upto - self.context
        self.context_text = self._decode(self.window[:self.context])
        return added

    def flush(self) -> str:
        """Whatever the window holds that never became stable (the output has ended)."""
        added = self._decode(self.window)[len(self.context_text):]
        self.window, self.context, self.context_text = [], 0, ""
        self.in_byte_run = False
        return added

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of `<0xNN>` tokens when the decoder is byte-fallback, else none."""
    if "ByteFallback" not in json.dumps(json.loads(tokenizer.to_str()).get("decoder")):
        return frozenset()
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    return frozenset(i for t, i in vocab.items()
                     if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))


class TextStream:
    """Turns a stream's token ids, one at a time, into text deltas, holding back what may be a stop.

    Text the incremental decoder has not settled, and text that may be the start of a stop
    string, is held until a later token decides it; only that held tail is searched, so a
    token's cost does not grow with the output either.
    """

    def __init__(self, codec: TextCodec, stops: tuple[str, ...]) -> None:
        self.codec = codec
        self.stops = stops
        self.decoder = IncrementalDecoder(codec.tokenizer, byte_tokens=codec.byte_tokens)
        self.held = ""  # settled text not handed out: it may start a stop string
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.held += self.decoder.push(token_id)
        return self._release()

    def flush(self) -> str:
        """The rest of the text once the stream ends for a reason other than a stop string."""
        if self.stopped:
            return ""
        self.held += self.decoder.flush()
        out = self._release()
        if self.stopped:
            return out
        out, self.held = out + self.held, ""
        return out

    def _release(self) -> str:
        # Text already handed out never ends in a stop's start (that was held), so a stop
        # can only begin inside `held`.
        found = [at for stop in self.stops if (at := self.held.find(stop)) != -1]
        if found:
            self.stopped = True
            out, self.held = self.held[:min(found)], ""
            return out
        hold = max((_overlap(self.held, stop) for stop in self.stops), default=0)
        out, self.held = self.held[:len(self.held) - hold], self.held[len(self.held) - hold:]
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
