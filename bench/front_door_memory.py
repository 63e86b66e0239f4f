"""Whether the front door's resident memory grows with the requests it relays (issue 29).

    python bench/front_door_memory.py                          # 40,000 requests, 20 clients
    python bench/front_door_memory.py --requests 10000 --checkpoints 5

Three processes on loopback: a stand-in rank 0 that answers at once (whole replies, streams,
and every seventh request its busy 503 with Retry-After), the front door (supervisor.front_door,
the app `fleet-front-door` serves) with `tracemalloc` on, and this one, whose clients send a
bounded count of requests through it. At each checkpoint the front door reports its resident
set, the live objects by type (after a full `gc`), and the biggest growths of traced memory
since the first checkpoint, by line. A leak of per-request objects grows with the count; an
allocator warming up levels off.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from engine.harness.launch import free_port

START_S = 30.0  # for the two servers to listen


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def upstream(port: int) -> None:
    """A rank 0 that answers every request at once (one in seven: busy)."""
    asked = Counter()

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "slots_in_use": 0})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked["n"] += 1
        if asked["n"] % 7 == 0:
            return web.json_response({"error": {"message": "busy"}}, status=503,
                                     headers={"Retry-After": "1"})
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hi"},
                                                   "finish_reason": "stop"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text, finish in (("one", None), ("two", None), ("", "stop")):
            chunk = {"choices": [{"index": 0, "delta": {"content": text},
                                  "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def front_door(port: int, upstream_port: int, report_port: int) -> None:
    from supervisor.front_door import FrontDoorConfig, Route, open_front_door

    tracemalloc.start(8)
    route = Route(url=f"http://127.0.0.1:{upstream_port}", replica="m-g1")
    config = FrontDoorConfig(lambda _model, _conversation: route,
                             lambda: [{"id": "m", "serving": True}])
    await open_front_door(config, "127.0.0.1", port)
    first: list[tracemalloc.Snapshot] = []

    async def report(_request: web.Request) -> web.Response:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        if not first:
            first.append(snapshot)
        growth = snapshot.compare_to(first[0], "lineno")[:8]
        types = Counter(type(o).__name__ for o in gc.get_objects())
        return web.json_response({
            "rss_kib": rss_kib(), "traced_kib": tracemalloc.get_traced_memory()[0] // 1024,
            "objects": sum(types.values()), "top_types": types.most_common(8),
            "growth": [f"{s.size_diff // 1024:+d} KiB {s.count_diff:+d} blocks "
                       f"{s.traceback[0].filename.split('site-packages/')[-1]}:"
                       f"{s.traceback[0].lineno}" for s in growth]})

    app = web.Application()
    app.router.add_get("/report", report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", report_port).start()
    await asyncio.Event().wait()


async def drive(args: argparse.Namespace, door: str, report: str) -> None:
    timeout = ClientTimeout(total=30)
    async with ClientSession(timeout=timeout) as reporter:
        async def sample(sent: int) -> None:
            async with reporter.get(report + "/report") as r:
                data = await r.json()
            print(f"{sent:>7} requests  rss {data['rss_kib'] / 1024:6.1f} MiB  traced "
                  f"{data['traced_kib'] / 1024:5.1f} MiB  objects {data['objects']:>7}")
            print("         types:", ", ".join(f"{t} {n}" for t, n in data["top_types"]))
            for line in data["growth"]:
                print("         ", line)

        per_step = args.requests // args.checkpoints
        outcomes: Counter[str] = Counter()
        # As many connections as clients: a request queued for one is not a front-door wait.
        async with ClientSession(door, timeout=timeout,
                                 connector=TCPConnector(limit=args.clients)) as client:
            async def one(i: int) -> None:
                body = {"model": "m", "stream": i % 2 == 1,
                        "messages": [{"role": "user", "content": f"q{i}"}]}
                try:
                    async with client.post("/v1/chat/completions", json=body) as r:
                        await r.read()
                        outcomes[str(r.status)] += 1
                except (ClientError, TimeoutError) as exc:
                    outcomes[type(exc).__name__] += 1

            async def batch(start: int, count: int) -> None:
                queue = iter(range(start, start + count))

                async def worker() -> None:
                    for i in queue:
                        await one(i)
                await asyncio.gather(*(worker() for _ in range(args.clients)))

            await batch(0, min(2000, per_step))  # warm-up before the baseline
            await sample(0)
            started = time.monotonic()
            for step in range(1, args.checkpoints + 1):
                await batch(step * per_step, per_step)
                await sample(step * per_step)
        took = time.monotonic() - started
        print(f"{args.requests} requests in {took:.0f} s; statuses {dict(outcomes)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--front-door", type=int, nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        asyncio.run(upstream(args.upstream))
        return 0
    if args.front_door:
        asyncio.run(front_door(*args.front_door))
        return 0
    up, door, report = free_port(), free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    children = [subprocess.Popen([*me, "--upstream", str(up)]),
                subprocess.Popen([*me, "--front-door", str(door), str(up), str(report)])]
    try:
        deadline = time.monotonic() + START_S
        asyncio.run(wait_listening((up, door, report), deadline))
        asyncio.run(drive(args, f"http://127.0.0.1:{door}", f"http://127.0.0.1:{report}"))
    finally:
        for child in children:
            child.terminate()
            child.wait(10)
    return 0


async def wait_listening(ports: tuple[int, ...], deadline: float) -> None:
    for port in ports:
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
