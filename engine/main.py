"""`fleet-engine`: run one stage from the environment contract; rank 0 also serves the API."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import structlog
from aiohttp import web

from engine.api.connections import GuardedSite, HttpLimits, default_max_connections
from engine.api.metrics import EngineMetrics
from engine.api.repeated_errors import RepeatedLog
from engine.api.repeated_errors import install as install_repeated_errors
from engine.api.schema import ServedModel
from engine.api.server import CONNECTIONS, ApiConfig, make_app
from engine.backends.base import BackendError, load_stage
from engine.checkpoint.reader import CheckpointError, open_checkpoint
from engine.config import ConfigError, ModelConfig
from engine.env import EngineEnv, EnvError
from engine.lanes.host import LaneHost, RoundRunner
from engine.lanes.text import TextCodec
from engine.logs import configure_logging
from engine.pipeline.runner import LocalRunner

log = structlog.get_logger()


def load_progress(what: str):
    """Log each layer as it loads, so a slow load on a big checkpoint shows where it is."""
    started = time.monotonic()

    def report(done: int, total: int, unit: str) -> None:
        log.info("loading", what=what, done=done, total=total, unit=unit,
                 elapsed_s=round(time.monotonic() - started, 2))

    return report


async def serve_rank0(env: EngineEnv, runner: RoundRunner, codec: TextCodec,
                      config: ModelConfig) -> int:
    """Serve the API until a signal, a failed round or a dead ring; returns the exit code.

    SIGTERM drains: new requests get 503, in-flight ones finish for up to FLEET_DRAIN_S,
    then the engine exits 0 (more SIGTERMs change nothing). SIGINT stops at once. Anything
    unexpected (the API's port taken, a bug) still ends the ring and exits 1 with one
    structured line, never a bare traceback.
    """
    try:
        return await _serve_rank0(env, runner, codec, config)
    except Exception as exc:  # noqa: BLE001 - the one-line exit reason is the contract
        reason = f"rank 0 failed: {type(exc).__name__}: {exc}"
        try:
            runner.stop(reason, clean=False)
        except Exception as stop_error:  # noqa: BLE001 - exiting anyway; say so
            log.error("could not stop the ring", error=f"{type(stop_error).__name__}: {stop_error}")
        log.error("exiting", code=1, reason=reason)
        return 1


def http_limits(env: EngineEnv) -> HttpLimits:
    """The API's connection and body bounds; a body may hold a whole context of text."""
    return HttpLimits(
        max_connections=env.http_max_connections or default_max_connections(),
        header_s=env.http_header_s, idle_s=env.http_idle_s, body_s=env.http_body_s,
        max_body_bytes=max(1 << 20, 32 * env.context))


async def _serve_rank0(env: EngineEnv, runner: RoundRunner, codec: TextCodec,
                       config: ModelConfig) -> int:
    install_repeated_errors(asyncio.get_running_loop(), RepeatedLog())
    host = LaneHost(runner, codec, chunk=env.chunk, max_waiting=env.max_waiting)
    host.metrics = EngineMetrics(host.slots_in_use, lambda: len(host.waiting))
    served = ServedModel(env.model_id, env.context, config.vocab_size, codec)
    limits = http_limits(env)
    api_config = ApiConfig(served, env.placement, int(time.time()), env.api_secret,
                           limits=limits)
    app = make_app(host, api_config, host.metrics)
    web_runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=limits.idle_s)
    await web_runner.setup()
    try:
        await GuardedSite(web_runner, env.http[0], env.http[1], app[CONNECTIONS]).start()
    except BaseException:
        await web_runner.cleanup()
        host.close()
        raise
    log.info("ready", http=f"http://{env.http[0]}:{env.http[1]}/v1", model=env.model_id)

    code, reason = await _serve_until_the_end(env, runner, host)
    host.fail(reason if code else "the engine is shutting down")
    await asyncio.sleep(0.1)  # let handlers write their last bytes (503s, SSE error events)
    await web_runner.cleanup()
    host.close()
    runner.stop(reason, clean=code == 0)
    log.info("exiting", code=code, reason=reason)
    return code


async def _serve_until_the_end(env: EngineEnv, runner: RoundRunner,
                               host: LaneHost) -> tuple[int, str]:
    """Run rounds until one of: a drain finished, SIGINT, a failed round, a dead ring."""
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
        return "drained" if await host.drain(env.drain_s) else "drain deadline passed"

    async def stopped() -> str:
        await stop_now.wait()
        return "stopped"

    async def failed() -> str:
        await host.run()  # returns only when a round failed
        return host.failure or "the round loop ended"

    clean = {asyncio.create_task(drained()), asyncio.create_task(stopped())}
    unclean = {asyncio.create_task(failed()), asyncio.create_task(runner.ring_failed())}
    done, pending = await asyncio.wait(clean | unclean, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    first = done.pop()
    code = 0 if first in clean else 1
    if first.exception() is not None:  # a bug in a watcher: still one reason, still exit 1
        error = first.exception()
        return 1, f"{type(error).__name__}: {error}"
    return code, first.result()


def main() -> int:
    try:
        env = EngineEnv.from_environ()
    except EnvError as exc:
        print(f"fleet-engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(env.log_level, rank=env.rank, replica=env.placement)
    if env.cpu_threads and env.backend.startswith("torch-"):
        import torch  # only a torch stage pays for importing it

        # Stages that share a machine's cores spin against each other in OpenMP otherwise.
        torch.set_num_threads(env.cpu_threads)
    try:
        checkpoint = open_checkpoint(env.model_dir)
        config = ModelConfig.from_dict(checkpoint.config)
        spec = env.stage_spec(config.num_hidden_layers)
        stage = load_stage(spec, progress=load_progress(str(env.model_dir)))
        codec = TextCodec(env.model_dir) if env.rank == 0 else None
    except (CheckpointError, ConfigError, BackendError) as exc:
        log.error("exiting", code=2, reason=f"cannot start: {exc}")
        return 2
    except Exception as exc:  # noqa: BLE001 - a tokenizer that will not parse, say: one line
        log.error("exiting", code=1, reason=f"cannot start: {type(exc).__name__}: {exc}")
        return 1
    log.info("loaded", layers=f"{spec.layer_range[0]}:{spec.layer_range[1]}",
             backend=env.backend, kv_bytes=stage.state_nbytes)
    if env.world_size == 1:
        return asyncio.run(serve_rank0(env, LocalRunner(stage), codec, config))
    from engine.pipeline.stage_main import run_pipeline_stage

    try:
        return run_pipeline_stage(env, stage, codec, config, serve_rank0)
    except Exception as exc:  # noqa: BLE001 - whatever escaped still exits with one line
        log.error("exiting", code=1, reason=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
