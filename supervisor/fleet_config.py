"""`fleet.yaml`: the fleet's desired state, parsed into frozen dataclasses with line-exact errors.

The file is composed into YAML nodes first (never loaded straight into dicts) and read
through `supervisor.yaml_fields`, so every error can name the file, the line and the field
path, e.g.
`fleet.yaml:23: models[0].context: expected a positive integer, got -5`. Unknown keys are
refused with a suggestion, because a typo that is silently ignored is a setting that is
silently lost. `diff` says, in words, what applying a new file would change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from engine.addresses import AddressError, is_wildcard_host, parse_host_port
from engine.backend_names import BACKENDS, DRAFTERS
from engine.env import KERNEL_CHOICES, KERNEL_KNOBS, EngineEnv
from engine.hop_choice import HOP_TRANSPORTS
from engine.kv_pages import PAGE_POSITIONS, pages_for
from engine.rounds import MAX_DRAFT_TOKENS
from supervisor.yaml_fields import COMPOSER, FleetConfigError, YamlField

OBJECTIVES = ("decode", "prompt")
SUPPORTED_VERSIONS = (1,)
DEFAULT_PARALLEL = 1
DEFAULT_CHUNK = 512
# The prompt cache's byte budget of each stage when fleet.yaml sets neither
# prompt_cache_bytes nor prompt_cache_slots: this share of the usable memory its node's
# agent reports; placement turns the budgets into one slot count (docs/prompt-cache.md).
DEFAULT_PROMPT_CACHE_SHARE = 0.1
AUTO_REPLICAS = 0  # `replicas: auto`: as many as fit
LAYERS_PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class SupervisorConfig:
    address: str  # host:port where agents and fleetctl reach the supervisor
    state_dir: str


@dataclass(frozen=True)
class NodeConfig:
    name: str  # as the node's agent reports it
    labels: tuple[tuple[str, str], ...] = ()
    pins: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CheckpointPaths:
    """Where a model's checkpoint directory is: one path for every node, or one per node."""

    all_nodes: str | None = None
    by_node: tuple[tuple[str, str], ...] = ()

    def path_for(self, node: str) -> str | None:
        return dict(self.by_node).get(node, self.all_nodes)


@dataclass(frozen=True)
class ExplicitStage:
    node: str
    layer_range: tuple[int, int]  # half-open [start, end)
    backend: str | None = None  # None: the node's own


@dataclass(frozen=True)
class ModelSpec:
    """One model the fleet serves (named apart from `engine.config.ModelConfig`, its shape)."""

    id: str  # what clients put in "model"
    checkpoint: CheckpointPaths
    backends: tuple[str, ...]  # backends a stage may use
    context: int  # positions per stream
    parallel: int = DEFAULT_PARALLEL  # streams served at once
    # Slots past `parallel` that keep finished conversations for the prompt cache; every
    # stage holds their state, and placement charges it (docs/prompt-cache.md). None: as
    # many as the stages' byte budget buys; a count set here overrides the budget.
    prompt_cache_slots: int | None = None
    # Each stage's byte budget for those slots; None: DEFAULT_PROMPT_CACHE_SHARE of its
    # node's usable memory.
    prompt_cache_bytes: int | None = None
    # KV pages of PAGE_POSITIONS every stage's pool holds (FLEET_KV_PAGES), shared by the
    # streams and the kept conversations; rank 0 admits requests by them. Placement charges
    # the pool instead of a whole context a slot (docs/prompt-cache.md). 0: whole windows.
    kv_pages: int = 0
    chunk: int = DEFAULT_CHUNK  # prompt rows per round
    objective: str = "decode"  # or "prompt"
    placement: tuple[ExplicitStage, ...] = ()  # empty: auto
    rank0: str | None = None  # the node that must be rank 0
    replicas: int = 1  # copies served side by side; AUTO_REPLICAS: as many as fit
    prompt_tokens: int | None = None  # the prompt the placement costs; None: `context`
    hop_transport: str = "auto"  # its stages' FLEET_HOP_TRANSPORT (docs/hop-transport.md)
    # Which kernels every stage runs its layers with (`kernels:`): EngineEnv field -> value,
    # in KERNEL_KNOBS order, only those that differ from the engine's defaults.
    kernels: tuple[tuple[str, str | bool], ...] = ()
    # Rank 0's drafter (engine.lanes.drafting) and the most drafts a verify round carries.
    drafter: str = "off"
    draft_tokens: int = EngineEnv.__dataclass_fields__["draft_tokens"].default

    @property
    def prompt_length(self) -> int:
        """The prompt length placement predicts the time to first token of (and minimises
        it for, with `objective: prompt`): `prompt_tokens`, else the whole context."""
        return self.prompt_tokens or self.context

    @property
    def placement_is_auto(self) -> bool:
        return not self.placement

    @property
    def replicas_are_auto(self) -> bool:
        return self.replicas == AUTO_REPLICAS


@dataclass(frozen=True)
class FleetConfig:
    version: int
    supervisor: SupervisorConfig
    nodes: tuple[NodeConfig, ...]
    models: tuple[ModelSpec, ...] = ()

    def node(self, name: str) -> NodeConfig | None:
        return next((n for n in self.nodes if n.name == name), None)

    def model(self, model_id: str) -> ModelSpec | None:
        return next((m for m in self.models if m.id == model_id), None)


def load_fleet_config(path: str | Path) -> FleetConfig:
    """Read and validate a fleet file; every problem raises `FleetConfigError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetConfigError(source, 0, "", f"cannot read: {exc}") from exc
    return parse_fleet_config(text, source)


def parse_fleet_config(text: str, source_name: str = "fleet.yaml") -> FleetConfig:
    """Validate fleet.yaml's text; `source_name` is what errors call the file."""
    try:
        root = yaml.compose(text, Loader=COMPOSER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        context = (f" ({exc.context} at line {exc.context_mark.line + 1})"
                   if exc.context and exc.context_mark else "")
        raise FleetConfigError(source_name, line, "",
                               f"not valid YAML: {exc.problem}{context}") from exc
    except yaml.YAMLError as exc:
        raise FleetConfigError(source_name, 0, "", f"not valid YAML: {exc}") from exc
    if root is None:
        raise FleetConfigError(source_name, 1, "", "empty file: expected a mapping with "
                               "version, supervisor, nodes and models")
    top = YamlField(root, "", source_name).mapping(
        known=("version", "supervisor", "nodes", "models"),
        required=("version", "supervisor", "nodes"), extensions=True)
    version = top["version"].integer(minimum=0)
    if version not in SUPPORTED_VERSIONS:
        raise top["version"].error(
            f"unsupported version {version} (this supervisor reads version "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})", version)
    nodes = _parse_nodes(top["nodes"])
    node_names = tuple(n.name for n in nodes)
    models: list[ModelSpec] = []
    first_line: dict[str, int] = {}
    no_models = "models" not in top or top["models"].node.tag == "tag:yaml.org,2002:null"
    for item in [] if no_models else top["models"].sequence():
        model = _parse_model(item, node_names)
        if model.id in first_line:
            raise item.field("id").error(
                f"duplicate model id {model.id!r} (first at line {first_line[model.id]})", model.id)
        first_line[model.id] = item.field("id").line
        models.append(model)
    return FleetConfig(version=version, supervisor=_parse_supervisor(top["supervisor"]),
                       nodes=nodes, models=tuple(models))


def _parse_supervisor(at: YamlField) -> SupervisorConfig:
    fields_ = at.mapping(known=("address", "state_dir"), required=("address", "state_dir"))
    address = fields_["address"].string()
    try:
        host, _ = parse_host_port(address, "address", min_port=1)
    except AddressError as exc:
        raise fields_["address"].error(f"expected host:port, got {address!r}", address) from exc
    if not host:
        raise fields_["address"].error(f"expected host:port, got {address!r}", address)
    if is_wildcard_host(host):
        raise fields_["address"].error(
            f"{host!r} is a wildcard: give the address agents and fleetctl reach", address)
    return SupervisorConfig(address=address, state_dir=fields_["state_dir"].string())


def _parse_nodes(at: YamlField) -> tuple[NodeConfig, ...]:
    items = at.sequence()
    if not items:
        raise at.error("expected at least one node")
    nodes: list[NodeConfig] = []
    first_line: dict[str, int] = {}
    for item in items:
        fields_ = item.mapping(known=("name", "labels", "pins"), required=("name",))
        name = fields_["name"].name("node name")
        if name in first_line:
            raise fields_["name"].error(
                f"duplicate node name {name!r} (first at line {first_line[name]})", name)
        first_line[name] = fields_["name"].line
        labels = fields_["labels"].string_map() if "labels" in fields_ else ()
        pins = fields_["pins"].string_map() if "pins" in fields_ else ()
        nodes.append(NodeConfig(name=name, labels=labels, pins=pins))
    return tuple(nodes)


_MODEL_FIELDS = ("id", "checkpoint", "backends", "context", "parallel", "prompt_cache_slots",
                 "prompt_cache_bytes", "kv_pages", "chunk", "objective",
                 "prompt_tokens", "placement", "rank0", "replicas", "hop_transport", "kernels",
                 "drafter", "draft_tokens")


def _parse_model(at: YamlField, node_names: tuple[str, ...]) -> ModelSpec:
    f = at.mapping(known=_MODEL_FIELDS, required=("id", "checkpoint", "context"))
    model_id = f["id"].string()
    if any(c.isspace() for c in model_id):
        raise f["id"].error(f"model id {model_id!r} must not contain spaces", model_id)
    checkpoint = _parse_checkpoint(f["checkpoint"], node_names)
    backends = _parse_backends(f["backends"]) if "backends" in f else BACKENDS
    context = f["context"].integer()
    parallel = f["parallel"].integer() if "parallel" in f else DEFAULT_PARALLEL
    kept = f["prompt_cache_slots"].integer(minimum=0) if "prompt_cache_slots" in f else None
    budget = f["prompt_cache_bytes"].size() if "prompt_cache_bytes" in f else None
    kv_pages = _parse_kv_pages(f["kv_pages"], context) if "kv_pages" in f else 0
    chunk = f["chunk"].integer() if "chunk" in f else DEFAULT_CHUNK
    objective = f["objective"].choice(OBJECTIVES, "objective") if "objective" in f else "decode"
    prompt_tokens = f["prompt_tokens"].integer() if "prompt_tokens" in f else None
    if prompt_tokens is not None and prompt_tokens > context:
        raise f["prompt_tokens"].error(f"a prompt of {prompt_tokens} tokens does not fit the "
                                       f"context of {context} positions", prompt_tokens)
    placement: tuple[ExplicitStage, ...] = ()
    if "placement" in f:
        placement = _parse_placement(f["placement"], node_names, checkpoint, backends)
    rank0 = None
    if "rank0" in f:
        rank0 = _known_node(f["rank0"], node_names, checkpoint)
        if placement and placement[0].node != rank0:
            raise f["rank0"].error(
                f"rank0 {rank0!r} differs from the explicit placement's first stage "
                f"{placement[0].node!r} (rank 0 is the first stage)", rank0)
    replicas = _parse_replicas(f["replicas"]) if "replicas" in f else 1
    hop_transport = (f["hop_transport"].choice(HOP_TRANSPORTS, "hop transport")
                     if "hop_transport" in f else "auto")
    kernels = _parse_kernels(f["kernels"]) if "kernels" in f else ()
    drafter = f["drafter"].word(DRAFTERS, "drafter") if "drafter" in f else "off"
    draft_tokens = ModelSpec.draft_tokens
    if "draft_tokens" in f:
        draft_tokens = f["draft_tokens"].integer()
        if draft_tokens > MAX_DRAFT_TOKENS:
            raise f["draft_tokens"].error(f"a verify round carries at most {MAX_DRAFT_TOKENS} "
                                          f"drafts, not {draft_tokens}", draft_tokens)
    return ModelSpec(id=model_id, checkpoint=checkpoint, backends=backends, context=context,
                     parallel=parallel, prompt_cache_slots=kept,
                     prompt_cache_bytes=budget, kv_pages=kv_pages, chunk=chunk,
                     objective=objective, placement=placement,
                     rank0=rank0, replicas=replicas, prompt_tokens=prompt_tokens,
                     hop_transport=hop_transport, kernels=kernels, drafter=drafter,
                     draft_tokens=draft_tokens)


def _parse_kv_pages(at: YamlField, context: int) -> int:
    """0 (a whole context a slot), or a pool of at least one whole context: a request that
    leaves `max_tokens` out reserves the rest of the context (engine.lanes.page_ledger), so
    under a smaller pool every such request, and any prompt longer than the pool, would be
    refused for good while the model claims `context` positions. A smaller pool is a
    smaller context: that is the field to lower."""
    pages = at.integer(minimum=0)
    window = pages_for(context)
    if 0 < pages < window:
        raise at.error(
            f"a pool of {pages} pages ({pages * PAGE_POSITIONS} positions) is smaller than "
            f"one whole context of {context} positions ({window} pages of {PAGE_POSITIONS}): "
            f"a request that leaves max_tokens out reserves the whole context and could "
            f"never be admitted; set at least {window}, 0 for a whole context a slot, or a "
            "smaller context", pages)
    return pages


def _parse_kernels(at: YamlField) -> tuple[tuple[str, str | bool], ...]:
    """A model's kernel knobs, each checked against the engine's own spellings (KERNEL_CHOICES)
    and kept only where it differs from the engine's default, so that spelling a default out
    changes nothing."""
    given = at.mapping(known=KERNEL_KNOBS)
    kernels = []
    for attr in (a for a in KERNEL_KNOBS if a in given):
        child = given[attr]
        if attr == "cuda_graphs":
            value = child.value()
            if not isinstance(value, bool):
                raise child.error(f"expected true or false, got {child.describe()}", value)
        else:
            value = child.word(KERNEL_CHOICES[attr], attr.replace("_", " "))
        if value != EngineEnv.__dataclass_fields__[attr].default:
            kernels.append((attr, value))
    return tuple(kernels)


def _parse_replicas(at: YamlField) -> int:
    """A positive count, or `auto` (as many as fit, AUTO_REPLICAS)."""
    if isinstance(at.node, yaml.ScalarNode) and at.value() == "auto":
        return AUTO_REPLICAS
    value = at.value()
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise at.error(f"expected a positive integer or 'auto', got {at.describe()}", value)
    return value


def _known_node(at: YamlField, node_names: tuple[str, ...], checkpoint: CheckpointPaths) -> str:
    name = at.string()
    if name not in node_names:
        raise at.error(f"unknown node {name!r} (nodes: {', '.join(node_names)})", name)
    if checkpoint.path_for(name) is None:
        raise at.error(f"node {name!r} has no checkpoint path for this model", name)
    return name


def _parse_checkpoint(at: YamlField, node_names: tuple[str, ...]) -> CheckpointPaths:
    if isinstance(at.node, yaml.ScalarNode):
        return CheckpointPaths(all_nodes=at.string())
    if not isinstance(at.node, yaml.MappingNode):
        raise at.error(f"expected a path or a mapping of node names to paths, got {at.describe()}")
    by_node = at.string_map()
    if not by_node:
        raise at.error("expected at least one node: path entry")
    for node, _ in by_node:
        if node not in node_names:
            raise at.field(node).error(
                f"unknown node {node!r} (nodes: {', '.join(node_names)})", node)
    return CheckpointPaths(by_node=by_node)


def _parse_backends(at: YamlField) -> tuple[str, ...]:
    items = at.sequence()
    if not items:
        raise at.error(f"expected at least one backend (known: {', '.join(BACKENDS)})")
    backends: list[str] = []
    for item in items:
        backend = item.choice(BACKENDS, "backend")
        if backend in backends:
            raise item.error(f"backend {backend!r} is listed twice", backend)
        backends.append(backend)
    return tuple(backends)


def _parse_placement(at: YamlField, node_names: tuple[str, ...], checkpoint: CheckpointPaths,
                     backends: tuple[str, ...]) -> tuple[ExplicitStage, ...]:
    if isinstance(at.node, yaml.ScalarNode):
        if at.value() == "auto":
            return ()
        raise at.error(f"expected 'auto' or a list of stages, got {at.describe()}", at.value())
    items = at.sequence()
    if not items:
        raise at.error("expected 'auto' or at least one stage")
    stages: list[ExplicitStage] = []
    for item in items:
        f = item.mapping(known=("node", "layers", "backend"), required=("node", "layers"))
        node = _known_node(f["node"], node_names, checkpoint)
        if any(s.node == node for s in stages):
            raise f["node"].error(f"node {node!r} already has a stage of this model", node)
        backend = None
        if "backend" in f:
            backend = f["backend"].choice(BACKENDS, "backend")
            if backend not in backends:
                raise f["backend"].error(
                    f"backend {backend!r} is not among this model's backends "
                    f"({', '.join(backends)})", backend)
        start, end = _layer_range(f["layers"])
        expected_start = stages[-1].layer_range[1] if stages else 0
        if start != expected_start:
            after = (f"the previous stage ends at {expected_start}" if stages
                     else "the first stage must start at 0")
            raise f["layers"].error(
                f"starts at {start} but {after} (ranges must be contiguous)", f"{start}:{end}")
        stages.append(ExplicitStage(node=node, layer_range=(start, end), backend=backend))
    return tuple(stages)


def _layer_range(at: YamlField) -> tuple[int, int]:
    # The raw text, so that an unquoted 20:36 (YAML 1.1's base-60 integer 1236) still reads.
    text = at.node.value if isinstance(at.node, yaml.ScalarNode) else ""
    match = LAYERS_PATTERN.match(text) if isinstance(text, str) else None
    if not match:
        raise at.error(f"expected a layer range \"start:end\", got {at.describe()}", text)
    start, end = int(match[1]), int(match[2])
    if start >= end:
        raise at.error(f"layer range {start}:{end} is empty (start must be below end)",
                       f"{start}:{end}")
    return start, end


def diff(old: FleetConfig, new: FleetConfig) -> list[str]:
    """What applying `new` over `old` changes, one line per change, for `fleetctl apply`."""
    changes: list[str] = []
    if old.version != new.version:
        changes.append(f"version: {old.version} -> {new.version}")
    for f in fields(SupervisorConfig):
        before, after = getattr(old.supervisor, f.name), getattr(new.supervisor, f.name)
        if before != after:
            changes.append(f"supervisor.{f.name}: {before} -> {after}")
    changes += _diff_named("node", {n.name: n for n in old.nodes},
                           {n.name: n for n in new.nodes})
    changes += _diff_named("model", {m.id: m for m in old.models},
                           {m.id: m for m in new.models})
    return changes


def _diff_named(kind: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    changes = [f"{kind} removed: {name}" for name in old if name not in new]
    changes += [f"{kind} added: {name}" for name in new if name not in old]
    for name in (n for n in new if n in old):
        for f in fields(new[name]):
            before = _show(f.name, getattr(old[name], f.name))
            after = _show(f.name, getattr(new[name], f.name))
            if before != after:
                changes.append(f"{kind} {name}: {f.name} {before} -> {after}")
    return changes


def _show(field_name: str, value: Any) -> str:
    """A field's value as fleet.yaml would spell it; order-insensitive where order means nothing."""
    if isinstance(value, CheckpointPaths):
        if value.all_nodes is not None and not value.by_node:
            return value.all_nodes
        return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(value.by_node)) + "}"
    if field_name == "placement":
        if not value:
            return "auto"
        return ", ".join(f"{s.node} {s.layer_range[0]}:{s.layer_range[1]}"
                         + (f" ({s.backend})" if s.backend else "") for s in value)
    if field_name == "replicas" and value == AUTO_REPLICAS:
        return "auto"
    if field_name in ("labels", "pins", "kernels"):
        return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}"
                               for k, v in sorted(value)) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return "none" if value is None else str(value)
