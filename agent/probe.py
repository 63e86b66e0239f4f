"""Link probe: round-trip time and bandwidth to a peer, over plain TCP on a stage port.

The peer agent opens a one-shot listener on a free port of the stage range and hands out a
one-time secret over the mutually authenticated API; the prober proves it knows the secret
(HMAC over the listener's nonce) before any measurement, so nobody else can use the port.
Plain TCP on purpose: it is what the stage link uses, so the numbers are the link's.
Every step has a deadline and the bulk transfer is capped on both sides.

Wire (all little-endian):  S→C  "RFPB" u8 version u8[3] 0 nonce[16]
                           C→S  HMAC-SHA256(secret, "ringfleet probe v1" ‖ nonce)  [32]
                           S→C  "OK" | "NO"
                           C→S  u32 pings, then each ping: u64 seq → S echoes it
                           C→S  u64 bulk bytes, then the bytes → S: u64 received, f64 seconds
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import ssl
import statistics
import struct
import time
from dataclasses import asdict, dataclass

import aiohttp
import structlog

from engine.addresses import wildcard_refusal

log = structlog.get_logger()

MAGIC = b"RFPB"
VERSION = 1
HELLO = struct.Struct("<4sB3x16s")
MAX_PINGS = 64
CHUNK = 1 << 20


class ProbeError(RuntimeError):
    """A probe that could not run or was refused; the message says which step failed."""


@dataclass(frozen=True)
class ProbeTicket:
    """What the listening side hands the prober (over mTLS): where, and the proof to show."""

    host: str
    port: int
    secret: str  # hex
    max_bytes: int
    expires_in_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    host: str
    port: int
    rtt_ms: float  # median of the pings
    rtt_min_ms: float
    pings: int
    bytes: int
    seconds: float
    bandwidth_bytes_per_s: float
    transport: str = "tcp"
    # The torch.distributed path's own probe (agent/dist_probe.py), when asked: transport
    # (gloo or nccl), rtt_ms, rtt_min_ms, pings, row_bytes, bytes, seconds,
    # bandwidth_bytes_per_s; or transport and error.
    dist: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"ringfleet probe v1" + nonce, hashlib.sha256).digest()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ProbeListener:
    """One session on one port of the stage range, then closed; or closed at its deadline."""

    def __init__(self, secret: bytes, max_bytes: int, max_s: float) -> None:
        self.secret = secret
        self.max_bytes = max_bytes
        self.max_s = max_s
        self.server: asyncio.Server | None = None
        self.port = 0
        self.used = False
        self.done = asyncio.Event()
        self._closer: asyncio.Task | None = None

    async def open(self, host: str, ports: range) -> int:
        refusal = wildcard_refusal(host, "the probe listener (the agent's listen_host)")
        if refusal:
            raise ProbeError(refusal)
        for port in ports:
            try:
                self.server = await asyncio.start_server(self._session, host, port,
                                                         reuse_address=True)
            except OSError:
                continue
            self.port = port
            self._closer = asyncio.get_running_loop().create_task(self._close_at_deadline())
            return port
        raise ProbeError(f"no free port for a probe in {ports.start}..{ports.stop - 1} on {host}")

    async def _close_at_deadline(self) -> None:
        try:
            await asyncio.wait_for(self.done.wait(), self.max_s)
        except TimeoutError:
            pass
        await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.done.set()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self.used:  # one session per ticket
            writer.close()
            return
        self.used = True
        _nodelay(writer)
        try:
            async with asyncio.timeout(self.max_s):
                nonce = secrets.token_bytes(16)
                writer.write(HELLO.pack(MAGIC, VERSION, nonce))
                await writer.drain()
                mac = await reader.readexactly(32)
                if not hmac.compare_digest(mac, proof(self.secret, nonce)):
                    writer.write(b"NO")
                    await writer.drain()
                    log.warning("probe refused: bad proof", peer=str(peer))
                    return
                writer.write(b"OK")
                (pings,) = struct.unpack("<I", await reader.readexactly(4))
                if pings > MAX_PINGS:
                    raise ProbeError(f"{pings} pings asked; at most {MAX_PINGS}")
                for _ in range(pings):
                    writer.write(await reader.readexactly(8))
                    await writer.drain()
                (total,) = struct.unpack("<Q", await reader.readexactly(8))
                if total > self.max_bytes:
                    raise ProbeError(f"{total} bytes asked; at most {self.max_bytes}")
                received, first = 0, None
                while received < total:
                    chunk = await reader.read(min(CHUNK, total - received))
                    if not chunk:
                        raise ProbeError("the prober closed mid-transfer")
                    first = first or time.perf_counter()
                    received += len(chunk)
                seconds = time.perf_counter() - first if first else 0.0
                writer.write(struct.pack("<Qd", received, seconds))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ProbeError) as exc:
            log.warning("probe session ended early", peer=str(peer), error=str(exc) or
                        type(exc).__name__)
        finally:
            writer.close()
            self.done.set()


async def open_listener(host: str, ports: range, max_bytes: int,
                        max_s: float) -> tuple[ProbeListener, ProbeTicket]:
    secret = secrets.token_bytes(32)
    listener = ProbeListener(secret, max_bytes, max_s)
    port = await listener.open(host, ports)
    return listener, ProbeTicket(host, port, secret.hex(), max_bytes, max_s)


async def ask_peer(peer: str, ssl_context: ssl.SSLContext, ask: dict, max_s: float) -> dict:
    """The peer agent's answer to /v1/probe/listen (a ticket, or a torch.distributed offer),
    asked over mutual TLS: the only channel a ticket's secret or an offer's token travels."""
    timeout = aiohttp.ClientTimeout(total=max_s)
    try:
        async with (aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(peer + "/v1/probe/listen", json=ask, ssl=ssl_context) as reply):
            raw = await reply.json(content_type=None)
            if reply.status != 200:
                raise ProbeError(f"{peer} refused to open a probe listener: {raw}")
    except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as exc:
        raise ProbeError(f"cannot reach peer agent {peer}: {exc or type(exc).__name__}") from exc
    return raw


async def run_probe(ticket: ProbeTicket, *, peer: str = "", pings: int = 10,
                    bytes_: int = 16 << 20, max_s: float = 20.0) -> ProbeResult:
    """Measure RTT (median of `pings`) and bandwidth (`bytes_`, capped by the ticket)."""
    pings = max(1, min(pings, MAX_PINGS))
    total = max(1, min(bytes_, ticket.max_bytes))
    secret = bytes.fromhex(ticket.secret)
    try:
        async with asyncio.timeout(max_s):
            reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
            _nodelay(writer)
            try:
                magic, version, nonce = HELLO.unpack(await reader.readexactly(HELLO.size))
                if magic != MAGIC or version != VERSION:
                    raise ProbeError(f"{ticket.host}:{ticket.port} is not a ringfleet probe "
                                     f"listener (magic {magic!r}, version {version})")
                writer.write(proof(secret, nonce))
                if await reader.readexactly(2) != b"OK":
                    raise ProbeError("the peer refused the probe's proof (wrong or used ticket)")
                writer.write(struct.pack("<I", pings))
                rtts = []
                for seq in range(pings):
                    t0 = time.perf_counter()
                    writer.write(struct.pack("<Q", seq))
                    await writer.drain()
                    if struct.unpack("<Q", await reader.readexactly(8))[0] != seq:
                        raise ProbeError("the peer echoed the wrong ping")
                    rtts.append(time.perf_counter() - t0)
                writer.write(struct.pack("<Q", total))
                block = b"\0" * min(CHUNK, total)
                t0 = time.perf_counter()
                sent = 0
                while sent < total:
                    n = min(len(block), total - sent)
                    writer.write(block[:n])
                    await writer.drain()
                    sent += n
                received, server_s = struct.unpack("<Qd", await reader.readexactly(16))
                elapsed = time.perf_counter() - t0
            finally:
                writer.close()
    except TimeoutError as exc:
        raise ProbeError(f"the probe of {ticket.host}:{ticket.port} took over {max_s:g} s") from exc
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise ProbeError(f"the probe of {ticket.host}:{ticket.port} failed: {exc}") from exc
    rtt = statistics.median(rtts)
    seconds = max(elapsed - rtt, server_s, 1e-9)
    return ProbeResult(peer, ticket.host, ticket.port, rtt * 1000, min(rtts) * 1000, pings,
                       int(received), seconds, received / seconds)
