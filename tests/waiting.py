"""Test support: wait for a condition to hold, within a bounded time, instead of sleeping.

A test that sleeps "long enough" passes without the state it names when the machine is
fast, and fails or (worse) checks another case when it is slow. These poll the real
condition and fail by name when it does not come.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.02  # between looks at the condition; the deadline is what bounds the wait


def wait_until(condition: Callable[[], T], *, within_s: float, what: str,
               poll_s: float = POLL_S) -> T:
    """The first truthy value of `condition()`; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {within_s} s (last seen: {value!r})")
        time.sleep(poll_s)


async def wait_until_async(condition: Callable[[], Awaitable[T] | T], *, within_s: float,
                           what: str, poll_s: float = POLL_S) -> T:
    """`wait_until` inside an event loop: the loop runs on while it waits; `condition` may
    return a value or an awaitable of one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"{what}: not within {within_s} s (last seen: {value!r})")
        await asyncio.sleep(poll_s)


def rank0_health(http_port: int, host: str = "127.0.0.1") -> dict:
    """Rank 0's /health body (status, slots_in_use, system_fingerprint)."""
    with urllib.request.urlopen(f"http://{host}:{http_port}/health", timeout=5) as response:
        return json.loads(response.read())


def log_has_event(path, event: str) -> bool:
    """Whether a JSON-lines log file holds a record whose "event" is `event`."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            return True
    return False


def stays_true(condition: Callable[[], object], *, for_s: float, what: str,
               poll_s: float = POLL_S) -> None:
    """Check that `condition()` holds at every look for `for_s`: the window IS the test.

    For a claim that nothing happens (a node back changes nothing by itself), no event can
    be waited on; this watches the whole window and fails at the first look that breaks it.
    """
    deadline = time.monotonic() + for_s
    while True:
        value = condition()
        assert value, f"{what}: broken after {for_s - (deadline - time.monotonic()):.2f} s " \
                      f"(seen: {value!r})"
        if time.monotonic() >= deadline:
            return
        time.sleep(poll_s)


def connect_once_listening(address: tuple[str, int], *, within_s: float, what: str,
                           still_worth_it: Callable[[], object] = lambda: True,
                           poll_s: float = 0.05) -> socket.socket:
    """A socket connected to `address` as soon as something listens there.

    A port that is not open yet has no event to wait on, so this dials again every
    `poll_s`. `still_worth_it` is checked before each attempt (an assert that the process
    that should listen is still running, say), so a dead listener fails at once.
    """
    def attempt() -> socket.socket | None:
        still_worth_it()
        try:
            return socket.create_connection(address, timeout=5)
        except ConnectionRefusedError:
            return None

    return wait_until(attempt, within_s=within_s, what=what, poll_s=poll_s)
