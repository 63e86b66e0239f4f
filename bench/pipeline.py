"""Split against whole on one machine, and the stage link against a raw loopback socket.

    python bench/pipeline.py --preset demo --stages 2                        # CPU
    python bench/pipeline.py --preset 8b --backends torch-cuda,torch-cuda --devices 0,0
    python bench/pipeline.py --preset 8b --backends torch-cuda,torch-cuda --devices 0,1
    python bench/pipeline.py --preset demo --backends torch-cpu,mlx-cpu     # a mixed ring

Prints, from one run: decode ms per step at 1 and 8 streams and prompt time, whole vs
split, as ratios (a mixed ring against each of its backends alone); the cost of each boundary at decode (split minus whole, over the number
of hops a round makes, the return to rank 0 included); and the link's throughput for row
frames against a raw socket moving the same bytes on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import checkpoint, median_s, n_layers, table
from engine.harness.driver import RoundDriver
from engine.harness.launch import even_stages
from engine.harness.local_pipeline import local_pipeline, whole_runner
from engine.link.frame import FrameKind
from engine.link.hello import Handshake
from engine.link.transport import accept, connect, handshake, listen


def measure(runner, streams: list[int], steps: int, prompt: int, chunk: int,
            repeats: int) -> dict:
    """Decode ms per step for each stream count, and prompt ms for one stream in chunks."""
    driver = RoundDriver(runner)
    rng = np.random.default_rng(0)
    out = {}
    for n in streams:
        prompts = {s: rng.integers(0, 256, 16).tolist() for s in range(n)}

        def decode(prompts=prompts) -> None:
            driver.greedy(prompts, steps)
            driver.close(list(prompts))

        def open_only(prompts=prompts) -> None:
            driver.greedy(prompts, 0)
            driver.close(list(prompts))

        out[f"decode{n}"] = (median_s(decode, repeats=repeats)
                             - median_s(open_only, repeats=repeats)) * 1000 / steps
    long_prompt = rng.integers(0, 256, prompt).tolist()

    def prefill() -> None:
        for start in range(0, prompt, chunk):
            driver.round({0: long_prompt[start:start + chunk]})
        driver.close([0])

    out["prompt"] = median_s(prefill, repeats=repeats) * 1000
    return out


def read_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def phase_medians(timings: list[dict]) -> dict[str, float]:
    """Median of each phase over one-row rounds (one stream decoding)."""
    decode = [t for t in timings if t.get("rows") == 1]
    names = [k for k in (decode[0] if decode else {}) if k not in ("rows", "round", "event",
                                                                    "level", "timestamp",
                                                                    "rank", "replica")]
    return {k: statistics.median(t[k] for t in decode) for k in names}


def link_vs_raw(payload_bytes: int, frames: int) -> tuple[float, float]:
    """GB/s of ROWS frames over an authenticated link, and of the same bytes on a raw socket."""
    payload = bytearray(np.random.default_rng(0).bytes(payload_bytes))

    def pair():
        listener = listen("127.0.0.1", 0)
        port = listener.getsockname()[1]
        box = {}
        thread = threading.Thread(target=lambda: box.update(server=accept(
            listener, deadline_s=10, max_payload_bytes=payload_bytes)))
        thread.start()
        client = connect("127.0.0.1", port, deadline_s=10, max_payload_bytes=payload_bytes)
        thread.join()
        listener.close()
        key, fp = b"k" * 32, b"f" * 32
        t = threading.Thread(target=handshake, args=(box["server"], Handshake(
            rank=1, world=2, fingerprint=fp, key=key)), kwargs={"deadline_s": 10})
        t.start()
        handshake(client, Handshake(rank=0, world=2, fingerprint=fp, key=key), deadline_s=10)
        t.join()
        return client, box["server"]

    client, server = pair()
    buffer = bytearray(payload_bytes)

    def receive() -> None:
        for _ in range(frames):
            server.recv_rows_into(buffer, deadline_s=30)

    start = time.perf_counter()
    t = threading.Thread(target=receive)
    t.start()
    for i in range(frames):
        client.send(FrameKind.ROWS, payload, i, 1, deadline_s=30)
    t.join()
    link_s = time.perf_counter() - start
    client.close()
    server.close()

    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buffer)

    def raw_receive() -> None:
        for _ in range(frames):
            got = 0
            while got < payload_bytes:
                got += b.recv_into(view[got:])

    start = time.perf_counter()
    t = threading.Thread(target=raw_receive)
    t.start()
    for _ in range(frames):
        a.sendall(payload)
    t.join()
    raw_s = time.perf_counter() - start
    a.close()
    b.close()
    gb = payload_bytes * frames / 1e9
    return gb / link_s, gb / raw_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--backends", default="torch-cpu,torch-cpu",
                        help="one per stage; rank 0 first")
    parser.add_argument("--devices", help="CUDA device per stage, e.g. 0,1 (two GPUs) or 0,0")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = checkpoint(args.model, args.preset)
    backends = args.backends.split(",")
    layers = n_layers(model_dir)
    stages = even_stages(layers, len(backends))
    streams = [int(s) for s in args.streams.split(",")]
    # The driver opens every stream's 16-token prompt in one round.
    shape = dict(parallel=max(streams), context=args.prompt + args.steps + 64,
                 chunk=max(args.chunk, 16 * max(streams)))
    rank_env = {}
    if args.devices:
        for rank, device in enumerate(args.devices.split(",")):
            if rank:
                rank_env[rank] = {"CUDA_VISIBLE_DEVICES": device}

    threads = max(1, (os.cpu_count() or 1) // len(stages))
    if any(b.startswith("torch-") for b in backends):
        import torch

        # Like for like: the whole model gets the CPU threads each stage gets (launch's
        # split), so the comparison isolates the ring, not a thread count.
        torch.set_num_threads(threads)
    wholes = {}
    for backend in dict.fromkeys(backends):  # each backend alone, in placement order
        wholes[backend] = measure(whole_runner(model_dir, backend=backend, **shape), streams,
                                  args.steps, args.prompt, args.chunk, args.repeats)
        print(f"# whole on {backend}: {wholes[backend]}", flush=True)
    with tempfile.TemporaryDirectory() as run_dir:
        with local_pipeline(model_dir, stages, Path(run_dir), backends=backends,
                            rank_env=rank_env, extra_env={"FLEET_LOG_LEVEL": "debug"},
                            **shape) as runner:
            split = measure(runner, streams, args.steps, args.prompt, args.chunk,
                            args.repeats)
            row_format = runner.stage.row_format
            phases = [phase_medians(list(runner.timings))]
        for rank in range(1, len(stages)):
            phases.append(phase_medians(
                [e for e in read_events(Path(run_dir) / f"rank{rank}.log")
                 if e.get("event") == "round timing"]))
    print(f"# split {stages} on {backends}: {split}", flush=True)
    hops = len(stages)  # rank 0 -> 1 -> ... -> last -> rank 0
    rows = []
    for backend, whole in wholes.items():
        for n in streams:
            key = f"decode{n}"
            rows.append([f"decode ms/step, {n} stream(s)", backend, whole[key], split[key],
                         split[key] / whole[key], (split[key] - whole[key]) * 1000 / hops])
        rows.append([f"prompt ms, {args.prompt} tokens", backend, whole["prompt"],
                     split["prompt"], split["prompt"] / whole["prompt"], "-"])
    table("where a one-stream decode round's time goes, per stage (median ms)",
          ["rank", "phases"], [[rank, ", ".join(f"{k} {v:.3f}" for k, v in p.items())]
                               for rank, p in enumerate(phases)])
    placement = ", ".join(f"{a}:{b}@{be}" for (a, b), be in zip(stages, backends, strict=True))
    table(f"split vs whole, {model_dir.name}, {placement}",
          ["measure", "whole on", "whole", "split", "split / whole", "µs per boundary"], rows)

    link_rows = []
    for rows_per_frame in (1, 8, args.chunk):
        size = row_format.nbytes(rows_per_frame)
        frames = max(50, min(5000, int(2e8 // size)))
        link_gbs, raw_gbs = link_vs_raw(size, frames)
        link_rows.append([rows_per_frame, size, frames, link_gbs, raw_gbs, link_gbs / raw_gbs])
    table("stage link vs raw loopback socket (same bytes)",
          ["rows a frame", "bytes", "frames", "link GB/s", "raw GB/s", "link / raw"], link_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
