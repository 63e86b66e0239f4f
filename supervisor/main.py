"""`fleet-supervisor`: run the supervisor (the mutual-TLS API, the loop, the front door).

    fleet-supervisor --state-dir DIR [--listen HOST:PORT] [--front-door HOST:PORT | --no-front-door]

`fleetctl init --state-dir DIR --address HOST:PORT` must have made the fleet CA first.
One supervisor per state directory: a second one on the same DIR exits at once (code 2)
naming the pid that holds it (`DIR/supervisor.lock`).
SIGTERM or Ctrl-C stops it; the replicas keep serving (their agents own the engines) and a
supervisor started again on the same state directory re-adopts them. With
`--no-front-door`, `fleet-front-door` serves clients as a process of its own, which keeps
serving while this one is down (docs/supervisor.md).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import sys
from pathlib import Path

import structlog
from aiohttp import web

from agent.pki import MissingCredentials, PkiError
from engine.api.repeated_errors import RepeatedLog
from engine.api.repeated_errors import install as install_repeated_errors
from engine.signals import run_until_signalled
from supervisor.app import make_app
from supervisor.issuing import supervisor_credentials
from supervisor.lifecycle import Policy
from supervisor.membership import MembershipTimes
from supervisor.settings import SettingsError, SupervisorSettings, split_address
from supervisor.state_lock import StateDirLock, StateDirLocked

log = structlog.get_logger()


def server_context(settings: SupervisorSettings) -> ssl.SSLContext:
    """Serve with the supervisor's certificate; verify a client certificate when one is
    presented (a joining node has none: only the open PKI routes answer it)."""
    creds = supervisor_credentials(settings.state_dir)
    creds.check()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(creds.ca_path))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


async def serve(settings: SupervisorSettings, stop: asyncio.Event) -> None:
    host, port = split_address(settings.listen, "listen")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    # Strangers reach the front door and the API: their floods are counted, not each logged.
    install_repeated_errors(asyncio.get_running_loop(), RepeatedLog())
    app = make_app(settings)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    try:
        await runner.setup()
        await web.SockSite(runner, sock, ssl_context=server_context(settings)).start()
        log.info("supervisor serving", url=f"https://{settings.listen}",
                 front_door=settings.front_door_url, state_dir=str(settings.state_dir))
        await stop.wait()
        log.info("supervisor stopping")
    finally:
        await runner.cleanup()
        sock.close()


def parse_args(argv: list[str] | None) -> SupervisorSettings:
    p = argparse.ArgumentParser(prog="fleet-supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--listen", default="127.0.0.1:7400", help="the mutual-TLS API")
    p.add_argument("--front-door", default="127.0.0.1:8000", help="the OpenAI endpoint")
    p.add_argument("--no-front-door", action="store_true",
                   help="serve no front door here: fleet-front-door serves it as its own "
                        "process, from the routes it reads from this supervisor")
    p.add_argument("--api-keys-file", type=Path,
                   help="client API keys for the front door, one a line")
    p.add_argument("--suspect-after-s", type=float, default=15.0)
    p.add_argument("--dead-after-s", type=float, default=45.0)
    p.add_argument("--backoff-first-s", type=float, default=1.0)
    p.add_argument("--backoff-max-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--drain-s", type=float, default=180.0)
    p.add_argument("--calibration-budget-s", type=float, default=30.0,
                   help="ask each node to calibrate each model within this budget "
                        "(0: no calibration or link probes; nominal numbers)")
    p.add_argument("--measurement-max-age-s", type=float, default=7 * 86400.0,
                   help="calibrations and link probes kept in the state are reused until "
                        "this old (or until the node's backend versions change)")
    p.add_argument("--engine-ports", default="29600:29999", help="first:last")
    p.add_argument("--tick-s", type=float, default=0.5)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    from engine.logs import configure_logging

    configure_logging(args.log_level, node="supervisor")
    keys: tuple[str, ...] = ()
    if args.api_keys_file:
        keys = tuple(line.strip() for line in args.api_keys_file.read_text().splitlines()
                     if line.strip() and not line.startswith("#"))
    first, _, last = args.engine_ports.partition(":")
    try:
        return SupervisorSettings(
            state_dir=args.state_dir, listen=args.listen,
            front_door="" if args.no_front_door else args.front_door, api_keys=keys,
            membership=MembershipTimes(args.suspect_after_s, args.dead_after_s),
            policy=Policy(backoff_first_s=args.backoff_first_s,
                          backoff_max_s=args.backoff_max_s,
                          start_timeout_s=args.start_timeout_s, drain_s=args.drain_s),
            tick_s=args.tick_s, calibration_budget_s=args.calibration_budget_s,
            measurement_max_age_s=args.measurement_max_age_s,
            engine_port_first=int(first), engine_port_last=int(last))
    except ValueError as exc:
        p.error(str(exc))
        raise


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except (SettingsError, OSError) as exc:
        print(f"fleet-supervisor: {exc}", file=sys.stderr)
        return 2
    try:  # before anything reads or writes the state: a second supervisor touches nothing
        lock = StateDirLock(settings.state_dir).acquire()
    except StateDirLocked as exc:
        print(f"fleet-supervisor: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print(f"fleet-supervisor: no state directory {settings.state_dir}: run `fleetctl init "
              f"--state-dir {settings.state_dir} --address HOST:PORT` first", file=sys.stderr)
        return 2

    try:
        run_until_signalled(lambda stop: serve(settings, stop))
    except (MissingCredentials, PkiError) as exc:
        print(f"fleet-supervisor: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fleet-supervisor: cannot listen: {exc}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
