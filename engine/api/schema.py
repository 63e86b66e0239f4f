"""OpenAI request bodies in, `GenerationRequest`s out, with OpenAI-style errors for bad input.

Every field that changes what is generated is either honoured or refused by name: a
parameter this engine does not implement (`presence_penalty`, `tools`, ...) gets a 400
rather than being silently ignored. Values every body must obey (finite numbers, 64-bit
integers, valid Unicode) are checked before this, in `json_values`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.api.errors import ApiError, bad
from engine.lanes.host import GenerationRequest
from engine.lanes.text import ChatTemplateError, TextCodec
from engine.sampling import SamplingParams

__all__ = ["ApiError", "ParsedRequest", "ServedModel", "bad", "parse_chat", "parse_completion"]

MAX_TOP_LOGPROBS = 20
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_LOGIT_BIAS, LOGIT_BIAS_RANGE = 1024, 100.0
SEED_HIGH = 2**64 - 1

# Parameters clients send that this engine does not implement, with the one value that
# means "off"; any other value is refused by name.
NOT_IMPLEMENTED: dict[str, object] = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0,
    "min_tokens": 0, "best_of": 1, "suffix": None, "tools": None, "functions": None,
    "tool_choice": "none", "function_call": "none", "use_beam_search": False,
    "prompt_logprobs": None,
}


@dataclass(frozen=True)
class ServedModel:
    """What the request checks need to know about the model being served."""

    model_id: str
    context: int
    vocab_size: int
    codec: TextCodec


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    logprobs: bool


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python; never accept true/false where a number is asked for.
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join("number" if k is float else k.__name__ for k in kinds
                            if not (k is int and float in kinds))
        raise bad(f"'{name}' must be {names}, got {type(value).__name__}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _integer(body: dict[str, Any], name: str, default: int | None, low: int,
             high: int) -> int | None:
    value = _get(body, name, (int,), default)
    if value is not None and not low <= value <= high:
        raise bad(f"'{name}' must be an integer from {low} to {high}, got {value}", name)
    return value


def _token_ids(values: list[Any], model: ServedModel, param: str) -> list[int]:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"'{param}' must hold token ids (integers), got {value!r:.40}", param)
        if not 0 <= value < model.vocab_size:
            raise bad(f"token id {value} in '{param}' is outside the vocabulary "
                      f"[0, {model.vocab_size})", param, "invalid_token_id")
    return list(values)


def parse_completion(body: Any, model: ServedModel) -> ParsedRequest:
    body = _common_checks(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = model.codec.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(not isinstance(t, (str, list)) for t in prompt):
        ids = _token_ids(prompt, model, "prompt")
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids (one prompt per request)",
                  "prompt")
    if _get(body, "echo", (bool,), False):
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    max_tokens = _get(body, "max_tokens", (int,), 16)
    return _finish(body, model, ids, max_tokens, logprobs)


def parse_chat(body: Any, model: ServedModel) -> ParsedRequest:
    body = _common_checks(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    rendered = [_message(message, i) for i, message in enumerate(messages)]
    try:
        ids = model.codec.encode(model.codec.render_chat(rendered))
    except ChatTemplateError as exc:
        raise bad(str(exc), "messages") from exc
    top = None
    if _get(body, "logprobs", (bool,), False):
        top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    return _finish(body, model, ids, max_tokens, top)


def _message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.text must be a string", f"{where}.text")
            texts.append(part["text"])
        return dict(message, content="".join(texts))
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts",
                  f"messages[{i}].content")
    return message


def _common_checks(body: Any, model: ServedModel) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise bad("'model' is required", "model")
    if name != model.model_id:
        raise bad(f"model {name!r} is not served here (this endpoint serves {model.model_id!r})",
                  "model", "model_not_found")
    if _get(body, "n", (int,), 1) != 1:
        raise bad("only 'n' = 1 is supported", "n", "unsupported_parameter")
    for param, off in NOT_IMPLEMENTED.items():
        value = body.get(param)
        if value is not None and (value != off or isinstance(value, bool) != isinstance(off, bool)):
            raise bad(f"'{param}' is not supported by this engine (leave it out or "
                      f"{'null' if off is None else repr(off)})", param, "unsupported_parameter")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported",
                  "response_format", "unsupported_parameter")
    return body


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = _get(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if (len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise bad(f"'stop' must be a string or a list of up to {MAX_STOPS} of them, each of "
                  f"1 to {MAX_STOP_CHARS} characters", "stop")
    return stop


def _logit_bias(body: dict[str, Any], model: ServedModel) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: bias in [-100, 100] is added to that token's logit."""
    bias = _get(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}",
                  "logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12) or int(key) >= model.vocab_size:
            raise bad(f"'logit_bias' key {key!r:.40} is not a token id in the vocabulary "
                      f"[0, {model.vocab_size})", "logit_bias", "invalid_token_id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"'logit_bias' value for {key} must be a number, got "
                      f"{type(value).__name__}", "logit_bias")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise bad(f"'logit_bias' value for {key} must be between -100 and 100, got {value}",
                      "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _finish(body: dict[str, Any], model: ServedModel, ids: list[int], max_tokens: int | None,
            top_logprobs: int | None) -> ParsedRequest:
    if not ids:
        raise bad("the prompt is empty", "prompt")
    room = model.context - len(ids)
    if room < 1:
        raise bad(f"the prompt has {len(ids)} tokens; this model's context is {model.context}",
                  "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise bad(f"'max_tokens' {max_tokens} plus the prompt's {len(ids)} tokens exceed the "
                  f"context of {model.context}", "max_tokens", "context_length_exceeded")
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > model.vocab_size:  # more ids than the vocabulary holds: repeats
        raise bad(f"'stop_token_ids' holds {len(stop_ids)} ids; at most the vocabulary's "
                  f"{model.vocab_size}", "stop_token_ids")
    stop_ids = _token_ids(stop_ids, model, "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    top_k = _get(body, "top_k", (int,), 0)
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "no limit"
    if not 0 <= top_k <= model.vocab_size:
        raise bad(f"'top_k' must be an integer from 0 (no limit) to the vocabulary size "
                  f"{model.vocab_size}, got {top_k}", "top_k")
    sampling = SamplingParams(
        # Below engine.lanes.sampler.GREEDY_BELOW (1e-5) a temperature is greedy, as 0 is.
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k,
        seed=_integer(body, "seed", None, 0, SEED_HIGH),
        logit_bias=_logit_bias(body, model),
    )
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False)
    generation = GenerationRequest(
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(body),
        stop_token_ids=frozenset(stop_ids) | (frozenset() if ignore_eos
                                              else model.codec.stop_token_ids),
        top_logprobs=top_logprobs,
    )
    return ParsedRequest(generation, stream, include_usage, top_logprobs is not None)
