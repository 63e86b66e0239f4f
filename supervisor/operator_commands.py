"""fleetctl's commands: a request answered with plans and outages, apart from the loop's tick.

Apply, plan, drain, revoke and rebalance each change the desired state or a member, then
call the loop's `step` once; what a change would stop serving is the lifecycle's own pure
decision run on the changed snapshot (`outages`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from supervisor import lifecycle as lc
from supervisor.checkpoints import read_shape
from supervisor.control_loop import Supervisor
from supervisor.fleet_config import FleetConfig, FleetConfigError, diff, parse_fleet_config
from supervisor.hops import planned_hops
from supervisor.memory import ModelShape
from supervisor.planning import plan_replicas, spec_digest
from supervisor.request_error import RequestError


def parse(text: str, source: str) -> FleetConfig:
    """A `fleet.yaml` as fleetctl sent it; a 422 naming the field and line if it is wrong."""
    try:
        return parse_fleet_config(text, source)
    except FleetConfigError as exc:
        raise RequestError(422, str(exc), field=exc.field, line=exc.line,
                           source=exc.source) from exc


def what_changes(old: FleetConfig | None, new: FleetConfig) -> tuple[list[str], set[str]]:
    """(the changes an apply of `new` over `old` makes, for the operator to read; the ids
    of the models whose spec changed, the only ones planned again)."""
    if old is None:
        return [f"first apply: {len(new.models)} model(s), {len(new.nodes)} node(s)"], {
            m.id for m in new.models}
    before = {m.id: spec_digest(m) for m in old.models}
    return diff(old, new), {m.id for m in new.models if before.get(m.id) != spec_digest(m)}


def plans(supervisor: Supervisor, config: FleetConfig,
          only: set[str] | None = None) -> list[dict[str, Any]]:
    """The placement each model of `config` would get now (or why none), changing nothing."""
    out = []
    for spec in config.models:
        if only is not None and spec.id not in only:
            continue
        shape = read_shape(spec)
        if not isinstance(shape, ModelShape):
            out.append({"model": spec.id, "error": shape})
            continue
        plan = plan_replicas(spec, shape, config, supervisor.members,
                             supervisor.measurer.snapshot(), spec.replicas)
        if not plan.placements:
            out.append({"model": spec.id, "error": plan.error})
            continue
        first = plan.placements[0]
        out.append({"model": spec.id, "ring": list(first.ring), "note": plan.note,
                    "placement": planned_hops(first.to_dict(), spec.hop_transport)})
        if len(plan.placements) > 1:  # placed together: every replica's placement
            out[-1]["replicas"] = [planned_hops(p.to_dict(), spec.hop_transport)
                                   for p in plan.placements]
    return out


def apply_desired(supervisor: Supervisor, text: str, source: str, *, dry_run: bool = False,
                  force: bool = False) -> dict[str, Any]:
    """`fleetctl apply`: the diff, the plans and the outages; applied unless it is a dry
    run, or a model fits nowhere and it is not forced."""
    new = parse(text, source)
    changes, changed = what_changes(supervisor.desired, new)
    planned = plans(supervisor, new, changed)
    stops = outages(replace(supervisor.snapshot(), desired=new))
    errors = [p for p in planned if "error" in p]
    if errors and not force and not dry_run:
        raise RequestError(422, "; ".join(p["error"] for p in errors) +
                           " (nothing was changed; --force applies it anyway)",
                           changes=changes)
    if not dry_run and changes:
        supervisor.state.set_desired(text, source)
        supervisor.desired = new
        supervisor.shapes = {}
        supervisor.event("apply", f"applied {source}: " + ("; ".join(changes) or "no change"))
        supervisor.step()
    return {"changes": changes, "plans": planned, "applied": not dry_run and bool(changes),
            "outages": stops}


def revoke(supervisor: Supervisor, node: str) -> dict[str, Any]:
    """Forget a member and refuse its certificate from now on, so that the name can be
    joined again (a new machine, a lost key). Its replicas fail over as for a lost node."""
    if node not in supervisor.members and supervisor.state.pin(node) is None:
        raise unknown_node(supervisor, node)
    fingerprint = supervisor.state.revoke(node)
    supervisor.members.pop(node, None)
    supervisor.event("revoke", f"{node} revoked" + (
        f" (certificate {fingerprint[:16]}… refused from now on)" if fingerprint else ""),
        node=node)
    supervisor.step()
    return {"node": node, "revoked_certificate": fingerprint or ""}


def drain_node(supervisor: Supervisor, node: str, undo: bool = False) -> dict[str, Any]:
    """Cordon `node` (its replicas move, make before break where there is room), or undo it."""
    member = supervisor.members.get(node)
    if member is None:
        raise unknown_node(supervisor, node)
    members = dict(supervisor.members, **{node: replace(member, cordoned=not undo)})
    stops = outages(replace(supervisor.snapshot(), members=members))
    supervisor.put_member(replace(member, cordoned=not undo))
    supervisor.event("drain", f"{node} {'uncordoned' if undo else 'cordoned: its replicas move'}",
                     node=node)
    supervisor.step()
    return {"node": node, "cordoned": not undo, "outages": stops}


def rebalance(supervisor: Supervisor) -> dict[str, Any]:
    """A planned re-placement of every replica whose best placement changed."""
    supervisor.measurer.forget_failures()  # tried again: a rebalance is when they matter
    snapshot = supervisor.snapshot()
    stops = outages(replace(snapshot, rebalance_epoch=snapshot.rebalance_epoch + 1))
    epoch = supervisor.state.bump_rebalance_epoch()
    supervisor.event("rebalance", f"rebalance {epoch} asked")
    supervisor.step()
    return {"rebalance_epoch": epoch, "outages": stops}


def remeasure(supervisor: Supervisor, nodes: list[str]) -> dict[str, Any]:
    """Calibrate `nodes` again (every member when none is named), and probe their links:
    for a machine whose speed changed under the fleet (other work on it, a new driver, a
    cooler room). Replicas keep their placement; `fleetctl status` predicts from the new
    figures, and a rebalance places by them."""
    if supervisor.settings.calibration_budget_s <= 0:
        raise RequestError(409, "measuring is off (--calibration-budget-s 0): placement uses "
                           "nominal numbers")
    for node in nodes:
        if node not in supervisor.members:
            raise unknown_node(supervisor, node)
    chosen = sorted(set(nodes) or set(supervisor.members))
    keys = supervisor.measurer.remeasure(set(chosen), "asked by the operator")
    supervisor.event("measure", f"measuring again, as asked: {', '.join(chosen) or 'no node'}"
                     + ("" if keys else " (nothing measured there yet)"))
    supervisor.step()
    return {"nodes": chosen, "measuring": keys}


def outages(changed: lc.Snapshot) -> list[dict[str, Any]]:
    """What a change would stop serving (no room to make before break), for fleetctl to
    say before it is made; each with its reason and how long at most."""
    return [dict(vars(o), max_s=o.max_s, text=o.text()) for o in lc.outages(changed)]


def unknown_node(supervisor: Supervisor, node: str) -> RequestError:
    """A 404 for a node that is not a member, naming those that are."""
    known = ", ".join(sorted(supervisor.members)) or "none yet"
    return RequestError(404, f"unknown node {node!r} (members: {known})", field="node")
