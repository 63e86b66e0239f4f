"""Addresses: host:port text read and written by one rule, and the one wildcard rule that
every listener applies (the supervisor's API and front door, an agent's API, rank 0's HTTP
API, the stage link).

An IPv6 host is written in brackets ("[::1]:8000"): without them its last colon cannot be
told from the port's, so an unbracketed IPv6 host is refused rather than guessed at. The
host comes back bare ("::1"), as sockets take it.

The literal wildcard test is `is_wildcard_host` (the link's too); it is applied again to every
address the host resolves to, because `0`, `0x0`, `0.0` and a host name mapped to 0.0.0.0
all bind every interface while no literal list names them.
"""

from __future__ import annotations

import ipaddress
import socket


class AddressError(ValueError):
    """Host:port text that does not parse, or a listener address that is a wildcard; the
    message names the setting and its value."""


def is_wildcard_host(host: str) -> bool:
    """True for any address that means "every interface" ("", "*", 0.0.0.0, ::, ...)."""
    bare = host.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def parse_host_port(text: str, setting: str, *, min_port: int = 0) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; `setting` names what to fix.

    The host may be empty here (a wildcard: `listen_address` says so by name); a caller
    whose address must be dialled passes min_port=1 and checks the host itself."""
    host, sep, port = text.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if not sep or not port.isdigit() or not min_port <= int(port) <= 65535:
        raise AddressError(f"{setting}={text!r}: expected host:port "
                           f"(port {min_port}..65535)")
    if ":" in host and not bracketed:
        raise AddressError(f"{setting}={text!r}: an IPv6 host goes in brackets, "
                           f"[{host}]:{port}")
    return (host[1:-1] if bracketed else host), int(port)


def format_host_port(host: str, port: int) -> str:
    """The text `parse_host_port` reads back: an IPv6 host in brackets."""
    bare = host.strip().removeprefix("[").removesuffix("]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def listen_address(text: str, setting: str, *, min_port: int = 0) -> tuple[str, int]:
    """A host:port some listener binds: never a wildcard, literally or once resolved."""
    host, port = parse_host_port(text, setting, min_port=min_port)
    refusal = wildcard_refusal(host, f"{setting}={text!r}")
    if refusal:
        raise AddressError(refusal)
    return host, port


def wildcard_address(host: str) -> str | None:
    """The wildcard address `host` is or resolves to, or None when it names one interface.

    A host that does not resolve is not called a wildcard: binding it fails with its own
    error, which names the host better than this rule could."""
    if is_wildcard_host(host):
        return host.strip() or "''"
    bare = host.strip().removeprefix("[").removesuffix("]")
    try:
        found = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return None
    for *_, address in found:
        if is_wildcard_host(str(address[0])):
            return str(address[0])
    return None


def wildcard_refusal(host: str, setting: str) -> str | None:
    """Why `host` is refused, naming `setting` (e.g. "FLEET_HTTP='0:8000'"), or None."""
    address = wildcard_address(host)
    if address is None:
        return None
    how = "is" if address == host.strip() else f"resolves to {address}, which is"
    return (f"{setting}: {host!r} {how} a wildcard address (every interface); give the one "
            "address this machine is reached at (127.0.0.1, or its fleet network address)")
