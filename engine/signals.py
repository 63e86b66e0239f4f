"""Run a service until SIGINT or SIGTERM: the one shape every long-lived process here has
(the agent, the supervisor, the front door): its `serve(stop)` returns once `stop` is set."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """`asyncio.run` of `serve(stop)`, `stop` set by SIGINT or SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    asyncio.run(main())
