"""`fleet-front-door`: the front door as a process of its own, so serving outlives the
supervisor (a crash, a restart, an upgrade).

    fleet-front-door --credentials DIR --listen HOST:PORT [--supervisor URL]
                     [--routes-file FILE] [--poll-s S]

DIR is the front door's certificate (role `front-door`), which the supervisor makes at its
start under its state directory (`STATE_DIR/pki/front-door`, with the `supervisor_url` it
listens on): on the supervisor's machine, point `--credentials` there; elsewhere, copy that
directory (0700, its key 0600). It serves the same front door as `fleet-supervisor
--front-door` (supervisor/front_door.py) from the routes it polls from the supervisor
(supervisor/route_sync.py), kept in FILE (default DIR/routes.json, 0600). Run the
supervisor with `--no-front-door`. SIGTERM or Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import structlog

from agent.pki import MissingCredentials, NodeCredentials, PkiError
from agent.tls import client_context
from engine.api.repeated_errors import RepeatedLog
from engine.api.repeated_errors import install as install_repeated_errors
from engine.signals import run_until_signalled
from supervisor.front_door import FrontDoorConfig, open_front_door
from supervisor.relays import Relays
from supervisor.route_sync import POLL_S, RouteSync
from supervisor.settings import SettingsError, split_address

log = structlog.get_logger()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fleet-front-door", description=__doc__.split("\n")[0])
    p.add_argument("--credentials", type=Path, required=True,
                   help="the front door's certificate: STATE_DIR/pki/front-door, or a copy")
    p.add_argument("--listen", default="127.0.0.1:8000", help="the OpenAI endpoint")
    p.add_argument("--supervisor", help="the supervisor's URL (default: DIR/supervisor_url)")
    p.add_argument("--routes-file", type=Path, help="the last routes (default DIR/routes.json)")
    p.add_argument("--poll-s", type=float, default=POLL_S,
                   help="how often the routes are asked of the supervisor")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, url: str, stop: asyncio.Event) -> None:
    host, port = split_address(args.listen, "listen")
    creds = NodeCredentials(args.credentials)
    relays = Relays()
    sync = RouteSync(url, client_context(creds), args.routes_file or creds.directory /
                     "routes.json", relays, poll_s=args.poll_s)
    sync.load()
    install_repeated_errors(asyncio.get_running_loop(), RepeatedLog())
    config = FrontDoorConfig(sync.route, sync.models, sync.api_keys, relays=relays)
    runner = await open_front_door(config, host, port)
    polling = asyncio.get_running_loop().create_task(sync.run())
    log.info("front door open", url=f"http://{args.listen}/v1", supervisor=url)
    try:
        await stop.wait()
        log.info("front door stopping")
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    configure_logging(args.log_level, node="front-door")
    url = args.supervisor
    try:
        NodeCredentials(args.credentials).check()
        split_address(args.listen, "listen")
        if url is None:
            url = (args.credentials / "supervisor_url").read_text().strip()
    except (MissingCredentials, PkiError, SettingsError, OSError) as exc:
        print(f"fleet-front-door: {exc}", file=sys.stderr)
        return 2
    if args.poll_s <= 0:
        print(f"fleet-front-door: --poll-s {args.poll_s}: must be positive", file=sys.stderr)
        return 2

    try:
        run_until_signalled(lambda stop: serve(args, url, stop))
    except OSError as exc:
        print(f"fleet-front-door: cannot listen: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
