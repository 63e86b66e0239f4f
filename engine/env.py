"""The environment contract an agent starts an engine with (DESIGN.md): one typed record,
read by `from_environ` (every error names its variable) and written by `to_environ`, the only
places that spell the variables' names. Ranges stay tuples until written out. The agent and
the supervisor carry it as that mapping too (agent/spawn.py), and name a field's variable
through `VARIABLE_OF`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.addresses import AddressError, format_host_port, listen_address, parse_host_port
from engine.backend_names import (
    BACKENDS,
    COMPILE_MODES,
    DECODE_ATTENTIONS,
    DELTA_KERNELS,
    DRAFTERS,
    PACKED_KERNELS,
    PROMPT_ATTENTIONS,
    QUANT_MODES,
)
from engine.hop_choice import HOP_TRANSPORTS
from engine.link.hello import HANDSHAKE_DEADLINE_S
from engine.rounds import MAX_DRAFT_TOKENS

MIN_API_SECRET_CHARS = 16
DEFAULT_HTTP = "127.0.0.1:8000"
LOG_LEVELS = ("debug", "info", "warning", "error")
# The knobs `to_environ` writes only when they differ from their defaults: variable -> field.
TUNING = {"FLEET_MAX_WAITING": "max_waiting", "FLEET_DRAIN_S": "drain_s",
          "FLEET_KEEPALIVE_S": "keepalive_s", "FLEET_DEAD_AFTER": "dead_after",
          "FLEET_ROUND_DEADLINE_S": "round_deadline_s",
          "FLEET_BOOT_DEADLINE_S": "boot_deadline_s",
          "FLEET_HANDSHAKE_DEADLINE_S": "handshake_deadline_s",
          "FLEET_CPU_THREADS": "cpu_threads", "FLEET_LOG_LEVEL": "log_level",
          "FLEET_CUDA_GRAPHS": "cuda_graphs", "FLEET_HTTP_MAX_CONNECTIONS": "http_max_connections",
          "FLEET_HTTP_HEADER_S": "http_header_s", "FLEET_HTTP_IDLE_S": "http_idle_s",
          "FLEET_HTTP_BODY_S": "http_body_s", "FLEET_DELTA_KERNEL": "delta_kernel",
          "FLEET_COMPILE": "compile",
          "FLEET_QUANT": "quant", "FLEET_ROUNDS_IN_FLIGHT": "rounds_in_flight",
          "FLEET_HOP_TRANSPORT": "hop_transport",
          "FLEET_PROMPT_CACHE_SLOTS": "prompt_cache_slots", "FLEET_KV_PAGES": "kv_pages",
          "FLEET_DECODE_ATTENTION": "decode_attention", "FLEET_PACKED_KERNEL": "packed_kernel",
          "FLEET_PROMPT_ATTENTION": "prompt_attention",
          "FLEET_DRAFTER": "drafter", "FLEET_DRAFT_TOKENS": "draft_tokens"}
# Every field's variable, for a caller that refuses a value by the name its sender set
# (the agent's spawn checks). The master address is two variables, named as one.
VARIABLE_OF = {"rank": "RANK", "world_size": "WORLD_SIZE", "master": "MASTER_ADDR:MASTER_PORT",
               "layer_range": "FLEET_LAYERS", "layout": "FLEET_LAYOUT", "model_dir": "FLEET_MODEL",
               "backend": "FLEET_BACKEND", "listen": "FLEET_LISTEN", "key_file": "FLEET_KEY_FILE",
               "placement": "FLEET_PLACEMENT", "http": "FLEET_HTTP", "context": "FLEET_CONTEXT",
               "parallel": "FLEET_PARALLEL", "chunk": "FLEET_CHUNK",
               "model_id": "FLEET_MODEL_ID", "api_secret_file": "FLEET_API_SECRET_FILE",
               **{attr: variable for variable, attr in TUNING.items()}}
# Every variable `from_environ` reads: anything else in a mapping it is handed is not the
# contract's (a spawn request refuses it as a misspelling).
VARIABLES = frozenset(name for variable in VARIABLE_OF.values() for name in variable.split(":"))
# Kernel switches: checked by `from_environ` like every knob, but read again by
# `read_switch` from the engine process's own environment (which `to_environ` wrote) at the
# moment a kernel is picked, because that is where benches and tests set them: the decode
# attention choice is made as each round's index is built (a test flips it within one
# process), the packed matmul's per weight at load. field -> its spellings, default first.
SWITCHES = {"decode_attention": DECODE_ATTENTIONS, "packed_kernel": PACKED_KERNELS,
            "prompt_attention": PROMPT_ATTENTIONS}
# The knobs that pick which kernels a stage runs its layers with, and the spellings of those
# whose values are words (default first). fleet.yaml's `kernels:` and the calibration
# requests check theirs against these, so a value the engine would refuse is refused there.
KERNEL_CHOICES = {"quant": QUANT_MODES, "compile": COMPILE_MODES,
                  "delta_kernel": DELTA_KERNELS, **SWITCHES}
KERNEL_KNOBS = (*KERNEL_CHOICES, "cuda_graphs")  # cuda_graphs: a bool


class EnvError(ValueError):
    """A missing or malformed FLEET_* / torch.distributed variable; `variable` names it."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable


def read_switch(attr: str, environ: Mapping[str, str] | None = None) -> str:
    """A kernel switch (SWITCHES) as this process's environment sets it, or its default;
    EnvError naming the variable for a spelling it does not know."""
    variable, allowed = VARIABLE_OF[attr], SWITCHES[attr]
    value = (os.environ if environ is None else environ).get(variable, allowed[0])
    if value not in allowed:
        raise EnvError(variable, f"{variable}={value!r}: expected one of {', '.join(allowed)}")
    return value


def read_api_secret(path: Path, name: str = "FLEET_API_SECRET_FILE") -> str:
    """The bearer secret rank 0's API requires, from the 0600 file its agent wrote."""
    try:
        secret = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(name, f"{name}={str(path)!r}: cannot read the API secret: {exc}") from exc
    if len(secret) < MIN_API_SECRET_CHARS or not secret.isascii() or not secret.isprintable():
        raise EnvError(name, f"{name}={str(path)!r}: expected a secret of at least "
                       f"{MIN_API_SECRET_CHARS} printable ASCII characters")
    return secret


def parse_layers(value: str, name: str = "FLEET_LAYERS") -> tuple[int, int]:
    start, sep, end = value.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise EnvError(name, f"{name}={value!r}: expected start:end with start < end "
                       "(half-open)")
    return int(start), int(end)


def format_layers(layer_range: tuple[int, int]) -> str:
    return f"{layer_range[0]}:{layer_range[1]}"


def placement_id(layer_ranges: Sequence[tuple[int, int]], backends: Sequence[str]) -> str:
    """FLEET_PLACEMENT of a replica, from each rank's layer range and backend:
    "0-9@torch-cpu,9-20@mlx-cpu"."""
    return ",".join(f"{start}-{end}@{backend}"
                    for (start, end), backend in zip(layer_ranges, backends, strict=True))


@dataclass(frozen=True)
class EngineEnv:
    model_dir: Path
    rank: int = 0
    world_size: int = 1
    master: tuple[str, int] = ("127.0.0.1", 29500)  # rank 0's control address
    layer_range: tuple[int, int] | None = None  # None: the whole model (WORLD_SIZE=1 only)
    layout: tuple[tuple[int, int], ...] = ()  # every rank's range (FLEET_LAYOUT), for the fingerprint
    backend: str = "torch-cpu"
    listen: tuple[str, int] | None = None  # this stage's ring listener
    key_file: Path | None = None
    placement: str = "local"
    http: tuple[str, int] | None = None  # rank 0's API
    context: int = 2048
    parallel: int = 4
    # Slots past `parallel` that only keep finished conversations for the prompt cache: each
    # stage holds parallel + these slots' state (docs/prompt-cache.md).
    prompt_cache_slots: int = 0
    # KV pages of 64 positions every stage's pool holds (engine/kv_pages.py), the same number
    # on every stage; rank 0 admits requests by them. 0: a whole context for every slot.
    kv_pages: int = 0
    chunk: int = 256
    max_waiting: int = 64
    model_id: str = ""  # "": the checkpoint directory's name
    drain_s: float = 180.0  # SIGTERM: finish in-flight requests for up to this long, then exit
    keepalive_s: float = 2.0  # an empty plan once this passes without one
    dead_after: int = 3  # silent keep-alive intervals before the ring counts as dead
    round_deadline_s: float = 300.0  # bounds each send and receive of a round's frames
    boot_deadline_s: float = 300.0  # how long bootstrap waits for the other stages
    # A connection to a ring listener must authenticate within it.
    handshake_deadline_s: float = HANDSHAKE_DEADLINE_S
    cpu_threads: int = 0  # 0: the framework's default; stages sharing a CPU should split it
    log_level: str = "info"  # debug adds each round's timing per stage
    cuda_graphs: bool = True  # FLEET_CUDA_GRAPHS=0 runs every round eagerly
    delta_kernel: str = "auto"  # a hybrid's gated delta rule on PyTorch: auto, torch or fla
    quant: str = "auto"  # a PyTorch stage's mlx-lm packed weights: auto, packed or dense
    compile: str = "auto"  # a PyTorch stage's decode layers compiled: auto (CUDA), off or on
    # Rank 0's rounds in flight at once (RFC 6.3 v2/v3); 0: one per stage, so every stage
    # works at once; 1: each round lands before the next starts (v1).
    rounds_in_flight: int = 0
    # How each hop's rows travel (engine.hop_choice.choose, docs/hop-transport.md): auto
    # (TCP on every hop, until NCCL hops are measured on two GPUs), tcp, or dist
    # (torch.distributed: NCCL between two torch-cuda stages, gloo between torch-cpu ones).
    hop_transport: str = "auto"
    # Kernel switches of a PyTorch stage on CUDA (SWITCHES: read at kernel choice time):
    # decode attention by our Triton kernel or SDPA, a packed matmul by Triton or int4, a
    # prompt chunk's attention by SDPA's flash kernel or cuDNN's.
    decode_attention: str = "triton"
    packed_kernel: str = "triton"
    prompt_attention: str = "flash"
    # Rank 0's drafter: off, ngram (engine.lanes.drafting) or mtp (the checkpoint's MTP
    # head, engine.lanes.model_drafting), and the most tokens a verify
    # round carries after a stream's newest one (1 to MAX_DRAFT_TOKENS).
    drafter: str = "off"
    draft_tokens: int = 5
    # Rank 0's API answers only requests bearing the secret in this file; None keeps it open,
    # as a standalone engine is.
    api_secret_file: Path | None = None
    # The secret itself, read by from_environ; kept out of repr so no log line can carry it.
    api_secret: str = field(default="", repr=False)
    # Rank 0's API connections (engine.api.connections): 0 connections = half the fd limit.
    http_max_connections: int = 0
    http_header_s: float = 5.0  # a new connection must send its first request's headers by then
    http_idle_s: float = 15.0  # an idle keep-alive connection closes this long after a response
    http_body_s: float = 30.0  # a request body must arrive within this

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None, *,
                     read_secret: bool = True) -> EngineEnv:
        """The record `env` (default: this process's environment) describes; EnvError names
        the first variable that is missing or wrong. `read_secret=False` keeps the API
        secret file's path without reading it: an agent reading back the run record of an
        engine that read it at start."""
        env = os.environ if env is None else env
        default = {name: f.default for name, f in cls.__dataclass_fields__.items()}

        def need(name: str) -> str:
            if not env.get(name):
                raise EnvError(name, f"{name} is not set")
            return env[name]

        def integer(name: str, attr: str, low: int = 1) -> int:
            raw = env.get(name, str(default[attr]))
            if not raw.lstrip("-").isdigit() or int(raw) < low:
                raise EnvError(name, f"{name}={raw!r}: expected an integer >= {low}")
            return int(raw)

        def draft_tokens() -> int:
            value = integer("FLEET_DRAFT_TOKENS", "draft_tokens")
            if value > MAX_DRAFT_TOKENS:
                raise EnvError("FLEET_DRAFT_TOKENS", f"FLEET_DRAFT_TOKENS={value}: a verify "
                               f"round carries at most {MAX_DRAFT_TOKENS} drafts")
            return value

        def number(name: str, attr: str, *, zero_ok: bool = False) -> float:
            raw = env.get(name, str(default[attr]))
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
                raise EnvError(name, f"{name}={raw!r}: expected a "
                               f"{'' if zero_ok else 'positive '}number of seconds")
            return value

        def choice(name: str, attr: str, allowed: Sequence[str]) -> str:
            value = env.get(name, default[attr])
            if value not in allowed:
                raise EnvError(name, f"{name}={value!r}: expected one of {', '.join(allowed)}")
            return value

        def address(name: str, value: str, *, listener: bool = True) -> tuple[str, int]:
            try:
                return (listen_address if listener else parse_host_port)(value, name)
            except AddressError as exc:
                raise EnvError(name, str(exc)) from exc

        log_level = env.get("FLEET_LOG_LEVEL", "info").lower()
        if log_level not in LOG_LEVELS:
            raise EnvError("FLEET_LOG_LEVEL", f"FLEET_LOG_LEVEL={log_level!r}: expected "
                           "debug, info, warning or error")
        rank, world = integer("RANK", "rank", 0), integer("WORLD_SIZE", "world_size")
        if rank >= world:
            raise EnvError("RANK", f"RANK={rank} must be below WORLD_SIZE={world}")
        backend = choice("FLEET_BACKEND", "backend", BACKENDS)
        hop_transport = choice("FLEET_HOP_TRANSPORT", "hop_transport", HOP_TRANSPORTS)
        kernels = {attr: choice(VARIABLE_OF[attr], attr, allowed)
                   for attr, allowed in KERNEL_CHOICES.items()}
        model_dir = Path(need("FLEET_MODEL"))
        layers = parse_layers(env["FLEET_LAYERS"]) if env.get("FLEET_LAYERS") else None
        if layers is None and world > 1:
            raise EnvError("FLEET_LAYERS", "FLEET_LAYERS is required when WORLD_SIZE > 1")
        layout: tuple[tuple[int, int], ...] = ()
        if world > 1:
            layout = tuple(parse_layers(part, "FLEET_LAYOUT")
                           for part in need("FLEET_LAYOUT").split(","))
            if len(layout) != world or layout[rank] != layers:
                raise EnvError("FLEET_LAYOUT", f"FLEET_LAYOUT={env['FLEET_LAYOUT']!r} must "
                               f"list WORLD_SIZE={world} ranges with "
                               f"FLEET_LAYERS={env['FLEET_LAYERS']!r} at rank {rank}")
        listen = http = api_secret_file = None
        api_secret = ""
        if world > 1:
            listen = address("FLEET_LISTEN", need("FLEET_LISTEN"))
        if rank == 0:
            http = address("FLEET_HTTP", env.get("FLEET_HTTP") or DEFAULT_HTTP)
            if env.get("FLEET_API_SECRET_FILE"):
                api_secret_file = Path(env["FLEET_API_SECRET_FILE"])
                api_secret = read_api_secret(api_secret_file) if read_secret else ""
        master_host, master_port = default["master"]
        # rank 0 binds it, the others dial it: never a wildcard in a ring
        master = address("MASTER_ADDR:MASTER_PORT", format_host_port(
            env.get("MASTER_ADDR", master_host), env.get("MASTER_PORT", str(master_port))),
            listener=world > 1)
        return cls(
            rank=rank, world_size=world, master=master, layer_range=layers, layout=layout,
            model_dir=model_dir, backend=backend, listen=listen,
            key_file=Path(need("FLEET_KEY_FILE")) if world > 1 else None,
            placement=env.get("FLEET_PLACEMENT", default["placement"]), http=http,
            context=integer("FLEET_CONTEXT", "context"),
            parallel=integer("FLEET_PARALLEL", "parallel"),
            prompt_cache_slots=integer("FLEET_PROMPT_CACHE_SLOTS", "prompt_cache_slots", 0),
            kv_pages=integer("FLEET_KV_PAGES", "kv_pages", 0),
            drafter=choice("FLEET_DRAFTER", "drafter", DRAFTERS),
            draft_tokens=draft_tokens(),
            chunk=integer("FLEET_CHUNK", "chunk"),
            max_waiting=integer("FLEET_MAX_WAITING", "max_waiting", 0),
            model_id=env.get("FLEET_MODEL_ID") or model_dir.resolve().name,
            drain_s=number("FLEET_DRAIN_S", "drain_s", zero_ok=True),
            keepalive_s=number("FLEET_KEEPALIVE_S", "keepalive_s"),
            dead_after=integer("FLEET_DEAD_AFTER", "dead_after"),
            round_deadline_s=number("FLEET_ROUND_DEADLINE_S", "round_deadline_s"),
            boot_deadline_s=number("FLEET_BOOT_DEADLINE_S", "boot_deadline_s"),
            handshake_deadline_s=number("FLEET_HANDSHAKE_DEADLINE_S", "handshake_deadline_s"),
            cpu_threads=integer("FLEET_CPU_THREADS", "cpu_threads", 0),
            log_level=log_level,
            cuda_graphs=env.get("FLEET_CUDA_GRAPHS", "1") != "0",
            rounds_in_flight=integer("FLEET_ROUNDS_IN_FLIGHT", "rounds_in_flight", 0),
            hop_transport=hop_transport, **kernels,
            api_secret_file=api_secret_file, api_secret=api_secret,
            http_max_connections=integer("FLEET_HTTP_MAX_CONNECTIONS", "http_max_connections", 0),
            http_header_s=number("FLEET_HTTP_HEADER_S", "http_header_s"),
            http_idle_s=number("FLEET_HTTP_IDLE_S", "http_idle_s"),
            http_body_s=number("FLEET_HTTP_BODY_S", "http_body_s"),
        )

    @property
    def slots(self) -> int:
        """Slots every stage holds: streams at once, and the kept conversations past them."""
        return self.parallel + self.prompt_cache_slots

    def to_environ(self) -> dict[str, str]:
        """The variables `from_environ` reads back as this record (the secret by its file).
        Where a stage is and what it serves is always written; a tuning knob only when it
        differs from its default, so one set in the caller's environment still reaches an
        engine the launch harness starts. Seconds go as they are: the engine reads fractions."""
        env = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master[0], "MASTER_PORT": str(self.master[1]),
            "FLEET_MODEL": str(self.model_dir), "FLEET_BACKEND": self.backend,
            "FLEET_PLACEMENT": self.placement,
            "FLEET_CONTEXT": str(self.context), "FLEET_PARALLEL": str(self.parallel),
            "FLEET_CHUNK": str(self.chunk),
        }
        optional = {
            "FLEET_LAYERS": format_layers(self.layer_range) if self.layer_range else "",
            "FLEET_LAYOUT": ",".join(format_layers(r) for r in self.layout),
            "FLEET_LISTEN": format_host_port(*self.listen) if self.listen else "",
            "FLEET_HTTP": format_host_port(*self.http) if self.http else "",
            "FLEET_KEY_FILE": str(self.key_file) if self.key_file else "",
            "FLEET_MODEL_ID": self.model_id,
            "FLEET_API_SECRET_FILE": str(self.api_secret_file) if self.api_secret_file else "",
        }
        env.update({k: v for k, v in optional.items() if v})
        default = {name: f.default for name, f in type(self).__dataclass_fields__.items()}
        changed = [attr for attr in TUNING.values() if getattr(self, attr) != default[attr]]
        return env | self.written(*changed)

    def written(self, *attrs: str) -> dict[str, str]:
        """These tuning knobs' variables (TUNING) as `to_environ` writes them, at their
        defaults too: for a sender whose value must win over a default its receiver sets
        (the supervisor's drain_s over an agent's)."""
        out = {}
        for attr in attrs:
            value = getattr(self, attr)
            out[VARIABLE_OF[attr]] = (("1" if value else "0") if isinstance(value, bool)
                                      else repr(value) if isinstance(value, float)
                                      else str(value))
        return out

    @property
    def depth(self) -> int:
        """Rounds rank 0 keeps in flight: FLEET_ROUNDS_IN_FLIGHT, or one per stage."""
        return self.rounds_in_flight or self.world_size
