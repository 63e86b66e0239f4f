"""The one wildcard rule for every listener: a host that is, or resolves to, "every interface"
is refused, whichever listener it is for (the supervisor's API and front door, an agent's API,
rank 0's HTTP API, the stage link).

The literal test is the link's `is_wildcard_host`; it is applied again to every address the
host resolves to, because `0`, `0x0`, `0.0` and a host name mapped to 0.0.0.0 all bind every
interface while no literal list names them.
"""

from __future__ import annotations

import socket

from engine.link.messages import is_wildcard_host


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
