"""The route table: everything the front door needs to route a request, as one frozen
snapshot the supervisor builds (`Supervisor.route_table`) and sends to a front door of its
own process (`GET /v1/routes`), and the one routing rule both front doors run over it.

Which models the fleet serves, each one's serving replicas that take requests (rank 0's URL,
its API secret, its slots and how many its `/health` last said were taken), why a model has
none, the replicas failed lately (their relays end), and the client API keys. A table read
from the wire or from disk is checked field by field (`RouteTableError` names the field), so
a garbled answer never replaces a good table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from supervisor.affinity import preferred
from supervisor.front_door import ReplicaLoad, Route, by_free_slots
from supervisor.relays import Relays

VERSION = 1


class RouteTableError(ValueError):
    """A route table that is not one: the message names the field and what was wrong."""


@dataclass(frozen=True)
class ReplicaRoute:
    """One serving replica that takes requests, as the front door reaches it."""

    replica: str
    url: str  # rank 0's base URL, e.g. http://10.0.0.2:8000
    api_secret: str = ""
    slots_in_use: int = 0  # as rank 0's /health last said


@dataclass(frozen=True)
class ModelRoutes:
    id: str
    parallel: int = 1  # streams each replica's rank 0 serves at once
    serving: bool = False  # some replica is serving (draining ones included): /v1/models
    replicas: tuple[ReplicaRoute, ...] = ()  # serving and taking requests
    unavailable: str = ""  # why no replica takes requests, for the client's 503


@dataclass(frozen=True)
class RouteTable:
    models: tuple[ModelRoutes, ...] = ()
    api_keys: frozenset[str] = frozenset()
    failed: tuple[tuple[str, str], ...] = ()  # (replica, reason): their relays end

    def model(self, model_id: str) -> ModelRoutes | None:
        return next((m for m in self.models if m.id == model_id), None)

    def route(self, model: str | None, relays: Relays, turn: int,
              conversation: str | None = None) -> Route:
        """Where a request for `model` goes: the replicas by free slots (relays open here
        or slots rank 0 said were taken, the more of the two), the one that holds the
        `conversation` (supervisor.affinity) first while it has a free slot; or why nowhere."""
        ids = ", ".join(m.id for m in self.models) or "none"
        if model is None:
            return Route(status=400, message=f"'model' is required (models: {ids})")
        entry = self.model(model)
        if entry is None:
            return Route(status=404, message=f"model {model!r} is not served by this fleet "
                         f"(models: {ids})")
        if not entry.replicas:
            return Route(status=503, message=entry.unavailable
                         or f"model {model!r} has no serving replica now; retry shortly")
        by_id = {r.replica: r for r in entry.replicas}
        loads = [ReplicaLoad(r.replica, entry.parallel,
                             max(relays.open_count(r.replica), r.slots_in_use))
                 for r in entry.replicas]
        order = by_free_slots(loads, turn)
        if conversation is not None:
            free = [load.replica for load in order if load.free > 0]
            if free:
                chosen = preferred(free, conversation)
                order.sort(key=lambda load: load.replica != chosen)  # stable: the rest stay
        routes = [Route(url=by_id[load.replica].url, replica=load.replica,
                        api_secret=by_id[load.replica].api_secret) for load in order]
        return replace(routes[0], fallbacks=tuple(routes[1:]))

    def model_entries(self) -> list[dict[str, Any]]:
        """/v1/models."""
        return [{"id": m.id, "object": "model", "owned_by": "ringfleet", "serving": m.serving}
                for m in self.models]

    def without_loads(self) -> RouteTable:
        """The table less what changes every health check: what is worth keeping on disk."""
        return replace(self, models=tuple(replace(m, replicas=tuple(
            replace(r, slots_in_use=0) for r in m.replicas)) for m in self.models))

    # --- the wire and the file --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, "api_keys": sorted(self.api_keys),
                "failed": [list(f) for f in self.failed],
                "models": [{"id": m.id, "parallel": m.parallel, "serving": m.serving,
                            "unavailable": m.unavailable,
                            "replicas": [{"replica": r.replica, "url": r.url,
                                          "api_secret": r.api_secret,
                                          "slots_in_use": r.slots_in_use}
                                         for r in m.replicas]} for m in self.models]}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RouteTable:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouteTableError(f"not JSON: {exc}") from None
        return cls.from_dict(body)

    @classmethod
    def from_dict(cls, body: Any) -> RouteTable:
        top = _object(body, "the table")
        if top.get("version") != VERSION:
            raise RouteTableError(f"version: {top.get('version')!r}, expected {VERSION}")
        keys = _list(top, "api_keys", "the table")
        failed = _list(top, "failed", "the table")
        models = []
        for i, raw in enumerate(_list(top, "models", "the table")):
            where = f"models[{i}]"
            entry = _object(raw, where)
            replicas = []
            for j, raw_replica in enumerate(_list(entry, "replicas", where)):
                at = f"{where}.replicas[{j}]"
                r = _object(raw_replica, at)
                url = _text(r, "url", at)
                if not url.startswith(("http://", "https://")):
                    raise RouteTableError(f"{at}.url: {url!r} is not an http(s) URL")
                replicas.append(ReplicaRoute(_text(r, "replica", at, empty=False), url,
                                             _text(r, "api_secret", at),
                                             _count(r, "slots_in_use", at)))
            parallel = _count(entry, "parallel", where)
            if parallel < 1:
                raise RouteTableError(f"{where}.parallel: {parallel}, expected at least 1")
            serving = entry.get("serving")
            if not isinstance(serving, bool):
                raise RouteTableError(f"{where}.serving: {serving!r}, expected true or false")
            models.append(ModelRoutes(_text(entry, "id", where, empty=False), parallel, serving,
                                      tuple(replicas), _text(entry, "unavailable", where)))
        if len({m.id for m in models}) != len(models):
            raise RouteTableError("models: a model id appears twice")
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key:
                raise RouteTableError(f"api_keys[{i}]: expected a non-empty string")
        pairs = []
        for i, pair in enumerate(failed):
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(x, str) for x in pair)):
                raise RouteTableError(f"failed[{i}]: expected [replica, reason]")
            pairs.append((pair[0], pair[1]))
        return cls(tuple(models), frozenset(keys), tuple(pairs))


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RouteTableError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _list(body: dict[str, Any], name: str, where: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list):
        raise RouteTableError(f"{where}: {name!r} must be a list, got {value!r:.60}")
    return value


def _text(body: dict[str, Any], name: str, where: str, *, empty: bool = True) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not (empty or value):
        what = "a string" if empty else "a non-empty string"
        raise RouteTableError(f"{where}.{name}: expected {what}, got {value!r:.60}")
    return value


def _count(body: dict[str, Any], name: str, where: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RouteTableError(f"{where}.{name}: expected a count, got {value!r:.60}")
    return value
