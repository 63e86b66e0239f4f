"""What a host charges a pipeline stage for the gap between its rounds, apart from any link.

A stage of a decode ring waits while the other stages compute, then does a little work on a
row: takes it off a socket, copies it into a tensor. This prints, side by side in one run:

- a row's copy into a tensor (torch.frombuffer + copy, 512 bytes) right after the last one
  (hot), and after 4 ms spent elsewhere in the same process (a busy loop), and after 4 ms
  asleep: the round's small work once the CPU's caches and predictors served something else;
- a one-row socket round trip between two processes, answered at once, and answered after
  the peer computed for 4 ms, with the waiting end blocked in recv or polling its socket.

Ratios against the hot figures are what the decode hop per boundary (bench/pipeline.py)
pays on a host before any link code runs. Usage: python bench/host_latency.py [--gap-ms 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch

ROW_BYTES = 512
SAMPLES = 300


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def row_copy_us(gap_s: float, gap: str) -> float:
    """Median µs of one row's copy into a tensor, each after `gap_s` of `gap`."""
    buffer = bytearray(ROW_BYTES)
    times = []
    for _ in range(SAMPLES):
        if gap == "busy":
            _busy(gap_s)
        elif gap == "sleep":
            time.sleep(gap_s)
        start = time.perf_counter()
        torch.frombuffer(buffer, dtype=torch.bfloat16).view(1, -1).clone()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _poll_recv(sock: socket.socket, buffer: bytearray) -> None:
    while True:
        try:
            if sock.recv_into(buffer, 0, socket.MSG_DONTWAIT):
                return
        except BlockingIOError:
            pass


def round_trip_us(work_s: float, waiting: str) -> float:
    """Median µs of a one-row round trip beyond the peer's `work_s` of computing, the
    waiting end blocked in recv ("block") or polling its socket ("poll")."""
    here, there = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the peer: take a row, compute, send it back
        here.close()
        buffer = bytearray(ROW_BYTES)
        for _ in range(SAMPLES):
            there.recv_into(buffer)
            _busy(work_s)
            there.sendall(buffer)
        os._exit(0)
    there.close()
    row, buffer, times = bytes(ROW_BYTES), bytearray(ROW_BYTES), []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        here.sendall(row)
        if waiting == "poll":
            _poll_recv(here, buffer)
        else:
            here.recv_into(buffer)
        times.append(time.perf_counter() - start - work_s)
    os.waitpid(pid, 0)
    here.close()
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gap-ms", type=float, default=4.0,
                        help="the other stages' compute between a stage's rounds")
    gap_s = parser.parse_args().gap_ms / 1e3
    torch.set_num_threads(1)
    hot = row_copy_us(0.0, "none")
    print(f"| a row's copy into a tensor | µs | × hot |\n|---|---|---|\n| hot | {hot:.1f} | 1 |")
    for gap in ("busy", "sleep"):
        us = row_copy_us(gap_s, gap)
        print(f"| after {gap_s * 1e3:g} ms {'computing' if gap == 'busy' else 'asleep'} "
              f"| {us:.1f} | {us / hot:.1f} |")
    at_once = round_trip_us(0.0, "block")
    print(f"\n| one-row round trip beyond the peer's work | µs | × at once |\n|---|---|---|\n"
          f"| answered at once | {at_once:.1f} | 1 |")
    for waiting in ("block", "poll"):
        us = round_trip_us(gap_s, waiting)
        print(f"| after {gap_s * 1e3:g} ms of the peer's compute, waiting end "
              f"{'blocked in recv' if waiting == 'block' else 'polling'} "
              f"| {us:.1f} | {us / at_once:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
