"""OpenAI request bodies in, `GenerationRequest`s out, with OpenAI-style errors for bad input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.lanes.host import GenerationRequest
from engine.lanes.sampler import SamplingParams
from engine.lanes.text import ChatTemplateError, TextCodec


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


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
        names = " or ".join(k.__name__ for k in kinds)
        raise bad(f"'{name}' must be {names}, got {type(value).__name__}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def parse_completion(body: Any, model: ServedModel) -> ParsedRequest:
    body = _common_checks(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = model.codec.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = list(prompt)
        outside = [t for t in ids if not 0 <= t < model.vocab_size]
        if outside:
            raise bad(f"token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})",
                      "prompt", "invalid_token_id")
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids (one prompt per request)",
                  "prompt")
    if _get(body, "echo", (bool,), False):
        raise bad("'echo' is not supported", "echo")
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad(f"'logprobs' must be between 0 and 20, got {logprobs}", "logprobs")
    max_tokens = _get(body, "max_tokens", (int,), 16)
    return _finish(body, model, ids, max_tokens, logprobs)


def parse_chat(body: Any, model: ServedModel) -> ParsedRequest:
    body = _common_checks(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported",
                          f"messages[{i}].content")
            message = dict(message, content="".join(p.get("text", "") for p in content))
            messages[i] = message
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
    try:
        ids = model.codec.encode(model.codec.render_chat(messages))
    except ChatTemplateError as exc:
        raise bad(str(exc), "messages") from exc
    top = None
    if _get(body, "logprobs", (bool,), False):
        top = _get(body, "top_logprobs", (int,), 0)
        if not 0 <= top <= 20:
            raise bad(f"'top_logprobs' must be between 0 and 20, got {top}", "top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,))
    return _finish(body, model, ids, max_tokens, top)


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
        raise bad("only 'n' = 1 is supported", "n")
    return body


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
    stop = _get(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and 0 <= t < model.vocab_size for t in stop_ids):
        raise bad("'stop_token_ids' must be token ids in the vocabulary", "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=int(_number(body, "top_k", 0, 0, model.vocab_size)),
        seed=_get(body, "seed", (int,)),
    )
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    generation = GenerationRequest(
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        stop_token_ids=frozenset(stop_ids) | (frozenset() if ignore_eos
                                              else model.codec.stop_token_ids),
        top_logprobs=top_logprobs,
    )
    return ParsedRequest(generation, stream, bool(options.get("include_usage")),
                         top_logprobs is not None)
