"""`fleet-agent join URL --token-file F`: pin the fleet CA from the token, send a CSR, keep
the cert. (`--token -` reads the token from stdin; `--token T` puts it in argv, which every
local user can read.)

The supervisor's side (its issuing endpoint; `agent.pki.handle_join` is the decision):
  GET  /v1/pki/ca    → {"ca": PEM}            fetched unverified, then pinned by fingerprint
  POST /v1/pki/join  {node, token_secret, csr, hosts} → {"certificate": PEM, "ca": PEM}
The token's secret is only sent once the server has proved a certificate from the pinned CA.
"""

from __future__ import annotations

import ssl

import aiohttp

from agent.pki import (
    Identity,
    JoinRequest,
    JoinToken,
    NodeCredentials,
    PkiError,
    TokenError,
    cert_pem,
    fingerprint,
    identity,
    key_pem,
    load_cert,
    make_csr,
    new_key,
    verify_signed_by,
)
from agent.tls import pinned_ca_context, unverified_context


async def join(url: str, token_text: str, credentials: NodeCredentials, node: str, *,
               hosts: tuple[str, ...] = (), timeout_s: float = 30.0) -> Identity:
    """Join the fleet at `url`; returns the identity of the certificate now stored."""
    token = JoinToken.parse(token_text)
    base = url.rstrip("/")
    if not base.startswith("https://"):
        raise PkiError(f"{url}: the supervisor's URL must start with https://")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(base + "/v1/pki/ca", ssl=unverified_context()) as reply:
                if reply.status != 200:
                    raise PkiError(f"{base}/v1/pki/ca answered {reply.status}")
                ca_pem = str((await reply.json(content_type=None))["ca"]).encode()
            ca = load_cert(ca_pem, f"the CA certificate from {base}")
            if fingerprint(ca) != token.ca_fingerprint:
                raise TokenError(
                    f"the CA at {base} has fingerprint {fingerprint(ca)[:16]}…, the token pins "
                    f"{token.ca_fingerprint[:16]}…: wrong supervisor, or someone in between")
            key = new_key()
            request = JoinRequest(node, token.secret_text, make_csr(key, node).decode(), hosts)
            async with session.post(base + "/v1/pki/join", json=request.to_dict(),
                                    ssl=pinned_ca_context(ca_pem)) as reply:
                body = await reply.json(content_type=None)
                if reply.status != 200:
                    message = (body.get("error", {}).get("message") if isinstance(body, dict)
                               else None) or str(body)
                    raise TokenError(f"the supervisor refused the join ({reply.status}): "
                                     f"{message}")
    except (aiohttp.ClientError, TimeoutError, ssl.SSLError, KeyError, ValueError) as exc:
        raise PkiError(f"cannot join {base}: {exc or type(exc).__name__}") from exc
    cert = load_cert(str(body["certificate"]).encode(), "the issued certificate")
    verify_signed_by(cert, ca)
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        raise PkiError("the issued certificate is not for the key this node generated")
    who = identity(cert)
    if who.node != node:
        raise PkiError(f"the issued certificate names {who.node!r}, not {node!r}")
    credentials.store(ca_pem, cert_pem(cert), key_pem(key))
    return who
