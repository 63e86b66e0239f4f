"""`fleet-agent`: run the node agent, join a fleet, show facts, calibrate, install the service."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from agent.config import AgentConfig, ConfigError, default_config_path
from engine.addresses import AddressError, parse_host_port


def _config(args: argparse.Namespace, *, must_exist: bool = True) -> AgentConfig:
    """The config file (the default one only if it is there), with the flags on top."""
    path = Path(args.config) if args.config else default_config_path()
    explicit = bool(args.config) and (must_exist or path.is_file())
    listen_host = listen_port = None
    if getattr(args, "listen", None):
        try:
            listen_host, listen_port = parse_host_port(args.listen, "--listen", min_port=1)
        except AddressError as exc:
            raise ConfigError(str(exc)) from exc
    overrides = dict(node=args.node, state_dir=args.state_dir, listen_host=listen_host,
                     listen_port=listen_port, supervisor_url=getattr(args, "supervisor", None))
    return AgentConfig.load(path if explicit or path.is_file() else None, **overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from agent.app import AgentAlreadyRunning, serve
    from agent.pki import NodeCredentials, PkiError
    from engine.logs import configure_logging

    config = _config(args)
    configure_logging(config.log_level, node=config.node)
    try:
        NodeCredentials(config.pki_dir).check()
    except PkiError as exc:
        print(f"fleet-agent: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    try:
        asyncio.run(main())
    except AgentAlreadyRunning as exc:
        print(f"fleet-agent: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the API's port is taken, the address is not ours…
        print(f"fleet-agent: cannot serve on {config.listen_host}:{config.listen_port}: {exc}",
              file=sys.stderr)
        return 1
    return 0


def read_token(args: argparse.Namespace) -> str:
    """The join token from --token-file, stdin (`--token -`) or, least private, argv."""
    if args.token_file:
        try:
            text = Path(args.token_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--token-file {args.token_file}: cannot read: {exc}") from exc
        where = f"--token-file {args.token_file}"
    elif args.token == "-":
        text, where = sys.stdin.read(), "standard input"
    else:
        text, where = args.token, "--token"
    token = text.strip()
    if not token:
        raise ConfigError(f"{where}: no join token there")
    return token


def cmd_join(args: argparse.Namespace) -> int:
    from agent.join import join
    from agent.pki import NodeCredentials, PkiError, private_dir

    config = _config(args)
    token = read_token(args)
    private_dir(config.state_dir)
    hosts = tuple(args.host or ()) + (config.listen_host,)
    try:
        who = asyncio.run(join(args.url, token, NodeCredentials(config.pki_dir),
                               config.node, hosts=hosts))
    except PkiError as exc:
        print(f"fleet-agent join: {exc}", file=sys.stderr)
        return 2
    print(f"joined as {who.node} (role {who.role}); certificate in {config.pki_dir}")
    return 0


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.1f} GiB"


def cmd_facts(args: argparse.Namespace) -> int:
    from agent.facts import collect_facts

    config = _config(args)
    facts = collect_facts(config.node, config.os_floor_bytes, config.gpu_reserve_bytes)
    if args.json:
        print(json.dumps(facts.to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    h = facts.host
    console = Console()
    console.print(f"[bold]{h.node}[/] ({h.hostname}) {h.os} {h.arch}, "
                  f"{h.cores_physical} cores / {h.cores_logical} threads, RAM {_gib(h.ram_total_bytes)}"
                  f" ({_gib(h.ram_available_bytes)} available), unified memory: {h.unified_memory},"
                  f" engine {facts.engine_version}")
    table = Table("backend", "version", "present", "device", "total", "usable for weights+KV")
    for b in facts.backends:
        if not b.devices:
            table.add_row(b.backend, b.framework_version, "no: " + b.reason, "", "", "")
        for d in b.devices:
            table.add_row(b.backend, b.framework_version, "yes", d.name,
                          _gib(d.memory_total_bytes), _gib(d.memory_usable_bytes))
    console.print(table)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from agent.calibrate import (
        CalibrationCache,
        CalibrationError,
        CalibrationRequest,
        calibrate_cached,
    )
    from agent.facts import engine_version

    config = _config(args)
    if args.model:
        shape = {"model_dir": args.model}
    else:
        from engine.checkpoint.maker import PRESETS, config_json

        if args.preset not in PRESETS:
            print(f"fleet-agent calibrate: --preset {args.preset!r}: one of "
                  f"{', '.join(PRESETS)}", file=sys.stderr)
            return 2
        shape = {"config": config_json(PRESETS[args.preset])}
    contexts = args.contexts or ",".join(str(c) for c in config.calibration_contexts)
    try:
        request = CalibrationRequest.from_dict(dict(
            shape, backend=args.backend, dtype=args.dtype or "",
            contexts=tuple(int(c) for c in contexts.split(",")),
            batch_rows=args.batch_rows or config.calibration_batch_rows,
            chunk_rows=args.chunk_rows or config.calibration_chunk_rows,
            runs=args.runs or config.calibration_runs,
            warmup=config.calibration_warmup if args.warmup is None else args.warmup,
            budget_s=args.budget_s or config.calibration_budget_s))
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("calibrating", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=what)

            result = calibrate_cached(request, CalibrationCache(config.calibration_dir),
                                      engine_version(), progress, force=args.force)
    except CalibrationError as exc:
        print(f"fleet-agent calibrate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    origin = "cached" if result.cached else f"measured in {result.elapsed_s:.1f} s"
    print(f"{result.family} {result.dtype} on {result.backend}, engine {result.engine_version} "
          f"({origin}); key {result.key}")
    typed = len({t.layer_type for t in result.timings}) > 1  # a hybrid: say which type
    for t in result.timings:
        kind = f"{t.layer_type} {t.kind:7}" if typed else f"{t.kind:7}"
        print(f"  {kind} context {t.context:6} rows {t.rows:5}: {t.ms_per_layer:9.3f} "
              f"ms/layer  (median of {t.runs})")
    return 0


def cmd_service(args: argparse.Namespace) -> int:
    from agent.install_service import (
        ServiceError,
        agent_command,
        apply_plan,
        plan_install,
        plan_uninstall,
    )

    config = _config(args, must_exist=False)  # install-service writes it when missing
    config_path = Path(args.config) if args.config else default_config_path()
    system = args.system if args.system is not None else (
        os.geteuid() == 0 and sys.platform != "darwin")
    try:
        if args.command == "install-service":
            plan = plan_install(sys.platform, config, config_path, system=system,
                                uid=os.getuid(), home=Path.home(), command=agent_command())
        else:
            plan = plan_uninstall(sys.platform, system=system, uid=os.getuid(),
                                  home=Path.home())
        apply_plan(plan, dry_run=args.dry_run, say=print)
    except (ServiceError, OSError) as exc:
        print(f"fleet-agent {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fleet-agent", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help=f"agent YAML (default: {default_config_path()})")
    common.add_argument("--node", help="this node's name (default: the host name)")
    common.add_argument("--state-dir", help="certificates, run records, logs, calibrations")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="serve the agent (mutual TLS)")
    run.add_argument("--listen", help="API address host:port (default 127.0.0.1:7700)")
    run.add_argument("--supervisor", help="supervisor URL for heartbeats")
    run.set_defaults(func=cmd_run)

    join = sub.add_parser("join", parents=[common], help="join a fleet with a token")
    join.add_argument("url", help="the supervisor, https://HOST:PORT")
    given = join.add_mutually_exclusive_group(required=True)
    given.add_argument("--token-file", help="a file holding the join token (private: argv is "
                       "readable by every local user)")
    given.add_argument("--token", help="the join token from `fleetctl token`, or - to read it "
                       "from standard input")
    join.add_argument("--listen", help="API address host:port, named in the certificate")
    join.add_argument("--host", action="append", help="another name or IP for the certificate")
    join.set_defaults(func=cmd_join)

    facts = sub.add_parser("facts", parents=[common], help="show this machine's facts")
    facts.add_argument("--json", action="store_true")
    facts.set_defaults(func=cmd_facts)

    cal = sub.add_parser("calibrate", parents=[common], help="time a family shape per layer")
    what = cal.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a checkpoint directory (only config.json is read)")
    what.add_argument("--preset", help="a shape from engine.checkpoint.maker.PRESETS")
    cal.add_argument("--backend", default="torch-cpu")
    cal.add_argument("--dtype", help="override the config's dtype")
    cal.add_argument("--contexts", help="comma-separated, e.g. 512,4096")
    cal.add_argument("--batch-rows", type=int, help="B, the batched decode rows")
    cal.add_argument("--chunk-rows", type=int, help="prompt chunk rows (4096)")
    cal.add_argument("--runs", type=int)
    cal.add_argument("--warmup", type=int)
    cal.add_argument("--budget-s", type=float)
    cal.add_argument("--force", action="store_true", help="measure again even if cached")
    cal.add_argument("--json", action="store_true")
    cal.set_defaults(func=cmd_calibrate)

    for name, text in (("install-service", "install and enable the agent's service"),
                       ("uninstall-service", "disable and remove the agent's service")):
        svc = sub.add_parser(name, parents=[common], help=text)
        svc.add_argument("--dry-run", action="store_true", help="print what it would do")
        scope = svc.add_mutually_exclusive_group()
        scope.add_argument("--system", dest="system", action="store_true", default=None,
                           help="system-wide (root: systemd system unit / LaunchDaemon)")
        scope.add_argument("--user", dest="system", action="store_false",
                           help="for this user (systemd --user / LaunchAgent)")
        svc.set_defaults(func=cmd_service)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"fleet-agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
