"""Request checks without a server: the JSON walk and the rate-limited error log."""

from __future__ import annotations

import pytest

from engine.api.errors import ApiError
from engine.api.json_values import check_values, load_body
from engine.api.repeated_errors import RepeatedLog


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"a": NaN}', "a"),
    (b'{"a": [1, -Infinity]}', "a[1]"),
    (b'{"a": {"b": 18446744073709551616}}', "a.b"),
    (b'{"a": -9223372036854775809}', "a"),
    (b'{"m": [{"c": "\\udc80"}]}', "m[0].c"),
    (b'{"\\ud83d": 1}', "\\ud83d"),
    (b'{"a": ' + b"[" * 20 + b"]" * 20 + b"}", "a" + "[0]" * 15),
])
def test_values_no_request_may_hold_are_named(raw, param):
    with pytest.raises(ApiError) as raised:
        load_body(raw)
    assert raised.value.status == 400 and raised.value.param == param


def test_what_every_request_may_hold_passes():
    check_values({"seed": 2**64 - 1, "low": -(2**63), "t": 1e-310, "s": "héllo 北京 😀",
                  "parts": [{"type": "text", "text": ""}], "none": None, "flag": True})
    with pytest.raises(ApiError, match="not valid JSON"):
        load_body(b"\xff\xfe")
    with pytest.raises(ApiError, match="not acceptable JSON"):
        load_body(b"9" * 5000)


def test_a_repeated_reason_is_logged_once_per_interval_with_the_count():
    now = [0.0]
    lines = []
    repeated = RepeatedLog(interval_s=10, clock=lambda: now[0],
                           emit=lambda reason, **fields: lines.append((reason, fields)))
    for second in range(25):
        now[0] = float(second)
        for _ in range(100):
            repeated.note("accept failed (OSError)")
        repeated.note("another reason")
    reasons = [reason for reason, _ in lines]
    assert reasons.count("accept failed (OSError)") == 3  # at 0, 10 and 20 s
    assert reasons.count("another reason") == 3
    counts = [f["repeats_left_out"] for r, f in lines if r == "accept failed (OSError)"]
    assert counts == [0, 999, 999]  # 10 s × 100 a second, less the one logged


def test_many_distinct_reasons_stay_bounded():
    lines = []
    repeated = RepeatedLog(interval_s=10, clock=lambda: 0.0,
                           emit=lambda reason, **fields: lines.append(reason))
    for i in range(10_000):
        repeated.note(f"reason {i}")
    assert len(lines) <= 257 and len(repeated._seen) <= 257
