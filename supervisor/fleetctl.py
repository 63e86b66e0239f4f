"""`fleetctl`: drive the fleet's supervisor (init, token, apply, plan, status, drain, rebalance,
remeasure, revoke).

It talks to the supervisor over mutual TLS with its own `admin` certificate, which
`fleetctl init` writes (with the CA and the supervisor's URL) to its credentials directory:
`--credentials DIR`, else $FLEETCTL_DIR, else one directory per fleet under
~/.config/ringfleet/fleetctl/fleets/ (see `credentials_dir`), so that two fleets on one
machine keep their certificates apart.
Exit codes: 0 done, 1 the supervisor refused, 2 bad input here, 3 supervisor unreachable.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent.pki import MissingCredentials, NodeCredentials, PkiError
from supervisor.fleet_config import FleetConfigError, load_fleet_config
from supervisor.hops import hops_text, planned_hops_text
from supervisor.memory import format_bytes

# Tables are wide: keep them whole when the output is a pipe or a file.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)
STATE_STYLE = {"serving": "green", "alive": "green", "warming": "cyan", "starting": "cyan",
               "placing": "yellow", "draining": "yellow", "cordoned": "yellow", "suspect": "yellow",
               "failed": "red", "dead": "red", "left": "dim", "stopped": "dim"}


POLL_S = 0.5  # apply's wait for the measurements its placement needs


class CtlError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def default_dir() -> Path:
    """Where every fleet's credentials live (the old single-fleet location is this itself)."""
    return Path.home() / ".config/ringfleet/fleetctl"


def fleet_name(address: str) -> str:
    """A fleet's default name: its supervisor's HOST:PORT as a file name ("10.0.0.5_7400")."""
    from urllib.parse import urlsplit

    netloc = urlsplit(address).netloc if "//" in address else address
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", netloc.strip("/")).strip("_")
    if not name:
        raise CtlError(f"{address!r}: expected HOST:PORT or https://HOST:PORT", 2)
    return name


def credentials_dir(base: Path, *, fleet: str | None, supervisor: str | None,
                    init_address: str | None = None) -> Path:
    """The credentials directory of the fleet asked for, under `base`: `base/fleets/NAME`,
    NAME being `--fleet`, else `init`'s address or `--supervisor`'s HOST:PORT; with none of
    them, the one fleet there is. `base` itself (where fleetctl kept one fleet's credentials
    before fleets were kept apart) is read when no fleet directory answers."""
    fleets = base / "fleets"
    if fleet or init_address:
        return fleets / fleet_name(fleet or init_address or "")
    old = NodeCredentials(base).exist()
    if supervisor:
        found = fleets / fleet_name(supervisor)
        return base if old and not found.is_dir() else found
    known = sorted(p.name for p in fleets.iterdir() if p.is_dir()) if fleets.is_dir() else []
    if len(known) == 1:
        return fleets / known[0]
    if len(known) > 1:
        raise CtlError(f"credentials for several fleets in {fleets} ({', '.join(known)}): "
                       "pass --fleet NAME or --supervisor URL", 2)
    return base  # the old location, or nothing yet: Client says to run `fleetctl init`


class Client:
    def __init__(self, credentials: Path, url: str | None) -> None:
        creds = NodeCredentials(credentials)
        try:
            creds.check()
        except MissingCredentials as exc:
            raise CtlError(f"no fleetctl credentials in {credentials} (run `fleetctl init` on "
                           "the supervisor's machine, or pass --credentials DIR)", 2) from exc
        except PkiError as exc:
            raise CtlError(f"{credentials}: {exc}", 2) from exc
        if url is None:
            path = credentials / "supervisor_url"
            url = path.read_text().strip() if path.exists() else None
        if not url:
            raise CtlError("no supervisor URL: pass --supervisor https://HOST:PORT", 2)
        self.url = url.rstrip("/")
        self.ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(creds.ca_path))
        self.ctx.check_hostname = False
        self.ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.ctx, timeout=60) as reply:
                return json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"{}")
            except ValueError:
                payload = {}
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            raise CtlError(error.get("message") or f"{exc.code} {exc.reason}", 1) from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CtlError(f"cannot reach the supervisor at {self.url}: {reason}", 3) from exc


def styled(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"


def read_fleet_file(path: Path) -> str:
    """Validate locally first: a bad file gets its named error without a round trip."""
    load_fleet_config(path)
    return path.read_text(encoding="utf-8")


def show_status(data: dict[str, Any]) -> None:
    if not data["members"]:
        out.print("no nodes have joined yet (`fleetctl token --node NAME`, then `fleet-agent join`)")
    nodes = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "seen", "platform", "RAM", "backends", "engines", "url"):
        nodes.add_column(col)
    for m in data["members"]:
        state = styled(m["state"])  # draining, then cordoned, for an alive cordoned node
        if m["cordoned"] and m["state"] not in ("draining", "cordoned"):
            state += " [yellow](cordoned)[/]"  # suspect, dead: cordoned as well
        ram = format_bytes(m["ram_total_bytes"]) if m.get("ram_total_bytes") else "?"
        engines = ", ".join(f"{k}: {v}" for k, v in m["engines"].items()) or "-"
        nodes.add_row(m["node"], state, f"{m['seen_s_ago']} s ago",
                      f"{m.get('platform') or '?'}/{m.get('arch') or '?'}", ram,
                      ", ".join(m["backends"]) or "?", engines, m["url"])
    if data["members"]:
        out.print(nodes)
    ended = [r for r in data["replicas"] if r["state"] in ("stopped", "failed")]
    if ended:
        history = Table(title="earlier replicas", title_justify="left")
        for col in ("replica", "state", "stages", "why"):
            history.add_column(col)
        for r in ended:
            stages = ", ".join(f"{s['node']} {s['layer_range'][0]}:{s['layer_range'][1]}"
                               for s in r["stages"]) or "-"
            history.add_row(r["id"], styled(r["state"]), stages, r["reason"] or "-")
        out.print(history)
    for r in (r for r in data["replicas"] if r not in ended):
        health = "healthy" if r["healthy"] else "not answering"
        title = (f"replica {r['id']} ({r['model_id']}): {styled(r['state'])}"
                 + (f", {health}" if r["state"] in ("warming", "serving") else "")
                 + (f" ({d['in_flight']} in flight, {d['seconds_left']} s left)"
                    if (d := r.get("drain")) else ""))
        if not r["stages"]:
            out.print(title + (f": {r['reason']}" if r["reason"] else ""))
            continue
        table = Table(title=title, title_justify="left",
                      caption=(f"rank 0: {r['url'] or '-'} (behind the front door: it needs the "
                               f"replica's secret); placement {r['placement_id'] or '-'}"
                               + (f"\n{hops_text(r['hops'])}" if r.get("hops") else "")
                               + (f"\n{r['reason']}" if r["reason"] else "")
                               + (f"\n{r['note']}" if r.get("note") else "")
                               + (f"\n{line}" if (line := speed_line(r.get("speed"))) else "")
                               + f"\n{prompt_cache_line(r)}"),
                      caption_justify="left")
        for col in ("rank", "node", "backend", "layers", "engine", "listen", "cache held",
                    "resident / weights"):
            table.add_column(col)
        held = {st["rank"]: st["bytes_held"]
                for st in (r.get("prompt_cache") or {}).get("stages", ())}
        for s in r["stages"]:
            budget = s.get("prompt_cache_budget_bytes") or 0
            table.add_row(str(s["rank"]), s["node"], s["backend"],
                          f"{s['layer_range'][0]}:{s['layer_range'][1]}", s["engine_id"],
                          f"{s['host']}:{s['listen_port']}",
                          (format_bytes(held[s["rank"]]) if s["rank"] in held else "?")
                          + (f" of {format_bytes(budget)}" if budget else ""),
                          resident_text(s))
        out.print(table)
    if not data["replicas"]:
        out.print("no replicas" + ("" if data["models"] else " (nothing applied yet)"))
    out.print(f"front door: {data['front_door'] or 'fleet-front-door (its own process)'}")


def resident_text(stage: dict[str, Any]) -> str:
    """A stage's resident set against its weights' bytes, as its agent last reported them:
    "1.1 GB / 832.2 MB (1.3x)"; "?" for what was not reported."""
    resident, weights = stage.get("resident_bytes"), stage.get("weights_bytes")
    text = (f"{format_bytes(resident) if resident else '?'} / "
            f"{format_bytes(weights) if weights else '?'}")
    return text + (f" ({resident / weights:.1f}x)" if resident and weights else "")


def prompt_cache_line(r: dict[str, Any]) -> str:
    """A replica's prompt cache for `fleetctl status`: its kept slots, the pool of KV pages
    they share with the streams on every stage, and what rank 0's /health counts
    (conversations held, hits, misses, tokens reused)."""
    line = f"prompt cache: {r.get('prompt_cache_slots', 0)} kept slot(s)"
    if pool := r.get("kv_pool"):
        line += (f" in a KV pool of {pool['pages']} pages ({pool['positions']} positions) "
                 "a stage")
    figures = r.get("prompt_cache")
    if not figures:
        return line + " (rank 0 has not reported its figures)"
    line += (f", {figures['held']} holding a conversation; {figures['hits']} hit(s), "
             f"{figures['misses']} miss(es), {figures['reused_tokens']} token(s) reused")
    if pages := figures.get("kv_pages"):
        line += (f"; {pages['in_use']} of {pages['pool']} KV pages in use, {pages['kept']} "
                 "by kept conversations")
    return line


def render_plan(p: dict[str, Any]) -> Table:
    """A placement (`Placement.to_dict`) as `fleetctl plan` shows it: one row per stage,
    predictions, and why. "extras" are the row buffers, plus on rank 0 the embeddings, final
    norm, head and logits. A model whose layers differ by type (a hybrid) also shows each
    stage's layers by type, the recurrent state its DeltaNet layers keep, and each node's
    calibrated ms per layer of each type."""
    ring = [s["node"] for s in p["stages"]]
    typed = any(len(s.get("layer_type_counts") or ()) > 1 for s in p["stages"])
    table = Table(title=f"{p['model_id']}: {' -> '.join(ring)} -> {ring[0]}"
                  + (" (explicit)" if p["explicit"] else ""), title_justify="left")
    columns = ["rank", "node", "backend", "layers", *(["by type"] if typed else []),
               "weights", "KV", *(["state"] if typed else []), "extras", "cache", "total",
               "usable",
               "decode ms", "hop ms", "chunk ms", "chunk hop ms"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("node", "backend", "by type")
                         else "right")
    for s in p["stages"]:
        m = s["memory"]
        by_type = [", ".join(f"{count} {name}" for name, count in s["layer_type_counts"])]
        table.add_row(str(s["rank"]), s["node"], s["backend"],
                      f"{s['layer_range'][0]}:{s['layer_range'][1]}",
                      *(by_type if typed else []),
                      format_bytes(m["weights_bytes"]), format_bytes(m["kv_bytes"]),
                      *([format_bytes(m.get("state_bytes", 0))] if typed else []),
                      format_bytes(m["rank0_extras_bytes"] + m["staging_bytes"]),
                      cache_cell(p, s),
                      format_bytes(m["total_bytes"]), format_bytes(s["usable_memory_bytes"]),
                      f"{s['decode_ms']:.2f}", f"{s['hop_decode_ms']:.2f}",
                      f"{s['prefill_chunk_ms']:.1f}", f"{s['hop_chunk_ms']:.1f}")
    summary = (f"decode: {p['decode_ms_per_token']:.2f} ms per token at {p['parallel']} "
               f"stream(s), {p['decode_ms_per_token_single']:.2f} ms alone; time to first "
               f"token of a {p['prompt_tokens']}-token prompt: {p['prompt_ms']:.0f} ms; "
               f"objective: {p['objective']}")
    per_type = [f"{s['node']} ms per layer (decode 1 row / {p['parallel']} rows / chunk): "
                + "; ".join(f"{t['layer_type']} {t['decode_ms_per_layer']:.3g} / "
                            f"{t['decode_batch_ms_per_layer']:.3g} / "
                            f"{t['prefill_ms_per_layer']:.3g}" for t in s["layer_type_ms"])
                for s in p["stages"]] if typed else []
    hops = [planned_hops_text(p["hops"])] if p.get("hops") else []
    head = [f"rank 0's final norm, head and sampling: {p['head_ms']:.2f} ms of each round"
            ] if p.get("head_ms") else []
    table.caption = "\n".join([summary, *head, *hops, *per_type, *p["why"]])
    table.caption_justify = "left"
    return table


def cache_cell(p: dict[str, Any], s: dict[str, Any]) -> str:
    """What a stage's kept slots hold (KV counts them too), and the budget that bought them."""
    held = format_bytes(p.get("prompt_cache_slots", 0) * s.get("prompt_cache_slot_bytes", 0))
    budget = s.get("prompt_cache_budget_bytes") or 0
    return held + (f" of {format_bytes(budget)}" if budget else "")


def show_apply(args: argparse.Namespace, data: dict[str, Any]) -> int:
    """The diff, then each model's placement; `plan` exits 1 when a model has none."""
    refused = sum(1 for plan in data.get("plans", []) if "error" in plan)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for line in data.get("changes", []):
            out.print(f"  {line}", markup=False)
        if args.command == "apply" and not data.get("changes"):
            out.print("no change")
        for plan in data.get("plans", []):
            if "error" in plan:
                error = plan["error"]  # the supervisor's errors name the model already
                named = error.startswith(f"{plan['model']}:")
                err.print(error if named else f"{plan['model']}: {error}", markup=False)
            else:
                if args.command == "apply" and is_provisional(plan["placement"]):
                    out.print("[yellow]provisional[/]: placed on nominal numbers while the "
                              "nodes are measured; the supervisor places again once the "
                              "measurements land")
                replicas = plan.get("replicas") or [plan["placement"]]
                for i, placement in enumerate(replicas):
                    if len(replicas) > 1:
                        out.print(f"replica {i + 1} of {len(replicas)}:")
                    out.print(render_plan(placement))
        if args.command == "apply" and data.get("changes"):
            out.print("applied" if data.get("applied") else "not applied (dry run)")
        warn_outages(data)
    return 1 if args.command == "plan" and refused else 0


def warn_outages(data: dict[str, Any]) -> None:
    """Say when a change stops serving (no room to start the new replica beside the old),
    why, and for how long at most; the supervisor forecasts it (lifecycle.outages)."""
    for outage in data.get("outages", ()):
        err.print(f"[yellow]warning[/]: {escape(outage['text'])}")


def is_provisional(placement: dict[str, Any]) -> bool:
    """Was the placement searched with a nominal input (a node not calibrated, a link not
    probed)? Then the one that runs may differ (planning.py names every nominal input)."""
    return any(line.startswith(("not calibrated", "not probed")) for line in placement["why"])


# A measurement this far off its prediction, over this many rounds, gets a hint: the likely
# cause is a node whose speed changed since it was calibrated (other work on the machine).
FAR_OFF_PCT, FAR_OFF_ROUNDS = 20.0, 20


def speed_line(speed: dict[str, Any] | None) -> str:
    """A replica's predicted and measured decode ms per token, for `status`."""
    if not speed:
        return ""
    parts = []
    if "predicted_ms_per_token" in speed:
        parts.append(f"predicted {speed['predicted_ms_per_token']:.2f} alone, "
                     f"{speed['predicted_ms_per_token_parallel']:.2f} at {speed['parallel']} "
                     "streams" + (" (on nominal inputs)" if speed.get("nominal") else ""))
    elif speed.get("no_prediction"):
        parts.append(f"no prediction: {speed['no_prediction']}")
    for rows, seen in speed.get("measured", {}).items():
        error = (f", {seen['error_pct']:+.1f} % off" if "error_pct" in seen else "")
        parts.append(f"measured {seen['ms_per_token']:.2f} at {rows} stream(s) "
                     f"({seen['rounds']} rounds{error})")
    if not speed.get("measured"):
        parts.append("measured: no decode rounds yet")
    line = "decode ms/token: " + "; ".join(parts)
    if any(abs(seen.get("error_pct", 0.0)) >= FAR_OFF_PCT and seen["rounds"] >= FAR_OFF_ROUNDS
           for seen in speed.get("measured", {}).values()):
        line += ("\nfar from the prediction: if a node's speed changed since it was calibrated, "
                 "`fleetctl remeasure NODE`, then `fleetctl rebalance` places by it")
    if "predicted_ttft_ms" in speed:
        line += (f"\ntime to first token: predicted {speed['predicted_ttft_ms']:.0f} ms for a "
                 f"prompt of {speed['prompt_tokens']} tokens")
    return line


def wait_for_measurements(client: Client, wait_s: float) -> bool:
    """Poll `status` until no calibration or link probe is under way, at most `wait_s`, with
    progress on stderr. True when none is left."""
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        measured = client.call("GET", "/v1/status").get("measured", {})
        running = [*measured.get("running", []), *measured.get("waiting", [])]
        if not running:
            return True
        if time.monotonic() >= deadline:
            return False
        line = f"measuring: {', '.join(running)}"
        if line != last:
            err.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False)
            last = line
        time.sleep(POLL_S)


def final_plans(client: Client, body: dict[str, Any], models: list[str],
                wait_s: float) -> tuple[list[dict[str, Any]], bool]:
    """The placements that will run: once the measurements are in, the supervisor's plan of
    the applied file is what its loop places (the same pure search over the same inputs).
    Also whether every measurement landed within `wait_s`."""
    measured = wait_for_measurements(client, wait_s)
    plans = client.call("POST", "/v1/plan", {"text": body["text"], "source": body["source"]})
    return [p for p in plans["plans"] if p["model"] in models], measured


def ttl_seconds(text: str) -> float:
    """--ttl-s: refused here, by name, if the supervisor would refuse it (nan, inf, <= 0)."""
    from agent.pki import check_ttl

    try:
        return check_ttl(float(text))
    except (ValueError, PkiError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds above 0, at most 30 "
                                         "days") from exc


def add_common_options(parser: argparse.ArgumentParser, *, before_command: bool) -> None:
    """The options every command takes, before or after its name. After it they default to
    "not given" (argparse.SUPPRESS), so that they never undo the same option given before."""
    unset: dict[str, Any] = {} if before_command else {"default": argparse.SUPPRESS}
    parser.add_argument("--credentials", type=Path, help="fleetctl's PKI directory for "
                        "one fleet (default: $FLEETCTL_DIR, else the fleet's own under "
                        "~/.config/ringfleet/fleetctl/fleets/)", **({"default": None} | unset))
    parser.add_argument("--fleet", help="which fleet's credentials: the name or HOST:PORT "
                        "given to `init` (default: $FLEETCTL_FLEET, else --supervisor's "
                        "HOST:PORT, else the only fleet)", **({"default": None} | unset))
    parser.add_argument("--supervisor", help="https://HOST:PORT (default: from `fleetctl "
                        "init`)", **({"default": None} | unset))
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables",
                        **unset)


def add_out_option(parser: argparse.ArgumentParser, what: str) -> None:
    """For a command that prints a secret: write it to a file only its owner can read, since
    a shell's `> FILE` makes it 0644 (readable by every local user)."""
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help=f"write {what} to FILE (mode 0600) instead of printing it")


def write_secret(path: Path, text: str) -> None:
    """`text` into `path`, 0600 from its first byte, replacing any older (wider) file."""
    from agent.pki import write_private

    try:
        write_private(path, text.encode() + b"\n")
    except OSError as exc:
        raise CtlError(f"--out {path}: {exc.strerror or exc}", 2) from exc


def choose_credentials(args: argparse.Namespace) -> Path:
    if args.credentials is not None:
        return args.credentials
    if os.environ.get("FLEETCTL_DIR"):
        return Path(os.environ["FLEETCTL_DIR"])
    return credentials_dir(default_dir(), fleet=args.fleet or os.environ.get("FLEETCTL_FLEET"),
                           supervisor=args.supervisor,
                           init_address=args.address if args.command == "init" else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetctl", description=__doc__.split("\n")[0])
    add_common_options(p, before_command=True)
    sub = p.add_subparsers(dest="command", required=True)
    # Every command takes the common options after its name too: `fleetctl status --json`.
    common = argparse.ArgumentParser(add_help=False)
    add_common_options(common, before_command=False)
    command = functools.partial(sub.add_parser, parents=[common])
    init = command("init", help="make the fleet CA and the first certificates")
    init.add_argument("--state-dir", type=Path, required=True, help="the supervisor's")
    init.add_argument("--address", required=True, help="HOST:PORT agents and fleetctl reach")
    init.add_argument("--force", action="store_true")
    token = command("token", help="a one-time join token for `fleet-agent join`")
    token.add_argument("--node", required=True,
                       help="the node name it joins as (a token is bound to one node)")
    token.add_argument("--ttl-s", type=ttl_seconds, default=3600.0,
                       help="seconds it stays good (at most 30 days)")
    add_out_option(token, "the token")
    for name, what in (("apply", "make the fleet look like FILE"),
                       ("plan", "show the placement FILE would get (changes nothing)")):
        cmd = command(name, help=what)
        cmd.add_argument("file", type=Path)
        if name == "apply":
            cmd.add_argument("--dry-run", action="store_true")
            cmd.add_argument("--wait-s", type=float, default=300.0,
                             help="when the placement shown is provisional (nodes not yet "
                                  "measured), wait this long for the measurements and show "
                                  "the placement that runs (default 300)")
            cmd.add_argument("--no-wait", action="store_true",
                             help="return at once: the placement shown may be provisional")
            cmd.add_argument("--force", action="store_true",
                             help="apply even if a model fits nowhere now")
    command("status", help="nodes, replicas, placements, health")
    drain = command("drain", help="move every replica off NODE (drains first)")
    drain.add_argument("node")
    drain.add_argument("--undo", action="store_true", help="let NODE take stages again")
    command("rebalance", help="re-place replicas whose best placement changed")
    remeasure = command("remeasure", help="calibrate NODEs again and probe their links (every "
                                          "node when none is named), as when a machine's "
                                          "speed changed; replicas keep their placement")
    remeasure.add_argument("nodes", nargs="*", metavar="NODE")
    remeasure.add_argument("--wait-s", type=float, default=300.0,
                           help="wait this long for the new measurements (default 300)")
    remeasure.add_argument("--no-wait", action="store_true", help="return at once")
    revoke = command("revoke", help="forget NODE and refuse its certificate, so the "
                            "name can join again")
    revoke.add_argument("node")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, choose_credentials(args))
    except FleetConfigError as exc:
        err.print(f"fleetctl: {exc}", markup=False)
        return 2
    except CtlError as exc:
        err.print(f"fleetctl: {exc}", markup=False)
        return exc.code


def run(args: argparse.Namespace, credentials: Path) -> int:
    if args.command == "init":
        from supervisor.issuing import InitError, init_pki

        try:
            result = init_pki(args.state_dir, args.address, credentials, force=args.force)
        except InitError as exc:
            raise CtlError(str(exc), 2) from exc
        if args.json:
            print(json.dumps({"ca_fingerprint": result.ca_fingerprint,
                              "credentials": str(credentials)}))
        else:
            out.print(f"fleet CA {result.ca_fingerprint[:16]}… in {args.state_dir / 'pki'}\n"
                      f"supervisor certificate: {result.supervisor_credentials}\n"
                      f"fleetctl certificate: {credentials}\n"
                      f"next: fleet-supervisor --state-dir {args.state_dir} "
                      f"--listen {args.address}, then `fleetctl token --node NAME`")
        return 0
    client = Client(credentials, args.supervisor)
    if args.command == "token":
        data = client.call("POST", "/v1/tokens", {"node": args.node, "ttl_s": args.ttl_s})
        if args.out is None:
            print(json.dumps(data) if args.json else data["token"])
            return 0
        write_secret(args.out, json.dumps(data) if args.json else data["token"])
        err.print(f"join token for {args.node} written to {args.out} (mode 0600)", markup=False)
    elif args.command in ("apply", "plan"):
        text = read_fleet_file(args.file)
        body = {"text": text, "source": str(args.file)}
        if args.command == "apply":
            body.update(dry_run=args.dry_run, force=args.force)
        if args.command == "plan" or args.dry_run:
            return show_apply(args, client.call("POST", f"/v1/{args.command}", body))
        data = client.call("POST", "/v1/apply", body)
        provisional = [p["model"] for p in data.get("plans", [])
                       if "placement" in p and is_provisional(p["placement"])]
        wait = data.get("applied") and provisional and not args.no_wait
        if args.json:
            if wait:
                data["final_plans"], data["measured"] = final_plans(client, body, provisional,
                                                                    args.wait_s)
            return show_apply(args, data)
        code = show_apply(args, data)
        if wait:
            plans, measured = final_plans(client, body, provisional, args.wait_s)
            out.print("the placement that runs, on the measured numbers:" if measured else
                      f"still measuring after {args.wait_s:g} s: the placement below may "
                      "change again; `fleetctl status` shows the one that runs")
            for plan in plans:
                if "error" in plan:
                    err.print(plan["error"], markup=False)
                else:
                    out.print(render_plan(plan["placement"]))
        elif provisional and data.get("applied"):
            out.print("not waited for: `fleetctl status` shows the placement that runs")
        return code
    elif args.command == "status":
        data = client.call("GET", "/v1/status")
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            show_status(data)
    elif args.command == "drain":
        data = client.call("POST", f"/v1/nodes/{args.node}/drain", {"undo": args.undo})
        what = "cordoned; its replicas move" if data["cordoned"] else "uncordoned"
        print(json.dumps(data)) if args.json else out.print(f"{args.node}: {what}")
        if not args.json:
            warn_outages(data)
    elif args.command == "revoke":
        data = client.call("POST", f"/v1/nodes/{args.node}/revoke", {})
        text = (f"{args.node}: revoked; `fleetctl token --node {args.node}` lets it join again")
        print(json.dumps(data)) if args.json else out.print(text, markup=False)
    elif args.command == "rebalance":
        data = client.call("POST", "/v1/rebalance", {})
        text = f"rebalance {data['rebalance_epoch']} asked at {time.strftime('%H:%M:%S')}"
        print(json.dumps(data)) if args.json else out.print(text)
        if not args.json:
            warn_outages(data)
    elif args.command == "remeasure":
        return remeasure(client, args)
    return 0


def remeasure(client: Client, args: argparse.Namespace) -> int:
    """Ask for the measurements again, wait for them, and show what they now say."""
    data = client.call("POST", "/v1/remeasure", {"nodes": args.nodes})
    done = args.no_wait or not data["measuring"] or wait_for_measurements(client, args.wait_s)
    measured = client.call("GET", "/v1/status")["measured"]
    if args.json:
        print(json.dumps(dict(data, done=done, measured=measured)))
    elif not data["measuring"]:
        out.print(f"nothing measured yet on {', '.join(data['nodes'])}: they are measured "
                  "when a model is placed there", markup=False)
    elif args.no_wait:  # the figures in status are still the ones from before
        out.print(f"measuring again: {', '.join(data['measuring'])}", markup=False)
    else:
        figures = measured["calibrations"] | measured["links"]
        for key in data["measuring"]:
            out.print(f"{key}: {measured_figure(figures.get(key))}", markup=False)
    if not done:
        err.print(f"fleetctl: still measuring after {args.wait_s:g} s", markup=False)
        return 1
    return 0


def measured_figure(found: Any) -> str:
    """One calibration or link from `status`'s measured, as a line."""
    if found is None:
        return "not measured"
    if isinstance(found, str):
        return found  # why there is none
    if "decode_ms_per_layer" in found:
        return (f"{found['decode_ms_per_layer']:.3g} ms per layer for one row, a prompt "
                f"chunk {found['prefill_ms_per_layer']:.3g} ({found.get('age_s', 0):.0f} s ago)")
    return (f"rtt {found['rtt_ms']:.3g} ms, {found['bandwidth_bytes_per_s'] / 1e6:.0f} MB/s "
            f"({found.get('age_s', 0):.0f} s ago)")


if __name__ == "__main__":
    sys.exit(main())
