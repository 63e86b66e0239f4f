"""The fleet PKI: a CA (`fleetctl init`), node certificates, join tokens, and CSR signing.

Pure functions over `cryptography` objects and PEM bytes; nothing here opens a socket, so the
supervisor's issuing endpoint and the tests use the same code. Keys are ECDSA P-256.

A certificate names its node (CN and a DNS SAN) and its role (OU): `agent` for a node,
`supervisor` for the supervisor, `admin` for `fleetctl`, `front-door` for a front door of
its own process (`fleet-front-door`, which reads its routes from the supervisor). A join token carries a one-time
secret and the SHA-256 fingerprint of the CA certificate, so a joining node can pin the CA
before it trusts anything the supervisor says.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import ipaddress
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("agent", "supervisor", "admin", "front-door")
TOKEN_PREFIX = "rf1"
NODE_CERT_DAYS = 365
CA_DAYS = 3650
CLOCK_SKEW = dt.timedelta(minutes=5)


class PkiError(Exception):
    """Something about a key, certificate, CSR or token is wrong; the message says what."""


class TokenError(PkiError):
    """A join token that is malformed, unknown, expired, or whose CA fingerprint does not match."""


class CsrError(PkiError):
    """A certificate signing request that is malformed, badly signed, or asks for another name."""


class MissingCredentials(PkiError):
    """This node has no certificate yet (or a file is missing)."""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_cert(pem: bytes, what: str = "certificate") -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise PkiError(f"{what}: not a PEM certificate ({exc})") from exc


def load_key(pem: bytes, what: str = "key") -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{what}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{what}: expected an EC key, got {type(key).__name__}")
    return key


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER bytes, lowercase hex: what a join token pins."""
    return cert.fingerprint(hashes.SHA256()).hex()


def _name(common_name: str, role: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ringfleet")]
    if role:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is."""

    node: str
    role: str
    fingerprint: str


def identity(cert: x509.Certificate) -> Identity:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return Identity(str(cn[0].value) if cn else "", str(ou[0].value) if ou else "",
                    fingerprint(cert))


@dataclass(frozen=True)
class FleetCA:
    """The fleet's certificate authority: its key signs every node certificate."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, fleet_name: str = "ringfleet", *, days: int = CA_DAYS,
               now: dt.datetime | None = None) -> FleetCA:
        now = now or utcnow()
        key = new_key()
        name = _name(f"{fleet_name} fleet CA")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def save(self, directory: Path) -> None:
        """ca.pem (public) and ca.key (0600) in `directory` (0700)."""
        private_dir(directory)
        write_private(directory / "ca.key", key_pem(self.key))
        (directory / "ca.pem").write_bytes(cert_pem(self.cert))

    @classmethod
    def load(cls, directory: Path) -> FleetCA:
        for name in ("ca.pem", "ca.key"):
            if not (directory / name).is_file():
                raise MissingCredentials(f"{directory / name}: missing (run `fleetctl init`)")
        return cls(load_cert((directory / "ca.pem").read_bytes(), str(directory / "ca.pem")),
                   load_key((directory / "ca.key").read_bytes(), str(directory / "ca.key")))

    def issue(self, public_key: ec.EllipticCurvePublicKey, node: str, role: str, *,
              hosts: tuple[str, ...] = (), days: int = NODE_CERT_DAYS,
              not_before: dt.datetime | None = None,
              not_after: dt.datetime | None = None) -> x509.Certificate:
        """A leaf certificate for `node` in `role`, good for TLS server and client use."""
        if role not in ROLES:
            raise PkiError(f"role {role!r}: expected one of {', '.join(ROLES)}")
        check_node_name(node)
        now = utcnow()
        start = not_before or now - CLOCK_SKEW
        end = not_after or now + dt.timedelta(days=days)
        sans: list[x509.GeneralName] = [x509.DNSName(node)]
        for host in dict.fromkeys(hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        return (
            x509.CertificateBuilder()
            .subject_name(_name(node, role)).issuer_name(self.cert.subject)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue_credentials(self, node: str, role: str, **kwargs) -> tuple[bytes, bytes]:
        """A new key and its certificate, both PEM: for the supervisor, fleetctl and tests."""
        key = new_key()
        return key_pem(key), cert_pem(self.issue(key.public_key(), node, role, **kwargs))

    def sign_csr(self, csr_pem: bytes, node: str, role: str = "agent", *,
                 hosts: tuple[str, ...] = (), days: int = NODE_CERT_DAYS) -> x509.Certificate:
        """Check a CSR (well formed, self-signed, asks for `node`) and issue its certificate."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise CsrError(f"the CSR is not a PEM certificate request ({exc})") from exc
        if not csr.is_signature_valid:
            raise CsrError("the CSR's signature does not verify")
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise CsrError(f"the CSR holds a {type(public_key).__name__}; expected an EC key")
        cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not cn or cn[0].value != node:
            asked = cn[0].value if cn else None
            raise CsrError(f"the CSR asks for CN={asked!r}, but the join names node {node!r}")
        return self.issue(public_key, node, role, hosts=hosts, days=days)

    def verify_issued(self, cert: x509.Certificate) -> None:
        """Raise PkiError unless `cert` was signed by this CA."""
        verify_signed_by(cert, self.cert)


def verify_signed_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PkiError(f"certificate for {identity(cert).node!r} was not issued by the fleet CA "
                       f"{fingerprint(ca_cert)[:16]}…: {exc or 'bad signature'}") from exc


def check_node_name(node: str) -> None:
    ok = node and len(node) <= 63 and all(c.isalnum() or c in "-_." for c in node)
    if not ok:
        raise PkiError(f"node name {node!r}: use letters, digits, '-', '_' or '.', at most 63")


def make_csr(key: ec.EllipticCurvePrivateKey, node: str) -> bytes:
    check_node_name(node)
    csr = (x509.CertificateSigningRequestBuilder().subject_name(_name(node))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


# --- join tokens -------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class JoinToken:
    """`rf1.<CA fingerprint, 64 hex>.<secret, base64url>`: what `fleetctl token` prints."""

    ca_fingerprint: str
    secret: bytes

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}.{self.ca_fingerprint}.{_b64(self.secret)}"

    @property
    def secret_text(self) -> str:
        return _b64(self.secret)

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        parts = text.strip().split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise TokenError(f"a join token looks like {TOKEN_PREFIX}.<64 hex>.<secret>; "
                             f"got {len(parts)} dot-separated part(s)")
        fp = parts[1].lower()
        if len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp):
            raise TokenError("the join token's CA fingerprint is not 64 hex digits")
        try:
            secret = _unb64(parts[2])
        except (ValueError, TypeError) as exc:
            raise TokenError("the join token's secret is not base64url") from exc
        if len(secret) < 16:
            raise TokenError(f"the join token's secret is {len(secret)} bytes; expected 16+")
        return cls(fp, secret)


@dataclass(frozen=True)
class TokenRecord:
    """What the issuer keeps of a token: never the secret, only its hash."""

    secret_sha256: str
    expires_at: float  # unix seconds
    node: str = ""  # the only node name this token may join as (one made without: refused)
    role: str = "agent"

    def to_dict(self) -> dict:
        return {"secret_sha256": self.secret_sha256, "expires_at": self.expires_at,
                "node": self.node, "role": self.role}

    @classmethod
    def from_dict(cls, raw: dict) -> TokenRecord:
        return cls(raw["secret_sha256"], float(raw["expires_at"]), raw.get("node", ""),
                   raw.get("role", "agent"))


MAX_TOKEN_TTL_S = 30 * 86400.0


def check_ttl(ttl_s: object) -> float:
    """A token's lifetime in seconds: a finite number in (0, 30 days]. "nan" or inf would
    make a token that never expires (every comparison with NaN is false)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (
            math.isfinite(ttl_s) and 0 < ttl_s <= MAX_TOKEN_TTL_S):
        raise TokenError(f"ttl_s={ttl_s!r}: expected a number of seconds above 0 and at most "
                         f"{MAX_TOKEN_TTL_S:.0f} (30 days)")
    return float(ttl_s)


def make_token(ca: FleetCA, *, node: str, ttl_s: float = 3600.0, role: str = "agent",
               now: float | None = None) -> tuple[JoinToken, TokenRecord]:
    """A one-time join token bound to `node`: a token for any name could join as a member's."""
    check_node_name(node)
    ttl_s = check_ttl(ttl_s)
    secret = secrets.token_bytes(32)
    now = time.time() if now is None else now
    return (JoinToken(ca.fingerprint, secret),
            TokenRecord(hashlib.sha256(secret).hexdigest(), now + ttl_s, node, role))


def find_token(records: list[TokenRecord], secret_text: str, node: str,
               now: float) -> TokenRecord:
    """The record a presented secret matches, or TokenError saying why none does."""
    try:
        digest = hashlib.sha256(_unb64(secret_text)).hexdigest()
    except (ValueError, TypeError) as exc:
        raise TokenError("the join secret is not base64url") from exc
    for record in records:
        if hmac.compare_digest(record.secret_sha256, digest):
            if not now <= record.expires_at:  # NaN from an older record counts as expired
                raise TokenError("the join token has expired: ask for a new one")
            if not record.node:
                raise TokenError("the join token names no node (made before tokens were bound "
                                 "to one): ask for a new one with `fleetctl token --node NAME`")
            if record.node != node:
                raise TokenError(f"the join token is for node {record.node!r}, not {node!r}")
            return record
        continue
    raise TokenError("the join token is not known to this fleet (used, revoked or mistyped)")


@dataclass(frozen=True)
class JoinRequest:
    """What `fleet-agent join` posts to the supervisor's issuing endpoint."""

    node: str
    token_secret: str
    csr_pem: str
    hosts: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"node": self.node, "token_secret": self.token_secret, "csr": self.csr_pem,
                "hosts": list(self.hosts)}

    @classmethod
    def from_dict(cls, raw: dict) -> JoinRequest:
        try:
            return cls(str(raw["node"]), str(raw["token_secret"]), str(raw["csr"]),
                       tuple(str(h) for h in raw.get("hosts", ())))
        except (KeyError, TypeError) as exc:
            raise CsrError(f"join request: missing or bad field {exc}") from exc


def handle_join(ca: FleetCA, records: list[TokenRecord], request: JoinRequest,
                now: float) -> tuple[dict, TokenRecord]:
    """The issuing endpoint's decision: the response body and the token record it used up."""
    record = find_token(records, request.token_secret, request.node, now)
    cert = ca.sign_csr(request.csr_pem.encode(), request.node, record.role, hosts=request.hosts)
    return {"certificate": cert_pem(cert).decode(), "ca": cert_pem(ca.cert).decode()}, record


# --- files on a node ---------------------------------------------------------------------

def write_private(path: Path, data: bytes) -> None:
    """Write a secret file readable by its owner only, replacing any old one atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def private_dir(path: Path) -> Path:
    """Make `path` (and missing parents) and keep it to its owner (0700), even if it existed:
    state directories hold keys, secrets and the records that name them."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class NodeCredentials:
    """A node's files: the pinned CA, its certificate and its key (0600)."""

    directory: Path

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert_path(self) -> Path:
        return self.directory / "node.pem"

    @property
    def key_path(self) -> Path:
        return self.directory / "node.key"

    def exist(self) -> bool:
        return all(p.is_file() for p in (self.ca_path, self.cert_path, self.key_path))

    def check(self) -> Identity:
        """Raise MissingCredentials / PkiError unless the three files are there and agree."""
        for path in (self.ca_path, self.cert_path, self.key_path):
            if not path.is_file():
                raise MissingCredentials(
                    f"{path}: missing; this node has not joined a fleet "
                    "(run `fleet-agent join https://SUPERVISOR:PORT --token-file FILE`)")
        ca = load_cert(self.ca_path.read_bytes(), str(self.ca_path))
        cert = load_cert(self.cert_path.read_bytes(), str(self.cert_path))
        key = load_key(self.key_path.read_bytes(), str(self.key_path))
        verify_signed_by(cert, ca)
        if cert.public_key().public_numbers() != key.public_key().public_numbers():
            raise PkiError(f"{self.key_path} does not belong to {self.cert_path}")
        return identity(cert)

    def store(self, ca_pem: bytes, cert_pem_bytes: bytes, key_pem_bytes: bytes) -> None:
        private_dir(self.directory)
        write_private(self.key_path, key_pem_bytes)
        self.cert_path.write_bytes(cert_pem_bytes)
        self.ca_path.write_bytes(ca_pem)
