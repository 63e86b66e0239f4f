"""The packages import in one direction: every module's imports, read from its AST, against
the layers in docs/layering.md; the supervisor's loop imports nothing that stands beside
it; and the supervisor starts without a framework."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The engine's layers, lowest first: a module may import its own layer and those below,
# never one above. The most specific prefix names a module's layer.
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    # The shared vocabulary: names, rounds, slots, the sampling rule's types, the model's
    # config and checkpoint format, the hop choice, the link's error tree.
    ("engine", "engine.addresses", "engine.backend_names", "engine.hop_choice",
     "engine.rounds", "engine.slots", "engine.kv_pages", "engine.sampling", "engine.logs", "engine.signals",
     "engine.heap",
     "engine.config",
     "engine.family", "engine.families", "engine.row_format", "engine.checkpoint", "engine.link.errors",
     "engine.draft_head"),  # the draft head's contract: what a backend's head offers
    ("engine.link",),  # the wire: frames, messages, handshake, sockets
    ("engine.env",),  # the stage contract (reads the handshake's default deadline)
    ("engine.backends",),  # one layer range on one framework
    ("engine.pipeline",),  # rounds over a ring of stages
    ("engine.lanes",),  # rank 0's streams: tokens, admission, sampling per stream
    ("engine.api",),  # rank 0's HTTP API
    ("engine.harness", "engine.main"),  # what starts and drives engines
)
# Whole packages: engine below agent below supervisor.
PACKAGES = ("engine", "agent", "supervisor")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, lazy and TYPE_CHECKING ones included:
    each is a dependency all the same."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                package = package if is_package else package[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            out.append((node.lineno, base))
    return out


def layer_of(module: str) -> int | None:
    best, layer = -1, None
    for i, names in enumerate(ENGINE_LAYERS):
        for name in names:
            # "engine" itself is the package's __init__ alone, not every module under it.
            inside = module.startswith(name + ".") and name != "engine"
            if (module == name or inside) and len(name) > best:
                best, layer = len(name), i
    return layer


def violations(root: Path) -> list[str]:
    """Every import under `root` that goes up a layer, as "file:line: what is wrong"."""
    found = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            tree = ast.parse(path.read_text(), str(path))
            for line, target in imported(tree, module, path.name == "__init__.py"):
                where = f"{path.relative_to(root)}:{line}: {module} imports {target}"
                mine, theirs = module.split(".")[0], target.split(".")[0]
                if theirs in PACKAGES and PACKAGES.index(theirs) > PACKAGES.index(mine):
                    found.append(f"{where}: {mine} sits below {theirs}")
                elif mine == theirs == "engine":
                    low, high = layer_of(module), layer_of(target)
                    if low is None or high is None:
                        found.append(f"{where}: "
                                     f"{module if low is None else target} has no layer")
                    elif high > low:
                        found.append(f"{where}: {ENGINE_LAYERS[low][0]} (layer {low}) may "
                                     f"not import {ENGINE_LAYERS[high][0]} (layer {high})")
    return found


def test_every_import_goes_down_a_layer_or_stays() -> None:
    assert violations(ROOT) == []


def test_the_check_names_an_upward_import(tmp_path: Path) -> None:
    for name, text in {
        "engine/__init__.py": "",
        "engine/link/__init__.py": "",
        "engine/link/messages.py": "from engine.backends.base import Stage\n",
        "engine/backends/__init__.py": "",
        "engine/backends/base.py": "from ..rounds import RoundPlan\nimport engine.nowhere\n",
        "engine/rounds.py": "",
        "agent/__init__.py": "",
        "agent/spawn.py": "",
        "supervisor/__init__.py": "",
        "supervisor/main.py": "from agent.spawn import EngineSpec\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "engine/pipeline.py").write_text("import supervisor.main\n")
    assert violations(tmp_path) == [
        ("engine/backends/base.py:2: engine.backends.base imports engine.nowhere: "
        "engine.nowhere has no layer"),
        ("engine/link/messages.py:1: engine.link.messages imports engine.backends.base: "
        "engine.link (layer 1) may not import engine.backends (layer 3)"),
        ("engine/pipeline.py:1: engine.pipeline imports supervisor.main: "
        "engine sits below supervisor"),
    ]


# Beside the supervisor's loop, never under it: agent intake, operator commands and views
# work on the loop's state and step it; the loop imports none of them (docs/supervisor.md).
BESIDE_THE_LOOP = ("supervisor.intake", "supervisor.operator_commands", "supervisor.views",
                   "supervisor.app")


def loop_imports_beside(text: str) -> list[str]:
    """control_loop's imports of a module beside it, `from supervisor import views` too."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [f"control_loop.py:{node.lineno}: imports {name}"
                  for name in names if name in BESIDE_THE_LOOP]
    return found


def test_the_supervisors_loop_imports_nothing_beside_it() -> None:
    assert loop_imports_beside((ROOT / "supervisor" / "control_loop.py").read_text()) == []
    # and the check sees both spellings of such an import
    assert loop_imports_beside("from supervisor import lifecycle, views\n"
                               "import supervisor.intake\n") == [
        "control_loop.py:1: imports supervisor.views",
        "control_loop.py:2: imports supervisor.intake"]


# What a supervisor machine need not load: it plans and routes, it runs no model. (numpy it
# does use: the placement's prompt search, supervisor.prompt_search, is vectorised.)
HEAVY = ("torch", "mlx", "safetensors")
# The supervisor's entry points, and the agent modules it imports.
SUPERVISOR_MODULES = ("supervisor.main", "supervisor.fleetctl", "agent.spawn", "agent.pki",
                      "agent.tls", "agent.mtls_api")


def loaded_by(modules: tuple[str, ...]) -> list[str]:
    script = ("import importlib, json, sys\n"
              f"for name in {list(modules)!r}:\n"
              "    importlib.import_module(name)\n"
              "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_the_supervisor_loads_no_framework() -> None:
    heavy = sorted({m.split(".")[0] for m in loaded_by(SUPERVISOR_MODULES)} & set(HEAVY))
    assert heavy == []


def test_the_engine_does_load_them() -> None:
    # The check above reads sys.modules the way this one does; here it must see them.
    assert {"safetensors", "torch"} <= set(loaded_by(("engine.checkpoint.reader",
                                                        "engine.backends.pytorch.stage")))
