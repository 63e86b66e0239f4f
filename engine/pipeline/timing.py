"""Where one round's time goes on a stage, phase by phase, to tell link cost from compute."""

from __future__ import annotations

import time


class RoundClock:
    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases_ms: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Close `phase` now: its time is from the previous mark (or the start)."""
        now = time.perf_counter()
        self.phases_ms[phase] = round((now - self.last) * 1000, 4)
        self.last = now
