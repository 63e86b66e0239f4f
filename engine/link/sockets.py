"""Plain sockets under the stage link: a listener on one named address, whether a port is
free to listen on, a bounded wait for a descriptor, a socket's address as text. Nothing
here knows frames."""

from __future__ import annotations

import select
import socket

from engine.addresses import is_wildcard_host, wildcard_address
from engine.link.errors import WildcardListen


def listen(host: str, port: int, *, backlog: int = 16) -> socket.socket:
    """A listening socket on one named address; a wildcard is refused (`WildcardListen`)."""
    wildcard = wildcard_address(host)  # the one rule every listener applies
    if wildcard is not None:
        how = "" if is_wildcard_host(host) else f" (it resolves to {wildcard})"
        raise WildcardListen(
            f"refusing to listen on {host!r}:{port}{how}: the stage link binds one named "
            "address (set FLEET_LISTEN to this machine's address on the fleet network)"
        )
    family, kind, proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener



def port_in_use(host: str, port: int) -> bool:
    """Would a listener on host:port fail to bind? (SO_REUSEADDR, as aiohttp binds.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_fd(fd: int, *, writable: bool, timeout_s: float) -> bool:
    """Wait until `fd` is readable (or writable); False on timeout. poll() where there is
    one, since select() refuses descriptors past FD_SETSIZE, which a big engine reaches."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT if writable else select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000 + 0.999))))
    readable, ready, _ = select.select([] if writable else [fd], [fd] if writable else [], [],
                                       timeout_s)
    return bool(readable or ready)


def peer_name(sock: socket.socket, *, peer: bool) -> str:
    try:
        address = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return "?"
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
