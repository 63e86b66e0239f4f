"""Link probe over torch.distributed: the path a hop between two nodes' stages takes when
FLEET_HOP_TRANSPORT puts it there (NCCL between CUDA nodes, gloo between CPU ones).

Each agent runs its end in a child process (`python -m agent.dist_probe`), so an agent never
holds torch or a CUDA context itself. The two ends meet the way a hop does
(`engine.pipeline.hop_transport.open_store` / `join_store` / `make_group`): the listening
side's child opens a TCPStore and writes its offer (host, port, random token) on its stdout;
its agent hands the offer to the prober only over the mutual-TLS API; the prober's child
reads it on its stdin. So only a fleet member the peer agent answered learns where and
under what name to meet. Then: `pings` one-row ping-pongs (after one not timed) and one bulk
transfer of `bytes`, each wait bounded by what is left of `max_s`; the parent kills a child
still running at `max_s`.

Child request (one JSON line on stdin): role "serve" | "join", kind "gloo" | "nccl",
host (serve), offer (join), pings, row_bytes, bytes, max_s. Its answer, one JSON line on
stdout: the offer (serve, first), then the result or {"error": ...}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import structlog

from agent.probe import MAX_PINGS, ProbeError

log = structlog.get_logger()

KINDS = ("gloo", "nccl")
ROW_BYTES = 8192  # a decode row of a 4096-wide bf16 model
BULK_CHUNK = 16 << 20  # the bulk goes in tensors of at most this many bytes


def checked_kind(kind: str) -> str:
    """`kind` if it is a torch.distributed path the probe knows, else ProbeError."""
    if kind not in KINDS:
        raise ProbeError(f"unknown torch.distributed probe {kind!r} (expected one of "
                         f"{', '.join(KINDS)})")
    return kind


def request(role: str, kind: str, *, pings: int, row_bytes: int, bytes_: int, max_s: float,
            host: str = "", offer: dict[str, Any] | None = None) -> dict[str, Any]:
    """A child's request, its numbers bounded (refused: an unknown kind)."""
    return {"role": role, "kind": checked_kind(kind), "host": host, "offer": offer,
            "pings": max(1, min(int(pings), MAX_PINGS)),
            "row_bytes": max(4, min(int(row_bytes), 1 << 20)),
            "bytes": max(1, int(bytes_)), "max_s": float(max_s)}


class DistProbeChild:
    """One end's child process, killed at its deadline (or when its agent stops)."""

    def __init__(self, proc: asyncio.subprocess.Process, max_s: float) -> None:
        self.proc = proc
        self.deadline = time.monotonic() + max_s

    @classmethod
    async def start(cls, ask: dict[str, Any]) -> DistProbeChild:
        from agent.spawn import engine_pythonpath

        env = dict(os.environ, PYTHONPATH=engine_pythonpath(), PYTHONUNBUFFERED="1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent.dist_probe", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(ask).encode() + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        return cls(proc, ask["max_s"])

    async def answer(self, doing: str) -> dict[str, Any]:
        """The child's next JSON line, or ProbeError (killed) past the deadline."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            await self.stop()
            raise ProbeError(f"the torch.distributed probe's {doing} took too long") from None
        try:
            found = json.loads(line)
        except ValueError:
            await self.stop()
            raise ProbeError(f"the torch.distributed probe's {doing} ended without an answer "
                             f"(exit {self.proc.returncode})") from None
        if "error" in found:
            raise ProbeError(f"torch.distributed probe: {found['error']}")
        return found

    async def reap(self) -> None:
        """Wait for the listening child as a background task and log how its end went;
        cancelled (its agent stopping), it is killed, not left behind."""
        try:
            ended = await self.answer("end")
            log.info("torch.distributed probe served", ok=bool(ended.get("ok")))
        except ProbeError as error:
            log.warning("torch.distributed probe not served", error=str(error))
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


async def serve(ask: dict[str, Any]) -> tuple[DistProbeChild, dict[str, Any]]:
    """The listening end: its child, once it has opened the store, and the offer it made
    (for the prober, over mutual TLS only)."""
    child = await DistProbeChild.start(ask)
    try:
        return child, await child.answer("store")
    except ProbeError:
        await child.stop()
        raise


async def measure(offer: dict[str, Any], max_s: float) -> dict[str, Any]:
    """The prober's end: join the group the offer names, measure, and say what was seen."""
    child = await DistProbeChild.start(request(
        "join", offer["backend"], offer=offer, pings=offer["pings"],
        row_bytes=offer["row_bytes"], bytes_=offer["bytes"], max_s=max_s))
    try:
        return await child.answer("measurement")
    finally:
        await child.stop()


# --- the child --------------------------------------------------------------------------

def _run(ask: dict[str, Any], say: Any) -> dict[str, Any]:
    import torch

    from engine.pipeline.hop_transport import INIT_TIMEOUT_S, join_store, make_group, open_store

    deadline = time.monotonic() + ask["max_s"]

    def left() -> timedelta:
        return timedelta(seconds=max(0.1, deadline - time.monotonic()))

    serving = ask["role"] == "serve"
    # The listening end waits for the prober's child to start (what is left of max_s); the
    # prober's finds the store already up, and a dead one is given up as a hop's would be.
    init_s = max(1.0, deadline - time.monotonic())
    init_s = init_s if serving else min(init_s, INIT_TIMEOUT_S)
    if serving:
        store, offer = open_store(ask["host"], ask["kind"], init_s)
        say(dict(offer, pings=ask["pings"], row_bytes=ask["row_bytes"], bytes=ask["bytes"]))
    else:
        offer = ask["offer"]
        store = join_store(offer, init_s)
    group, device = make_group(ask["kind"], store, offer["token"], 0 if serving else 1, init_s)
    other = 1 if serving else 0
    row = torch.zeros(ask["row_bytes"], dtype=torch.uint8, device=device)
    rtts = []
    for ping in range(ask["pings"] + 1):  # the first is not timed: it builds the path
        t0 = time.perf_counter()
        if serving:
            group.recv([row], other, 0).wait(left())
            group.send([row], other, 0).wait(left())
        else:
            row.fill_(ping % 251)
            group.send([row], other, 0).wait(left())
            group.recv([row], other, 0).wait(left())
            if int(row[0].item()) != ping % 251:
                raise ProbeError("the peer echoed the wrong ping")
            if ping:
                rtts.append(time.perf_counter() - t0)
    chunk = torch.zeros(min(ask["bytes"], BULK_CHUNK), dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    sent = 0
    move = group.recv if serving else group.send
    while sent < ask["bytes"]:
        part = chunk[:min(chunk.numel(), ask["bytes"] - sent)]
        move([part], other, 0).wait(left())
        sent += part.numel()
    if serving:
        ack.fill_(sent)
        group.send([ack], other, 0).wait(left())
        return {"ok": True}
    group.recv([ack], other, 0).wait(left())
    received = int(ack.item())  # on NCCL, waits for the device: the bulk has landed
    elapsed = time.perf_counter() - t0
    rtt = statistics.median(rtts)
    seconds = max(elapsed - rtt / 2, 1e-9)  # the ack's one way is not the bulk's
    return {"transport": ask["kind"], "rtt_ms": rtt * 1000, "rtt_min_ms": min(rtts) * 1000,
            "pings": len(rtts), "row_bytes": ask["row_bytes"], "bytes": received,
            "seconds": seconds, "bandwidth_bytes_per_s": received / seconds}


def main() -> int:
    def say(answer: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    try:
        say(_run(json.loads(sys.stdin.readline()), say))
        return 0
    except Exception as error:  # noqa: BLE001 - the parent reports it beside the TCP probe
        say({"error": f"{type(error).__name__}: {error}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
