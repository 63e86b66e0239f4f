"""Reading a YAML document's nodes with their lines: typed scalars, mappings that refuse
unknown and duplicate keys with a suggestion, and errors that name the file, the line and
the field path (`fleet.yaml:23: models[0].context: expected a positive integer, got -5`).
fleet.yaml's schema (supervisor/fleet_config.py) is written on top of it.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import yaml

# A size: bytes as an integer, or a number and a unit ("4GiB", "1.5 GB", "512MiB").
SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|[kKMGT]B|B)?\s*$")
SIZE_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNSET = object()
# libyaml composes some 15x faster when present; its nodes carry the same marks.
COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class FleetConfigError(ValueError):
    """fleet.yaml is wrong somewhere: names the file, the line, the field path and the value."""

    def __init__(self, source: str, line: int, field: str, reason: str,
                 value: Any = _UNSET) -> None:
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")
        self.source, self.line, self.field, self.reason = source, line, field, reason
        self.value = None if value is _UNSET else value


class YamlField:
    """A YAML node and the field path that reached it, so that an error can name both."""

    def __init__(self, node: yaml.Node, path: str, source: str,
                 loader: yaml.SafeLoader | None = None) -> None:
        self.node, self.path, self.source = node, path, source
        # Only the loader's constructor is used: to build scalar values and resolve merges.
        self._loader = loader or yaml.SafeLoader("")
        self._children: dict[str, YamlField] = {}

    def _at(self, node: yaml.Node, path: str) -> YamlField:
        return YamlField(node, path, self.source, self._loader)

    @property
    def line(self) -> int:
        return self.node.start_mark.line + 1

    def error(self, reason: str, value: Any = _UNSET) -> FleetConfigError:
        return FleetConfigError(self.source, self.line, self.path, reason, value)

    def field(self, key: str) -> YamlField:
        """A child found by `mapping`; a key it lacks answers with this mapping's node."""
        return self._children.get(key) or self._at(self.node, self._join(key))

    def _join(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def mapping(self, known: tuple[str, ...], required: tuple[str, ...] = (),
                extensions: bool = False) -> dict[str, YamlField]:
        """Children by key; unknown, duplicate and missing keys are errors. With `extensions`,
        keys starting `x-` are skipped (a home for YAML anchors, as in docker compose)."""
        if not isinstance(self.node, yaml.MappingNode):
            raise self.error(f"expected a mapping, got {self.describe()}", self.value())
        try:
            self._loader.flatten_mapping(self.node)  # resolve `<<:` merges
        except yaml.MarkedYAMLError as exc:
            raise self.error(f"cannot merge: {exc.problem}") from exc
        out: dict[str, YamlField] = {}
        for key_node, value_node in self.node.value:
            key = self._at(key_node, self.path).string()
            child = self._at(value_node, self._join(key))
            if key in out:
                raise self._at(key_node, child.path).error(
                    f"duplicate key (first at line {out[key].line})", key)
            if extensions and key.startswith("x-"):
                continue
            if known and key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self._at(key_node, child.path).error(
                    f"unknown field{hint}; known fields: {', '.join(known)}", key)
            out[key] = child
        for key in required:
            if key not in out:
                raise self._at(self.node, self._join(key)).error("missing (required)")
        self._children = out
        return out

    def string_map(self) -> tuple[tuple[str, str], ...]:
        """A mapping of names to scalar values, both kept as text."""
        return tuple((key, child.string()) for key, child in self.mapping(known=()).items())

    def sequence(self) -> list[YamlField]:
        if not isinstance(self.node, yaml.SequenceNode):
            raise self.error(f"expected a list, got {self.describe()}", self.value())
        return [self._at(n, f"{self.path}[{i}]") for i, n in enumerate(self.node.value)]

    def value(self) -> Any:
        if not isinstance(self.node, yaml.ScalarNode):
            return None
        try:
            return self._loader.construct_object(self.node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError) as exc:  # `!!int x`, `!custom x`
            raise self.error(f"cannot read {self.node.value!r} as {self.node.tag}: {exc}",
                             self.node.value) from exc
        finally:
            self._loader.constructed_objects.clear()  # a cache keyed by node: keep nothing

    def describe(self) -> str:
        if isinstance(self.node, yaml.MappingNode):
            return "a mapping"
        if isinstance(self.node, yaml.SequenceNode):
            return "a list"
        value = self.value()
        return "nothing (null)" if value is None else repr(value)

    def string(self) -> str:
        """Scalar text. Numbers keep their spelling (`1.10`, `10:30`); null and booleans are
        refused, since YAML turns `no`, `on` or `~` into something that is not the text."""
        if not isinstance(self.node, yaml.ScalarNode):
            raise self.error(f"expected a string, got {self.describe()}")
        value = self.value()
        if value is None or isinstance(value, bool):
            raise self.error(f"expected a string, got {self.describe()}"
                             + (" (quote it: YAML reads it as a boolean)" if value is not None else ""),
                             value)
        text = value if isinstance(value, str) else self.node.value
        if not text.strip():
            raise self.error("expected a non-empty string", text)
        return text

    def name(self, what: str) -> str:
        text = self.string()
        if not NAME_PATTERN.match(text):
            raise self.error(f"{what} {text!r} must be letters, digits, '.', '_' or '-' "
                             "(starting with a letter or digit)", text)
        return text

    def integer(self, minimum: int = 1) -> int:
        value = self.value()
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(f"expected {kind}, got {self.describe()}", value)
        return value

    def size(self) -> int:
        """Bytes >= 0: an integer, or a number with a unit (`4GiB`, `1.5 GB`, `512MiB`;
        kB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB of 1024)."""
        value = self.value()
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = self.node.value if isinstance(self.node, yaml.ScalarNode) else ""
        match = SIZE_PATTERN.match(text) if isinstance(value, (str, float)) else None
        if match and match[2] is None and "." in match[1]:
            match = None  # a fraction of a byte: a unit was meant
        if not match:
            raise self.error(f"expected a size in bytes (an integer >= 0, or a number and "
                             f"one of {', '.join(SIZE_UNITS)}, e.g. 4GiB), got "
                             f"{self.describe()}", value)
        return int(float(match[1]) * SIZE_UNITS[match[2] or "B"])

    def word(self, options: tuple[str, ...], what: str) -> str:
        """One of `options` as written: YAML 1.1 would read `off` and `on` as booleans."""
        value = self.node.value if isinstance(self.node, yaml.ScalarNode) else None
        if value not in options:
            shown = repr(value) if value is not None else self.describe()
            raise self.error(f"unknown {what} {shown} (expected one of {', '.join(options)})",
                             value)
        return value

    def choice(self, options: tuple[str, ...], what: str = "value") -> str:
        text = self.string()
        if text not in options:
            raise self.error(f"unknown {what} {text!r} (expected one of {', '.join(options)})",
                             text)
        return text
