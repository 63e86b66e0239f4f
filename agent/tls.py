"""SSL contexts for the control plane's mutual TLS, and who the peer on a connection is.

The server context requires a client certificate from the fleet CA, so a caller without one
(or with one from another CA, or an expired one) fails the handshake: no handler runs.
Peers are fleet members known by certificate, not by DNS name, so host names are not checked;
the role in the certificate decides what a caller may do (agent.app).
"""

from __future__ import annotations

import ssl
from typing import Any

from cryptography import x509

from agent.pki import Identity, NodeCredentials, identity


def _base(purpose: ssl.Purpose, creds: NodeCredentials) -> ssl.SSLContext:
    creds.check()
    ctx = ssl.create_default_context(purpose, cafile=str(creds.ca_path))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(creds.cert_path), str(creds.key_path))
    return ctx


def server_context(creds: NodeCredentials) -> ssl.SSLContext:
    """Serve with this node's certificate; require and verify a fleet client certificate."""
    ctx = _base(ssl.Purpose.CLIENT_AUTH, creds)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(creds: NodeCredentials) -> ssl.SSLContext:
    """Call a fleet member with this node's certificate; verify the server against the CA."""
    ctx = _base(ssl.Purpose.SERVER_AUTH, creds)
    ctx.check_hostname = False  # fleet members are identified by certificate, not DNS
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def pinned_ca_context(ca_pem: bytes) -> ssl.SSLContext:
    """Verify a server against one CA given as PEM, presenting no certificate (for joining)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    ctx.check_hostname = False
    return ctx


def unverified_context() -> ssl.SSLContext:
    """Only for fetching a CA certificate that is then checked against a pinned fingerprint."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_identity(transport: Any) -> Identity | None:
    """The verified peer certificate's identity on an accepted TLS connection, if any."""
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return identity(x509.load_der_x509_certificate(der))
