"""A program holding a LocalFleet (a bench, the demo), told to stop by SIGTERM, stops the
fleet's processes, which run in sessions of their own and would otherwise outlive it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil

from tests.sigterm import assert_sigterm_stops_all, kill_all

HOLDER = textwrap.dedent("""
    import signal, sys
    from pathlib import Path
    from supervisor.local import LocalFleet
    with LocalFleet(Path(sys.argv[1]), nodes=("node-a",)):
        print("up", flush=True)
        signal.pause()  # until the test's SIGTERM
""")


def test_sigterm_stops_the_fleet(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "fleet")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fleet: list[psutil.Process] = []
    try:
        assert holder.stdout.readline().strip() == "up", holder.stdout.read()
        fleet = psutil.Process(holder.pid).children()  # all started once "up" is printed
        assert sorted(next(a for a in p.cmdline() if a in ("supervisor.main", "agent.cli"))
                      for p in fleet) == ["agent.cli", "supervisor.main"]

        assert_sigterm_stops_all(holder, fleet, within_s=90)
    finally:
        kill_all(holder, fleet)
