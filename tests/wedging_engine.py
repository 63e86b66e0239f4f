"""Test support: `fleet-engine` whose round thread can be wedged from outside (SIGUSR1).

Run as `python -m tests.wedging_engine` with an engine's environment. The one fault it
injects: after SIGUSR1, the next round's launch on rank 0 blocks on the round thread and
never returns, while the event loop, the HTTP server and the ring's keep-alive threads run
on — a wedge that a frozen process (SIGSTOP) does not show. The wait is bounded, so a
test that forgets the process does not leave it forever.
"""

from __future__ import annotations

import signal
import sys
import threading

from engine import main as engine_main
from engine.pipeline.rank0 import PipelineRunner
from engine.pipeline.runner import LocalRunner

WEDGE_LIMIT_S = 600.0  # a wedged launch returns this late, should nothing kill the process
wedge_asked = threading.Event()
never = threading.Event()


def _wedging(launch):
    def wedged_launch(self, *args, **kwargs):
        if wedge_asked.is_set():
            never.wait(WEDGE_LIMIT_S)
        return launch(self, *args, **kwargs)
    return wedged_launch


def main() -> int:
    LocalRunner.launch = _wedging(LocalRunner.launch)
    PipelineRunner.launch = _wedging(PipelineRunner.launch)
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: wedge_asked.set())
    return engine_main.main()


if __name__ == "__main__":
    sys.exit(main())
