"""The stage link against a raw loopback socket, the two ends in two processes as in a ring.

    python bench/link_hop.py --sizes 512,4096,262144

Two measures a frame size, each for the link and for a plain TCP socket moving the same
bytes (`sendall` / `recv_into`): the hop, half a ping-pong's round trip (a decode round's
rows go and come back, one frame a hop, the sender waiting), and the stream, frames sent
back to back (a prompt chunk's bytes, or rounds queued behind each other). The peer is a
second process, as a ring's next stage is: two threads of one process would measure
their fight over the interpreter lock, not the link.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.link.frame import FrameKind
from engine.link.hello import Handshake
from engine.link.transport import Link, accept, connect, handshake, listen

KEY, FINGERPRINT = b"k" * 32, b"f" * 32
DEADLINE_S = 30.0


def _peer_link(port: int, size: int) -> Link:
    link = connect("127.0.0.1", port, deadline_s=DEADLINE_S, max_payload_bytes=size)
    handshake(link, Handshake(rank=1, world=2, fingerprint=FINGERPRINT, key=KEY),
              deadline_s=DEADLINE_S)
    return link


def run_peer(kind: str, mode: str, port: int, size: int, frames: int) -> None:
    """The far end: echo every frame (ping-pong) or take them all, then say done (stream)."""
    buffer = bytearray(size)
    if kind == "link":
        link = _peer_link(port, size)
        for i in range(frames):
            link.recv_rows_into(buffer, deadline_s=DEADLINE_S)
            if mode == "pingpong":
                link.send(FrameKind.ROWS, buffer, i, 1, deadline_s=DEADLINE_S)
        if mode == "stream":
            link.send(FrameKind.GO, deadline_s=DEADLINE_S)
        link.recv(deadline_s=DEADLINE_S)  # the bench's goodbye: both ends close in order
        link.close()
        return
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buffer)
    for _ in range(frames):
        got = 0
        while got < size:
            got += sock.recv_into(view[got:])
        if mode == "pingpong":
            sock.sendall(view)
    if mode == "stream":
        sock.sendall(b"!")
    sock.recv(1)
    sock.close()


def _spawn(kind: str, mode: str, port: int, size: int, frames: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--peer", kind, mode, str(port),
                             str(size), str(frames)])


def _time_link(mode: str, size: int, frames: int) -> float:
    listener = listen("127.0.0.1", 0)
    peer = _spawn("link", mode, listener.getsockname()[1], size, frames)
    try:
        link = accept(listener, deadline_s=DEADLINE_S, max_payload_bytes=size)
        handshake(link, Handshake(rank=0, world=2, fingerprint=FINGERPRINT, key=KEY),
                  deadline_s=DEADLINE_S)
        payload, buffer = bytearray(size), bytearray(size)
        link.send(FrameKind.ROWS, payload, 0, 1, deadline_s=DEADLINE_S)  # warm both ends
        if mode == "pingpong":
            link.recv_rows_into(buffer, deadline_s=DEADLINE_S)
        start = time.perf_counter()
        for i in range(1, frames):
            link.send(FrameKind.ROWS, payload, i, 1, deadline_s=DEADLINE_S)
            if mode == "pingpong":
                link.recv_rows_into(buffer, deadline_s=DEADLINE_S)
        if mode == "stream":
            link.recv(deadline_s=DEADLINE_S)
        took = time.perf_counter() - start
        link.send(FrameKind.GOODBYE, deadline_s=DEADLINE_S)
        link.close()
    finally:
        listener.close()
        peer.wait(DEADLINE_S)
    return took


def _time_raw(mode: str, size: int, frames: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    peer = _spawn("raw", mode, listener.getsockname()[1], size, frames)
    try:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, view = bytearray(size), memoryview(bytearray(size))

        def back() -> None:
            got = 0
            while got < size:
                got += sock.recv_into(view[got:])

        sock.sendall(payload)
        if mode == "pingpong":
            back()
        start = time.perf_counter()
        for _ in range(1, frames):
            sock.sendall(payload)
            if mode == "pingpong":
                back()
        if mode == "stream":
            sock.recv(1)
        took = time.perf_counter() - start
        sock.sendall(b"!")
        sock.close()
    finally:
        listener.close()
        peer.wait(DEADLINE_S)
    return took


def link_vs_raw(size: int, frames: int) -> dict[str, float]:
    """Hop µs (half a round trip) and stream GB/s, link and raw, for frames of `size` bytes."""
    out = {}
    for mode in ("pingpong", "stream"):
        link_s, raw_s = _time_link(mode, size, frames), _time_raw(mode, size, frames)
        if mode == "pingpong":
            out["link_hop_us"] = link_s / (2 * (frames - 1)) * 1e6
            out["raw_hop_us"] = raw_s / (2 * (frames - 1)) * 1e6
        else:
            out["link_gbs"] = size * (frames - 1) / link_s / 1e9
            out["raw_gbs"] = size * (frames - 1) / raw_s / 1e9
    return out


def frames_for(size: int) -> int:
    """Enough frames to time (about 100 MB, 200 to 5,000 frames)."""
    return max(200, min(5000, int(1e8 // max(size, 1))))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        kind, mode, port, size, frames = sys.argv[2:7]
        run_peer(kind, mode, int(port), int(size), int(frames))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512,4096,262144", help="payload bytes a frame")
    args = parser.parse_args()
    print("| bytes | frames | link hop µs | raw hop µs | raw / link (hop) | link GB/s | "
          "raw GB/s | link / raw (stream) |\n|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        frames = frames_for(size)
        r = link_vs_raw(size, frames)
        print(f"| {size} | {frames} | {r['link_hop_us']:.1f} | {r['raw_hop_us']:.1f} | "
              f"{r['raw_hop_us'] / r['link_hop_us']:.2f} | {r['link_gbs']:.3g} | "
              f"{r['raw_gbs']:.3g} | {r['link_gbs'] / r['raw_gbs']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
