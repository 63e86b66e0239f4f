"""What any request body may hold before its fields are read: valid JSON, finite numbers,
integers within 64 bits, valid Unicode strings, bounded nesting.

Python's `json` accepts `NaN`, `Infinity`, integers of any size and lone UTF-16 surrogates
("\\ud800"); none of them has a meaning in an OpenAI request, and each used to reach the
sampler or the tokenizer. They are refused here, once, with the path of the value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.api.errors import bad

INT_LOW, INT_HIGH = -(2**63), 2**64 - 1  # what an int64 or a uint64 (a seed) can hold
MAX_DEPTH = 16  # an OpenAI body nests about 5 deep (messages[i].content[j].text)


def load_body(raw: bytes) -> Any:
    """The parsed body, or an ApiError (400) that names what is wrong and where."""
    try:
        body = json.loads(raw)
    except RecursionError as exc:
        raise bad("the request body nests too deeply") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer literal past Python's digit limit, say
        raise bad(f"the request body is not acceptable JSON: {exc}") from exc
    check_values(body)
    return body


def check_values(body: Any) -> None:
    """Raise a 400 naming the first value no request may hold (see the module's first line)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not INT_LOW <= value <= INT_HIGH:
                raise bad(f"'{_name(path)}' is an integer beyond 64 bits", _name(path),
                          "integer_out_of_range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise bad(f"'{_name(path)}' must be a finite number, got {value}", _name(path))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if len(path) >= MAX_DEPTH:
                raise bad(f"'{_name(path)}' nests deeper than {MAX_DEPTH} levels", _name(path))
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, (*path, key))
                    stack.append((item, (*path, key)))
            else:
                stack.extend((item, (*path, i)) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        raise bad(f"'{_name(path)}' holds a lone surrogate (U+{char:04X}) at character "
                  f"{exc.start}: strings must be valid Unicode", _name(path),
                  "invalid_unicode") from None


def _name(path: tuple[str | int, ...]) -> str:
    """messages[0].content, as a client would write it (keys made printable)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = part.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            out += f".{part}" if out else part
    return out or "body"
