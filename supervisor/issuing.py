"""The fleet's PKI on the supervisor's side: `fleetctl init` makes the CA and the first
credentials; the issuing endpoint signs a joining node's CSR on a valid one-time token.

Files under the supervisor's state directory:
  pki/ca.pem, pki/ca.key (0600)            the fleet CA
  pki/supervisor/{ca,node}.pem, node.key   the supervisor's own certificate (role supervisor)
  pki/front-door/{ca,node}.pem, node.key   `fleet-front-door`'s (role front-door), and its
                                           `supervisor_url`: made by the supervisor at start
and in fleetctl's directory: ca.pem, node.pem, node.key (role admin) and `supervisor_url`.
Every directory is 0700 and every key 0600.

A join names its node (the token is bound to it) and pins the certificate it issues: an
agent calls the supervisor with that certificate or not at all, and a name that is already
a member cannot be joined again until `fleetctl revoke NODE` forgets the old one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from agent.pki import (
    FleetCA,
    JoinRequest,
    JoinToken,
    NodeCredentials,
    PkiError,
    TokenRecord,
    cert_pem,
    find_token,
    fingerprint,
    handle_join,
    load_cert,
    make_token,
    private_dir,
)
from engine.addresses import parse_host_port
from supervisor.state import State


class InitError(Exception):
    """`fleetctl init` would overwrite a fleet CA, or cannot write its files."""


class AlreadyMember(PkiError):
    """A join for a node name the fleet already has (revoke the old one first)."""


@dataclass(frozen=True)
class PinVerdict:
    """May this agent certificate speak for its node? (`pin_now`: a member from before
    certificates were pinned has its certificate pinned at its first call.)"""

    allowed: bool
    reason: str = ""
    pin_now: bool = False


def check_pin(node: str, presented: str, pinned: str | None, revoked: bool,
              is_member: bool) -> PinVerdict:
    """The decision for an agent's call, from the certificate it presented. Pure."""
    if revoked:
        return PinVerdict(False, f"certificate {presented[:16]}… for node {node!r} was revoked")
    if pinned is None:
        if is_member:
            return PinVerdict(True, pin_now=True)
        return PinVerdict(False, f"node {node!r} has not joined this fleet (no certificate is "
                          "pinned for it): join it with a token from "
                          f"`fleetctl token --node {node}`")
    if pinned != presented:
        return PinVerdict(False, f"certificate {presented[:16]}… is not the one pinned for node "
                          f"{node!r} when it joined ({pinned[:16]}…); if that node was "
                          f"re-issued, `fleetctl revoke {node}` and join it again")
    return PinVerdict(True)


@dataclass(frozen=True)
class InitResult:
    ca_fingerprint: str
    supervisor_credentials: Path
    fleetctl_credentials: Path


def supervisor_credentials(state_dir: Path) -> NodeCredentials:
    return NodeCredentials(state_dir / "pki" / "supervisor")


def front_door_credentials(state_dir: Path) -> NodeCredentials:
    return NodeCredentials(state_dir / "pki" / "front-door")


def ensure_front_door_credentials(state_dir: Path, ca: FleetCA, listen: str) -> NodeCredentials:
    """`fleet-front-door`'s certificate (made once, also for a state directory from before
    the front door had a process of its own) and the supervisor URL it polls (written at
    every start: the address may change)."""
    creds = front_door_credentials(state_dir)
    if not creds.exist():
        key, cert = ca.issue_credentials("front-door", "front-door")
        creds.store(cert_pem(ca.cert), cert, key)
    url = f"https://{listen}\n"
    path = creds.directory / "supervisor_url"
    if not path.is_file() or path.read_text() != url:
        path.write_text(url)
    return creds


def init_pki(state_dir: Path, address: str, fleetctl_dir: Path, *,
             fleet_name: str = "ringfleet", force: bool = False) -> InitResult:
    """Create the fleet CA, the supervisor's certificate for `address`, and fleetctl's."""
    pki = state_dir / "pki"
    private_dir(state_dir)
    if (pki / "ca.key").exists() and not force:
        raise InitError(f"{pki / 'ca.key'} exists: this state directory already has a fleet "
                        "CA (use --force to replace it, which orphans every joined node)")
    ca = FleetCA.create(fleet_name)
    ca.save(pki)
    host, _ = parse_host_port(address, "address", min_port=1)
    hosts = tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
    key, cert = ca.issue_credentials("supervisor", "supervisor", hosts=hosts)
    supervisor_credentials(state_dir).store(cert_pem(ca.cert), cert, key)
    key, cert = ca.issue_credentials("fleetctl", "admin")
    NodeCredentials(fleetctl_dir).store(cert_pem(ca.cert), cert, key)
    (fleetctl_dir / "supervisor_url").write_text(f"https://{address}\n")
    return InitResult(ca.fingerprint, supervisor_credentials(state_dir).directory, fleetctl_dir)


def new_token(ca: FleetCA, state: State, *, ttl_s: float, node: str) -> JoinToken:
    token, record = make_token(ca, ttl_s=ttl_s, node=node)
    state.put_token(record)
    return token


def join(ca: FleetCA, state: State, raw: dict, now: float | None = None) -> dict:
    """Sign the CSR in a join request on a valid token (then used up) for a node the fleet
    does not have yet, and pin the certificate issued; PkiError if not."""
    request = JoinRequest.from_dict(raw)
    now = time.time() if now is None else now
    records = state.tokens()
    find_token(records, request.token_secret, request.node, now)  # a bad token says so first
    if state.pin(request.node) is not None or request.node in state.members():
        # The token is kept: once the operator revokes the old member, it still works.
        raise AlreadyMember(f"node {request.node!r} is already a member of this fleet; if "
                            "this is a new machine or a lost certificate, run `fleetctl revoke "
                            f"{request.node}` first")
    body, record = handle_join(ca, records, request, now)
    state.use_token(record)
    state.put_pin(request.node, fingerprint(load_cert(body["certificate"].encode())), now)
    state.log_event("join", f"issued and pinned a certificate for {request.node} "
                    f"({record.role})", node=request.node)
    return body


def ca_body(ca: FleetCA) -> dict:
    return {"ca": cert_pem(ca.cert).decode(), "fingerprint": ca.fingerprint}


__all__ = ["AlreadyMember", "InitError", "InitResult", "PinVerdict", "TokenRecord", "ca_body",
           "check_pin", "ensure_front_door_credentials",
           "front_door_credentials", "init_pki", "join", "new_token", "supervisor_credentials"]
