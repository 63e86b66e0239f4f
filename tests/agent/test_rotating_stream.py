"""The agent's own log file: rotated by size into `.1` … `.N`, the oldest dropped, nothing
lost in between; and a real agent started with `--log-file` writes there, not to stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from agent.rotating_stream import RotatingStream
from tests.agent.conftest import REPO, agent_config
from tests.waiting import wait_until


def test_rotation_keeps_the_newest_backups_and_every_line_in_between(tmp_path):
    path = tmp_path / "logs" / "agent.log"
    stream = RotatingStream(path, max_bytes=100, backups=2)
    lines = [f"line {i:03d} {'x' * 20}\n" for i in range(30)]  # 30 bytes each: 3 per file
    for line in lines:  # the way print() writes: the text, then its end of line
        stream.write(line[:-1])
        stream.write("\n")
    stream.close()
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["agent.log", "agent.log.1", "agent.log.2"]
    kept = "".join((path.parent / name).read_text()
                   for name in ("agent.log.2", "agent.log.1", "agent.log"))
    assert kept == "".join(lines[-len(kept.splitlines()):])  # newest, in order, none lost
    assert all(os.path.getsize(path.parent / name) <= 100 for name in files)
    assert all(line.startswith("line ") for line in kept.splitlines())  # none split in two


def test_an_agent_with_a_log_file_rotates_it_and_leaves_stderr_quiet(fleet, tmp_path):
    log_path = tmp_path / "logs" / "agent.log"
    config = agent_config(fleet, tmp_path / "state", log_max_bytes=200, log_backups=2)
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    stderr_path = tmp_path / "stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config",
                                 str(config_path), "--standalone", "--log-file", str(log_path)],
                                env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=stderr,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def rotated_twice() -> bool:
        assert proc.poll() is None, stderr_path.read_text()
        return log_path.with_name("agent.log.2").exists()

    try:  # each of its start-up lines (child started, serving, probe done) is over 200 bytes
        wait_until(rotated_twice, within_s=90, what="the agent's log to rotate twice")
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    assert not log_path.with_name("agent.log.3").exists()
    assert stderr_path.read_text() == ""  # everything went to the file
    records = [json.loads(line) for name in ("agent.log.2", "agent.log.1", "agent.log")
               for line in log_path.with_name(name).read_text().splitlines()]
    assert all(r["node"] == config.node for r in records)
    assert "agent stopping" in [r["event"] for r in records]
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)  # .2, .1, then the file itself: oldest to newest
