"""Start one replica's engines on loopback with the environment contract (tests, bench).

    python -m engine.harness.launch --model DIR --stages 0:9,9:20,20:28 --backends torch-cpu,mlx-cpu

A harness, not the product's path: in a fleet the agents spawn the engines the supervisor
places. Here one process starts one `fleet-engine` per stage, each with its own environment,
a shared link key and ports picked on 127.0.0.1, with no agent or supervisor in between.
Ctrl-C or SIGTERM stops every stage; inside `with`, a LocalReplica stops its stages on
SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from engine.env import EngineEnv, parse_layers, placement_id
from engine.link.sockets import port_in_use

LOOPBACK = "127.0.0.1"


# Ports a harness hands out lie below the kernel's ephemeral range (32768 and up on Linux,
# 49152 on macOS), which the kernel picks connections' source ports from: a dial to a port
# in that range before its listener is up can be joined to itself (engine.link.transport
# says what that does), and a port from it can also be taken at any moment by some
# connection's source port. They also lie below 20000, where supervisor.local.LocalFleet
# keeps its engines' port range.
PORTS = range(10000, 20000)
_handed_out: set[int] = set()  # this process's, so two calls never give the same port


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, SIGTERM (what `kill` and `timeout` send) raises SystemExit in the main
    thread, so the `with` blocks it crosses stop the processes they started. Python's
    default would end this process at once and leave them serving, unowned. Elsewhere than
    the main thread, where no handler can be set, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports of `PORTS` nothing is bound to now;
    for one port where none is free there, the kernel's pick."""
    for first in random.sample(range(PORTS.start, PORTS.stop - count), 200):
        block = range(first, first + count)
        if _handed_out.isdisjoint(block) and not any(port_in_use(LOOPBACK, p) for p in block):
            _handed_out.update(block)
            return first
    if count > 1:
        raise OSError(f"no {count} consecutive free ports in {PORTS.start}-{PORTS.stop - 1}")
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def even_stages(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous half-open ranges of as equal a size as the layer count allows."""
    cuts = [round(n_layers * i / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(cuts))


def log_records(path: Path) -> list[dict]:
    """An engine log file's structured (JSON) lines, in order; other lines are skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


@dataclass
class LocalReplica:
    """N engine processes of one replica; `url` is rank 0's OpenAI base URL."""

    model_dir: Path
    stages: list[tuple[int, int]]
    backends: list[str]
    run_dir: Path
    http_port: int
    processes: list[subprocess.Popen | None] = field(default_factory=list)  # None: not spawned
    log_paths: list[Path] = field(default_factory=list)
    envs: list[dict[str, str]] = field(default_factory=list)
    # What each rank runs: `python -m MODULE` (a test may wrap the engine to inject a fault).
    engine_module: str = "engine.main"
    # Inside `with`, SIGTERM unwinds to __exit__ (sigterm_unwinds).
    _unwind: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def start_rank(self, rank: int, *, log_to_file: bool = True) -> subprocess.Popen:
        """Start (or restart) one rank's engine with its environment."""
        out = open(self.log_paths[rank], "ab") if log_to_file else None  # noqa: SIM115
        try:
            self.processes[rank] = subprocess.Popen(
                [sys.executable, "-m", self.engine_module], env=self.envs[rank], stdout=out,
                stderr=out)
        finally:
            if out:
                out.close()  # the child holds its own descriptor
        return self.processes[rank]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/v1"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait for rank 0's /health; fail early, with the logs, if any stage exits."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for rank, proc in enumerate(self.processes):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"rank {rank} exited with {proc.returncode} while starting:"
                                       f"\n{self.log_tail(rank)}")
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_port}/health",
                                            timeout=1) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the replica was not ready after {timeout_s} s:\n{self.log_tail(0)}")

    def log_tail(self, rank: int, lines: int = 20) -> str:
        path = self.log_paths[rank]
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def events(self, rank: int) -> list[dict]:
        """The rank's structured log lines."""
        return log_records(self.log_paths[rank])

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGINT) -> list[int | None]:
        """Signal every rank, then kill what is still running after `grace_s`."""
        live = [p for p in self.processes if p is not None]
        for proc in live:
            if proc.poll() is None:
                proc.send_signal(sig)
        until = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return [p.returncode if p is not None else None for p in self.processes]

    def __enter__(self) -> Self:
        self._unwind.enter_context(sigterm_unwinds())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._unwind.close()


def stage_envs(model_dir: Path, stages: list[tuple[int, int]], backends: list[str], *,
               key_file: Path, http_port: int, context: int, parallel: int, chunk: int,
               prompt_cache_slots: int = 0,
               extra_env: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment contract of every rank of one replica on loopback."""
    master_port = free_port()
    envs = []
    for rank, ((start, end), backend) in enumerate(zip(stages, backends, strict=True)):
        contract = EngineEnv(
            model_dir=model_dir, rank=rank, world_size=len(stages),
            master=(LOOPBACK, master_port), layer_range=(start, end), layout=tuple(stages),
            backend=backend, listen=(LOOPBACK, free_port()), key_file=key_file,
            placement=placement_id(stages, backends), http=(LOOPBACK, http_port),
            context=context, parallel=parallel, chunk=chunk,
            prompt_cache_slots=prompt_cache_slots, cpu_threads=max(1, (os.cpu_count() or 1) // len(stages)))
        env = dict(os.environ)
        env.update(contract.to_environ())
        env.update(extra_env or {})
        envs.append(env)
    return envs


def write_key_file(path: Path) -> Path:
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def launch(model_dir: Path, stages: list[tuple[int, int]], backends: list[str] | None = None, *,
           context: int = 1024, parallel: int = 4, chunk: int = 128, prompt_cache_slots: int = 0,
           run_dir: Path | None = None,
           http_port: int | None = None, extra_env: dict[str, str] | None = None,
           rank_env: dict[int, dict[str, str]] | None = None, spawn: list[int] | None = None,
           log_to_files: bool = True, engine_module: str = "engine.main") -> LocalReplica:
    """Start the ranks in `spawn` (default: all); `rank_env` overrides one rank's variables."""
    backends = backends or ["torch-cpu"] * len(stages)
    if len(backends) != len(stages):
        raise ValueError(f"{len(stages)} stages but {len(backends)} backends")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="ringfleet-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    key_file = write_key_file(run_dir / "link.key")
    replica = LocalReplica(Path(model_dir), stages, backends, run_dir, http_port or free_port(),
                           engine_module=engine_module)
    replica.envs = stage_envs(Path(model_dir), stages, backends, key_file=key_file,
                              http_port=replica.http_port, context=context, parallel=parallel,
                              chunk=chunk, prompt_cache_slots=prompt_cache_slots,
                              extra_env=extra_env)
    for rank, overrides in (rank_env or {}).items():
        replica.envs[rank].update(overrides)
    replica.log_paths = [run_dir / f"rank{rank}.log" for rank in range(len(stages))]
    replica.processes = [None] * len(stages)
    for rank in range(len(stages)):
        if spawn is None or rank in spawn:
            replica.start_rank(rank, log_to_file=log_to_files)
    return replica


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.harness.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--stages", required=True,
                        help="half-open layer ranges, one per stage: 0:9,9:20,20:28")
    parser.add_argument("--backends", help="one per stage (default torch-cpu for all)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--http-port", type=int, default=8000)
    args = parser.parse_args()
    try:
        stages = [parse_layers(part, "--stages") for part in args.stages.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    backends = args.backends.split(",") if args.backends else None
    # The replica's `with` stops every stage on Ctrl-C and on SIGTERM (`kill`) alike.
    with launch(args.model, stages, backends, context=args.context, parallel=args.parallel,
                chunk=args.chunk, http_port=args.http_port, log_to_files=False) as replica:
        try:
            replica.wait_ready()
            print(f"serving {args.model} at {replica.url} "
                  f"({placement_id(stages, replica.backends)}); Ctrl-C stops", file=sys.stderr)
            while all(p.poll() is None for p in replica.processes):
                time.sleep(0.5)
            return 1
        except KeyboardInterrupt:
            return 0

if __name__ == "__main__":
    sys.exit(main())
