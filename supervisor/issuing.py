"""The fleet's PKI on the supervisor's side: `fleetctl init` makes the CA and the first
credentials; the issuing endpoint signs a joining node's CSR on a valid one-time token.

Files under the supervisor's state directory:
  pki/ca.pem, pki/ca.key (0600)            the fleet CA
  pki/supervisor/{ca,node}.pem, node.key   the supervisor's own certificate (role supervisor)
and in fleetctl's directory: ca.pem, node.pem, node.key (role admin) and `supervisor_url`.
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
    TokenRecord,
    cert_pem,
    handle_join,
    make_token,
)
from supervisor.state import State


class InitError(Exception):
    """`fleetctl init` would overwrite a fleet CA, or cannot write its files."""


@dataclass(frozen=True)
class InitResult:
    ca_fingerprint: str
    supervisor_credentials: Path
    fleetctl_credentials: Path


def supervisor_credentials(state_dir: Path) -> NodeCredentials:
    return NodeCredentials(state_dir / "pki" / "supervisor")


def init_pki(state_dir: Path, address: str, fleetctl_dir: Path, *,
             fleet_name: str = "ringfleet", force: bool = False) -> InitResult:
    """Create the fleet CA, the supervisor's certificate for `address`, and fleetctl's."""
    pki = state_dir / "pki"
    if (pki / "ca.key").exists() and not force:
        raise InitError(f"{pki / 'ca.key'} exists: this state directory already has a fleet "
                        "CA (use --force to replace it, which orphans every joined node)")
    ca = FleetCA.create(fleet_name)
    ca.save(pki)
    host = address.rpartition(":")[0].strip("[]")
    hosts = tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
    key, cert = ca.issue_credentials("supervisor", "supervisor", hosts=hosts)
    supervisor_credentials(state_dir).store(cert_pem(ca.cert), cert, key)
    key, cert = ca.issue_credentials("fleetctl", "admin")
    NodeCredentials(fleetctl_dir).store(cert_pem(ca.cert), cert, key)
    (fleetctl_dir / "supervisor_url").write_text(f"https://{address}\n")
    return InitResult(ca.fingerprint, supervisor_credentials(state_dir).directory, fleetctl_dir)


def new_token(ca: FleetCA, state: State, *, ttl_s: float, node: str = "") -> JoinToken:
    token, record = make_token(ca, ttl_s=ttl_s, node=node)
    state.put_token(record)
    return token


def join(ca: FleetCA, state: State, raw: dict, now: float | None = None) -> dict:
    """Sign the CSR in a join request on a valid token (then used up); PkiError if not."""
    request = JoinRequest.from_dict(raw)
    body, record = handle_join(ca, state.tokens(), request,
                               time.time() if now is None else now)
    state.use_token(record)
    state.log_event("join", f"issued a certificate for {request.node} ({record.role})",
                    node=request.node)
    return body


def ca_body(ca: FleetCA) -> dict:
    return {"ca": cert_pem(ca.cert).decode(), "fingerprint": ca.fingerprint}


__all__ = ["InitError", "InitResult", "TokenRecord", "ca_body", "init_pki", "join",
           "new_token", "supervisor_credentials"]
