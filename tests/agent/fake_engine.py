"""A stand-in for `fleet-engine` with bad manners on request: ignores SIGTERM, dies at start."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def say(**event: object) -> None:
    sys.stderr.write(json.dumps(event) + "\n")
    sys.stderr.flush()


def main() -> int:
    # Manners come from the command line or, per spawn, from FLEET_MODEL_ID.
    flags = sys.argv[1:] + os.environ.get("FLEET_MODEL_ID", "").split("+")
    if "--die" in flags:
        say(event="cannot start", reason="the fake engine was told to die")
        say(event="exiting", code=3, reason="told to die at start")
        return 3
    if "--ignore-term" in flags:
        signal.signal(signal.SIGTERM, lambda *_: say(event="ignoring SIGTERM"))
    else:
        def stop(*_: object) -> None:
            say(event="exiting", code=0, reason="drained")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
    if "--spawn-grandchild" in flags:  # a process that stays in the group: must not outlive us
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        say(event="grandchild", pid=child.pid)
    say(event="ready", layers=os.environ.get("FLEET_LAYERS", ""),
        api_secret_file=os.environ.get("FLEET_API_SECRET_FILE", ""))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
