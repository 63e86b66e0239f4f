"""`fleet-agent`: run the node agent, join a fleet, show facts, calibrate, install the service."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from agent.config import (
    AgentConfig,
    ConfigError,
    default_config_path,
    read_settings,
    write_settings,
)
from engine.addresses import AddressError, parse_host_port
from engine.signals import run_until_signalled


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


# The agent cannot serve until an operator acts (join, a supervisor URL): a restart would
# fail the same way, so service managers are told not to retry on this status (sysexits'
# EX_CONFIG; the systemd unit's RestartPreventExitStatus, launchd's run passes 0 instead).
EXIT_NOT_JOINED = 78


def why_not_ready(config: AgentConfig, config_path: Path | None, *, standalone: bool) -> str:
    """One line saying what the operator must do before this agent can serve; '' if nothing."""
    from agent.pki import NodeCredentials, PkiError

    try:
        NodeCredentials(config.pki_dir).check()
    except PkiError as exc:
        return str(exc)
    if not config.supervisor_url and not standalone:
        where = f"in {config_path}" if config_path else "(no config file)"
        return (f"no supervisor_url {where}: `fleet-agent join https://SUPERVISOR:PORT ...` "
                "records it (or pass --supervisor; --standalone serves without heartbeats)")
    return ""


def cmd_run(args: argparse.Namespace) -> int:
    from agent.app import AgentAlreadyRunning, serve
    from agent.rotating_stream import send_output_to
    from engine.logs import configure_logging

    config = _config(args)
    if args.log_file is not None:
        config = config.with_overrides(log_file=args.log_file)
    config_path = Path(args.config) if args.config else default_config_path()
    reason = why_not_ready(config, config_path if config_path.is_file() else None,
                           standalone=args.standalone)
    if reason:
        print(f"fleet-agent: not ready to serve: {reason}", file=sys.stderr)
        return args.not_joined_exit_code
    if config.log_file:  # from here on, everything this process writes goes there
        send_output_to(Path(config.log_file), config.log_max_bytes, config.log_backups)
    configure_logging(config.log_level, node=config.node)

    try:
        run_until_signalled(lambda stop: serve(config, stop))
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

    config = _config(args, must_exist=False)  # join writes it
    config_path = Path(args.config) if args.config else default_config_path()
    token = read_token(args)
    private_dir(config.state_dir)
    hosts = tuple(args.host or ()) + (config.listen_host,)
    try:
        who = asyncio.run(join(args.url, token, NodeCredentials(config.pki_dir),
                               config.node, hosts=hosts))
    except PkiError as exc:
        print(f"fleet-agent join: {exc}", file=sys.stderr)
        return 2
    # What `run` (and the service) needs to reach this fleet: recorded, not left to flags.
    joined = write_settings(config_path, **recorded_settings(args, config),
                            supervisor_url=args.url.rstrip("/"))
    print(f"joined as {who.node} (role {who.role}); certificate in {config.pki_dir}")
    print(f"recorded in {config_path}: supervisor_url {joined.supervisor_url}, "
          f"listen {joined.listen_host}:{joined.listen_port}, state_dir {joined.state_dir}")
    return 0


def recorded_settings(args: argparse.Namespace, config: AgentConfig) -> dict[str, Any]:
    """The settings a command was given on its command line, as the config file spells them
    (node and state_dir always: a service must find the same certificate join stored)."""
    out: dict[str, Any] = {"node": config.node, "state_dir": str(config.state_dir)}
    if getattr(args, "listen", None):
        out.update(listen_host=config.listen_host, listen_port=config.listen_port)
    if getattr(args, "supervisor", None):
        out["supervisor_url"] = config.supervisor_url
    return out


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
        unit = "ms/layer" if t.kind in ("decode", "prefill") else "ms"  # a head's: the whole
        print(f"  {kind} context {t.context:6} rows {t.rows:5}: {t.ms_per_layer:9.3f} "
              f"{unit}  (median of {t.runs})")
    return 0


def cmd_service(args: argparse.Namespace) -> int:
    from agent.install_service import (
        ServiceError,
        agent_command,
        apply_plan,
        plan_install,
        plan_uninstall,
    )

    config_path = Path(args.config) if args.config else default_config_path()
    system = args.system if args.system is not None else (
        os.geteuid() == 0 and sys.platform != "darwin")
    unit_dir = Path(args.unit_dir) if args.unit_dir else None
    try:
        if args.command == "install-service":
            config = _config(args, must_exist=False)  # install-service writes it when missing
            settings = recorded_settings(args, config)
            raw = _file_settings(config_path) or config.to_dict()  # a new file shows every key
            raw.update(settings)
            config = AgentConfig.from_dict(raw, str(config_path))
            import yaml

            plan = plan_install(sys.platform, config, config_path, system=system,
                                uid=os.getuid(), home=Path.home(), command=agent_command(),
                                config_yaml=yaml.safe_dump(raw, sort_keys=True).encode(),
                                run_as=args.run_as or _daemon_user(sys.platform, system),
                                unit_dir=unit_dir,
                                not_ready=why_not_ready(config, config_path, standalone=False))
        else:
            plan = plan_uninstall(sys.platform, system=system, uid=os.getuid(),
                                  home=Path.home())
        apply_plan(plan, dry_run=args.dry_run, say=print)
    except (ServiceError, OSError) as exc:
        print(f"fleet-agent {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def _file_settings(path: Path) -> dict[str, Any]:
    """The settings the config file at `path` holds ({} when there is none)."""
    return read_settings(path) if path.is_file() else {}


def _daemon_user(platform: str, system: bool) -> str | None:
    """A macOS LaunchDaemon runs as the user who ran sudo, never as root by default."""
    if platform != "darwin" or not system:
        return None
    import pwd

    return os.environ.get("SUDO_USER") or pwd.getpwuid(os.getuid()).pw_name


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fleet-agent", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help=f"agent YAML (default: {default_config_path()})")
    common.add_argument("--node", help="this node's name (default: the host name)")
    common.add_argument("--state-dir", help="certificates, run records, logs, calibrations")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="serve the agent (mutual TLS)")
    run.add_argument("--listen", help="API address host:port (default 127.0.0.1:7700)")
    run.add_argument("--supervisor", help="supervisor URL for heartbeats (join records it)")
    run.add_argument("--standalone", action="store_true",
                     help="serve without a supervisor (no heartbeats): a bench, a test")
    run.add_argument("--log-file", help="write the agent's log to this file, rotated by the "
                     "agent (default: log_file in the config, else standard error)")
    run.add_argument("--not-joined-exit-code", type=int, default=EXIT_NOT_JOINED,
                     help=f"exit status when the node has not joined or has no supervisor URL "
                     f"(default {EXIT_NOT_JOINED}; launchd's job passes 0 so KeepAlive "
                     "leaves it stopped)")
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
        svc.add_argument("--unit-dir", help="write the unit / property list into this folder "
                         "and only print the systemctl / launchctl commands (an image, a test)")
        scope = svc.add_mutually_exclusive_group()
        scope.add_argument("--system", dest="system", action="store_true", default=None,
                           help="system-wide (root: systemd system unit / LaunchDaemon)")
        scope.add_argument("--user", dest="system", action="store_false",
                           help="for this user (systemd --user / LaunchAgent)")
        if name == "install-service":  # what `run` needs, written into the config file
            svc.add_argument("--listen", help="the API's address host:port (join records it)")
            svc.add_argument("--supervisor", help="https://SUPERVISOR:PORT (join records it)")
            svc.add_argument("--run-as", help="macOS --system: the LaunchDaemon's user "
                             "(default: the user who ran sudo)")
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
