"""The fleet PKI: CA, node certificates, join tokens and the issuing decision."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from agent.pki import (
    MAX_TOKEN_TTL_S,
    CsrError,
    FleetCA,
    JoinRequest,
    JoinToken,
    MissingCredentials,
    NodeCredentials,
    PkiError,
    TokenError,
    cert_pem,
    handle_join,
    identity,
    key_pem,
    make_csr,
    make_token,
    new_key,
)


def test_node_certificate_names_node_and_role_and_chains_to_the_ca():
    ca = FleetCA.create()
    key = new_key()
    cert = ca.issue(key.public_key(), "gb10", "agent", hosts=("10.0.0.5", "gb10.lan"))
    ca.verify_issued(cert)
    who = identity(cert)
    assert (who.node, who.role) == ("gb10", "agent")
    with pytest.raises(PkiError, match="not issued by the fleet CA"):
        FleetCA.create().verify_issued(cert)


def test_ca_round_trips_through_disk(tmp_path):
    ca = FleetCA.create()
    ca.save(tmp_path)
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600
    assert FleetCA.load(tmp_path).fingerprint == ca.fingerprint
    with pytest.raises(MissingCredentials, match="fleetctl init"):
        FleetCA.load(tmp_path / "nowhere")


def test_token_round_trip_and_malformed_tokens():
    ca = FleetCA.create()
    token, _record = make_token(ca, node="n1")
    assert JoinToken.parse(str(token)) == token
    assert token.ca_fingerprint == ca.fingerprint
    for bad, why in (("", "looks like"), ("rf2.aa.bb", "looks like"),
                     (f"rf1.{'z' * 64}.{token.secret_text}", "64 hex"),
                     (f"rf1.{ca.fingerprint}.c2hvcnQ", "bytes")):
        with pytest.raises(TokenError, match=why):
            JoinToken.parse(bad)


def test_handle_join_issues_for_a_good_token_and_refuses_bad_ones():
    ca = FleetCA.create()
    token, record = make_token(ca, ttl_s=60, node="mac")
    key = new_key()
    request = JoinRequest("mac", token.secret_text, make_csr(key, "mac").decode())
    body, used = handle_join(ca, [record], request, time.time())
    assert used == record
    from agent.pki import load_cert

    cert = load_cert(body["certificate"].encode())
    assert identity(cert).node == "mac" and identity(cert).role == "agent"
    other_token, _ = make_token(ca, node="mac")
    with pytest.raises(TokenError, match="not known"):
        handle_join(ca, [record], JoinRequest("mac", other_token.secret_text,
                                              request.csr_pem), time.time())
    with pytest.raises(TokenError, match="expired"):
        handle_join(ca, [record], request, time.time() + 120)
    with pytest.raises(TokenError, match="for node 'mac', not 'gb10'"):
        handle_join(ca, [record], JoinRequest("gb10", token.secret_text, request.csr_pem),
                    time.time())
    with pytest.raises(CsrError, match="CN='gb10'"):
        handle_join(ca, [record], JoinRequest("mac", token.secret_text,
                                              make_csr(key, "gb10").decode()), time.time())
    with pytest.raises(CsrError, match="not a PEM"):
        handle_join(ca, [record], JoinRequest("mac", token.secret_text, "garbage"), time.time())


def test_a_token_bound_to_a_node_refuses_another_name():
    ca = FleetCA.create()
    token, record = make_token(ca, node="gb10")
    csr = make_csr(new_key(), "mac").decode()
    with pytest.raises(TokenError, match="for node 'gb10'"):
        handle_join(ca, [record], JoinRequest("mac", token.secret_text, csr), time.time())


def test_a_token_names_its_node_and_a_nodeless_record_is_refused():
    ca = FleetCA.create()
    for node in ("", "a/b", "x" * 64):
        with pytest.raises(PkiError, match="node name"):
            make_token(ca, node=node)
    token, record = make_token(ca, node="gb10")
    older = replace(record, node="")  # a record kept from before tokens were bound
    csr = make_csr(new_key(), "gb10").decode()
    with pytest.raises(TokenError, match="names no node"):
        handle_join(ca, [older], JoinRequest("gb10", token.secret_text, csr), time.time())


@pytest.mark.parametrize("ttl_s", [float("nan"), float("inf"), -1.0, 0, "nan", "3600", True,
                                   MAX_TOKEN_TTL_S + 1])
def test_a_token_lifetime_must_be_finite_positive_and_bounded(ttl_s):
    with pytest.raises(TokenError, match="ttl_s="):
        make_token(FleetCA.create(), node="gb10", ttl_s=ttl_s)


def test_a_record_whose_expiry_is_nan_counts_as_expired():
    ca = FleetCA.create()
    token, record = make_token(ca, node="gb10")
    csr = make_csr(new_key(), "gb10").decode()
    with pytest.raises(TokenError, match="expired"):
        handle_join(ca, [replace(record, expires_at=float("nan"))],
                    JoinRequest("gb10", token.secret_text, csr), time.time())


def test_node_credentials_check(tmp_path):
    ca = FleetCA.create()
    creds = NodeCredentials(tmp_path / "pki")
    with pytest.raises(MissingCredentials, match="fleet-agent join"):
        creds.check()
    key, cert = ca.issue_credentials("n1", "agent")
    creds.store(cert_pem(ca.cert), cert, key)
    assert creds.check().node == "n1"
    assert creds.key_path.stat().st_mode & 0o777 == 0o600
    creds.key_path.write_bytes(key_pem(new_key()))
    with pytest.raises(PkiError, match="does not belong"):
        creds.check()
