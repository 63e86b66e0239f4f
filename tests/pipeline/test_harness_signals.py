"""`python -m engine.harness.launch`, told to stop by SIGTERM (`kill`, `timeout`), takes its
stages down with it rather than leaving them serving with nobody to stop them."""

from __future__ import annotations

import subprocess
import sys

import psutil

from engine.harness.launch import free_port
from tests.sigterm import assert_sigterm_stops_all, kill_all
from tests.waiting import wait_until


def test_sigterm_stops_every_stage(make_model, tmp_path):
    model = make_model("llama")
    port = free_port()
    log_path = tmp_path / "launch.log"
    log = log_path.open("wb")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "engine.harness.launch", "--model", str(model),
         "--stages", "0:1,1:3", "--context", "64", "--parallel", "1", "--chunk", "16",
         "--http-port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    stages: list[psutil.Process] = []
    try:
        # The launcher says it serves once rank 0 answers /health.
        wait_until(lambda: "serving " in log_path.read_text() or launcher.poll() is not None,
                   within_s=120, what="the launcher's word that it serves")
        assert launcher.poll() is None, log_path.read_text()
        stages = psutil.Process(launcher.pid).children()
        assert len(stages) == 2

        assert_sigterm_stops_all(launcher, stages, within_s=60)
    finally:
        kill_all(launcher, stages)
        log.close()

