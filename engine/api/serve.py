"""Rank 0 serving: the API over a round runner, from the first request to one exit code.

The app (engine.api.server) owns the round loop; this decides when serving ends and how:
a drain that finished or SIGINT exit 0, a failed round, a dead ring or a round loop stuck
past the round deadline exit 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import structlog
from aiohttp import web

from engine.addresses import format_host_port
from engine.api.connections import GuardedSite, HttpLimits, default_max_connections
from engine.api.metrics import CacheStage, EngineMetrics, KvPool
from engine.api.repeated_errors import RepeatedLog
from engine.api.repeated_errors import install as install_repeated_errors
from engine.api.schema import ServedModel
from engine.api.server import (
    CONNECTIONS,
    DRAIN_CLOCK,
    ROUND_LOOP,
    SHUTTING_DOWN,
    ApiConfig,
    DrainClock,
    make_app,
)
from engine.backend_names import drafts
from engine.config import ModelConfig
from engine.env import EngineEnv
from engine.families.description import slot_state_bytes
from engine.lanes.drafting import PromptLookup
from engine.lanes.host import DraftPolicy, LaneHost
from engine.lanes.text import TextCodec
from engine.pipeline.runner import RoundRunner
from engine.row_format import RowFormat

log = structlog.get_logger()

# How long the server waits, once every stream has ended, for handlers to write their
# last bytes (a 503, an SSE error event) before it cancels them; a drain already waited
# for the replies themselves.
HANDLERS_FINISH_S = 5.0
STUCK_CHECK_S = 1.0  # how often rank 0 asks whether its rounds still land


def http_limits(env: EngineEnv) -> HttpLimits:
    """The API's connection and body bounds; a body may hold a whole context of text."""
    return HttpLimits(
        max_connections=env.http_max_connections or default_max_connections(),
        header_s=env.http_header_s, idle_s=env.http_idle_s, body_s=env.http_body_s,
        max_body_bytes=max(1 << 20, 32 * env.context))


def cache_stages(env: EngineEnv, config: ModelConfig) -> tuple[CacheStage, ...]:
    """Every stage's bytes per slot, from the layout and the family's description (the
    followers tell rank 0 their ranges at boot, not their bytes; every stage allocates what
    the description says)."""
    layout = env.layout or (env.layer_range or (0, config.num_hidden_layers),)
    itemsize = RowFormat.of(config).itemsize

    def slot_bytes(layers: tuple[int, int], positions: int) -> int:
        return slot_state_bytes(config, layers, positions, itemsize, drafts(env.drafter))

    return tuple(CacheStage(rank, layers, slot_bytes(layers, env.context),
                            slot_bytes(layers, 1) - slot_bytes(layers, 0), slot_bytes(layers, 0))
                 for rank, layers in enumerate(layout))


async def serve(env: EngineEnv, runner: RoundRunner, codec: TextCodec,
                config: ModelConfig) -> int:
    """Serve the API until a signal, a failed round or a dead ring; returns the exit code.

    SIGTERM drains: new requests get 503, in-flight ones finish for up to FLEET_DRAIN_S,
    then the engine exits 0 (more SIGTERMs change nothing). SIGINT stops at once. Anything
    unexpected (the API's port taken, a bug) still ends the ring and exits 1 with one
    structured line, never a bare traceback.
    """
    try:
        return await _serve(env, runner, codec, config)
    except Exception as exc:  # noqa: BLE001 - the one-line exit reason is the contract
        reason = f"rank 0 failed: {type(exc).__name__}: {exc}"
        try:
            runner.stop(reason, clean=False)
        except Exception as stop_error:  # noqa: BLE001 - exiting anyway; say so
            log.error("could not stop the ring", error=f"{type(stop_error).__name__}: {stop_error}")
        log.error("exiting", code=1, reason=reason)
        return 1


async def _serve(env: EngineEnv, runner: RoundRunner, codec: TextCodec,
                 config: ModelConfig) -> int:
    install_repeated_errors(asyncio.get_running_loop(), RepeatedLog())
    drafts = {"ngram": DraftPolicy(PromptLookup(), env.draft_tokens),
              "mtp": DraftPolicy(None, env.draft_tokens)}.get(env.drafter)
    host = LaneHost(runner, codec, chunk=env.chunk, max_waiting=env.max_waiting,
                    streams=env.parallel, drafts=drafts)
    pool = (KvPool(host.ledger.pool, host.pages_in_use, host.pages_kept)
            if host.ledger is not None else None)
    host.metrics = EngineMetrics(host.slots_in_use, lambda: len(host.waiting),
                                 host.slots_kept, cache_stages(env, config),
                                 env.prompt_cache_slots, pool)
    served = ServedModel(env.model_id, env.context, config.vocab_size, codec)
    limits = http_limits(env)
    ring = getattr(runner, "ring", None)  # a pipeline's: how each hop's rows travel
    app = make_app(host, ApiConfig(served, env.placement, int(time.time()), env.api_secret,
                                   limits=limits, hops=ring.hops.transports if ring else ()),
                   host.metrics)
    # auto_decompress off: bodies are decoded within their bound by engine.api.bodies.
    web_runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               auto_decompress=False,
                               keepalive_timeout=limits.idle_s,
                               shutdown_timeout=HANDLERS_FINISH_S)
    await web_runner.setup()  # starts the round loop
    try:
        await GuardedSite(web_runner, env.http[0], env.http[1], app[CONNECTIONS]).start()
        log.info("ready", http=f"http://{format_host_port(*env.http)}/v1", model=env.model_id)
        code, reason = await _serve_until_the_end(env, runner, host, app[ROUND_LOOP],
                                                  app[DRAIN_CLOCK])
        host.fail(reason if code else SHUTTING_DOWN)
    finally:
        # Stops listening, lets every handler answer its ended stream, stops the round loop.
        await web_runner.cleanup()
    runner.stop(reason, clean=code == 0)
    log.info("exiting", code=code, reason=reason)
    if host.round_thread_busy():
        _exit_past_the_round_thread(code)
    return code


def _exit_past_the_round_thread(code: int) -> None:
    """Exit now, with `code`, although a launch or a landing still runs on the round thread.

    That call may never return (a stuck kernel or link): the interpreter's normal exit
    joins every worker thread and would wait for it forever, holding the process, its
    memory and its port until something SIGKILLs it. Everything that needed saying has
    been said: streams answered, the ring aborted, the exit line logged."""
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


async def _serve_until_the_end(env: EngineEnv, runner: RoundRunner, host: LaneHost,
                               rounds: asyncio.Task, drain_clock: DrainClock
                               ) -> tuple[int, str]:
    """Serve until one of: a drain finished, SIGINT, a failed round, a dead ring, rounds
    owed and none landing for the round deadline (the ring's bound on a round, here rank
    0's own, so a one-stage replica has it too)."""
    loop = asyncio.get_running_loop()
    drain_asked, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        # SIGTERM always means drain: an agent stopping, a supervisor re-placing and a
        # stage asking may all ask for the same drain. SIGINT (Ctrl-C) stops at once.
        if sig == signal.SIGTERM:
            log.info("draining", deadline_s=env.drain_s, already=drain_asked.is_set())
            drain_asked.set()
        else:
            stop_now.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    runner.start(loop, on_drain=lambda: loop.call_soon_threadsafe(drain_asked.set))

    async def drained() -> str:
        await drain_asked.wait()
        drain_clock.start(env.drain_s)  # /health says draining, and for how long at most
        return "drained" if await host.drain(env.drain_s) else "drain deadline passed"

    async def stopped() -> str:
        await stop_now.wait()
        return "stopped"

    async def failed() -> str:
        await asyncio.shield(rounds)  # the app's loop: it ends only when a round failed
        return host.failure or "the round loop ended"

    async def stuck() -> str:
        # /health answers from the event loop whatever the round thread does, and in a ring
        # the keep-alives come from threads of their own: neither tells a stuck round.
        while (owed_s := host.rounds_owed_s()) < env.round_deadline_s:
            await asyncio.sleep(min(STUCK_CHECK_S, env.round_deadline_s / 4))
        return (f"no round has landed for {owed_s:.1f} s while rounds were owed (round "
                f"{host.round_no}, {host.slots_in_use()} slots in use, {len(host.waiting)} "
                f"waiting): the round loop is stuck (FLEET_ROUND_DEADLINE_S is "
                f"{env.round_deadline_s:g})")

    clean = {asyncio.create_task(drained()), asyncio.create_task(stopped())}
    unclean = {asyncio.create_task(failed()), asyncio.create_task(runner.ring_failed()),
               asyncio.create_task(stuck())}
    done, pending = await asyncio.wait(clean | unclean, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    first = done.pop()
    code = 0 if first in clean else 1
    if first.exception() is not None:  # a bug in a watcher: still one reason, still exit 1
        error = first.exception()
        return 1, f"{type(error).__name__}: {error}"
    return code, first.result()
