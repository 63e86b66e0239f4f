"""The one child-process wrapper: stop escalation, exit records, log tailing and rotation."""

from __future__ import annotations

import asyncio
import signal
import sys

from agent.child import (
    ChildProcess,
    GracePeriods,
    LogTail,
    RotatingLog,
    explain_exit,
    same_process_alive,
)
from tests.waiting import wait_until_async

IGNORES_TERM = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('{\"event\": \"ready\"}', flush=True)\n"
                "time.sleep(60)\n")


def test_explain_exit_names_who_ended_the_child():
    grace = GracePeriods(term_s=3)
    assert explain_exit(-9, "SIGKILL", None, grace)[2] == (
        "killed with SIGKILL: it did not exit within 3 s after SIGTERM")
    assert "out-of-memory" in explain_exit(-9, "itself", None, grace)[2]
    assert explain_exit(2, "itself", {"code": 2, "reason": "bad checkpoint"}, None) == (
        2, None, "bad checkpoint")
    assert explain_exit(0, "SIGTERM", None, grace) == (0, None, "exited normally")
    assert explain_exit(None, "itself", {"code": 0, "reason": "drained"}, None) == (
        0, None, "drained")
    assert "after the agent's SIGTERM" in explain_exit(None, "SIGTERM", None, grace)[2]
    assert "code 7" in explain_exit(7, "itself", None, None)[2]
    assert explain_exit(2, "itself", None, None, "fleet-engine: FLEET_MODEL is not set")[2] == (
        "exited with code 2: fleet-engine: FLEET_MODEL is not set")


def test_sigkill_follows_an_ignored_sigterm(tmp_path):
    async def scenario():
        lines = []
        child = ChildProcess.spawn("stubborn", [sys.executable, "-c", IGNORES_TERM], {},
                                   RotatingLog(tmp_path / "c.log"),
                                   on_line=lambda line, ev: lines.append(ev))
        child.start_monitor()
        await wait_until_async(lambda: lines, within_s=10, what="the child's first line")
        assert lines[0] == {"event": "ready"}
        exit_ = await child.stop(GracePeriods(term_s=0.5, kill_s=5))
        assert exit_ is not None
        assert (exit_.signal, exit_.stopped_by) == ("SIGKILL", "SIGKILL")
        assert "did not exit within 0.5 s" in exit_.reason
        assert not same_process_alive(child.pid, child.create_time)

    asyncio.run(scenario())


def test_a_child_that_exits_by_itself_is_explained_with_its_own_words(tmp_path):
    script = ("import json, sys\n"
              "sys.stderr.write(json.dumps({'event': 'exiting', 'code': 4, "
              "'reason': 'config.json: missing field'}) + '\\n')\n"
              "sys.exit(4)\n")

    async def scenario():
        child = ChildProcess.spawn("quitter", [sys.executable, "-c", script], {},
                                   RotatingLog(tmp_path / "q.log"))
        exit_ = await child.wait(30)
        assert (exit_.code, exit_.reason, exit_.stopped_by) == (
            4, "config.json: missing field", "itself")
        assert exit_.last_lines

    asyncio.run(scenario())


def test_adopting_a_process_watches_it_without_being_its_parent(tmp_path):
    log = RotatingLog(tmp_path / "a.log")

    async def scenario():
        first = ChildProcess.spawn("first", [sys.executable, "-c", "import time; time.sleep(60)"],
                                   {}, log)
        adopted = ChildProcess.adopt("again", first.pid, first.create_time, log)
        assert adopted is not None and adopted.adopted
        assert ChildProcess.adopt("wrong", first.pid, first.create_time - 100, log) is None
        adopted.start_monitor()
        assert adopted.signal_group(signal.SIGTERM)
        first.popen.wait(10)  # reap it (we are its parent here)
        exit_ = await adopted.wait(10)
        assert exit_ is not None and exit_.code is None

    asyncio.run(scenario())


def test_log_tail_follows_copy_truncate_rotation(tmp_path):
    path = tmp_path / "r.log"
    log = RotatingLog(path, max_bytes=10, backups=2)
    tail = LogTail(path)
    with open(path, "ab") as f:
        f.write(b"one\ntwo\nthr")
        f.flush()
        assert tail.read_lines() == ["one", "two"]
        f.write(b"ee\n")
        f.flush()
        assert tail.read_lines() == ["three"]
        f.write(b"late\n")  # written after the last read, before the rotation
        f.flush()
        copy = log.rotate()
        assert copy.read_bytes() == b"one\ntwo\nthree\nlate\n"
        assert tail.after_rotation(copy) == ["late"]
        f.write(b"four\n")  # O_APPEND: lands at the start of the truncated file
        f.flush()
        assert tail.read_lines() == ["four"]
        log.rotate()
        assert (tmp_path / "r.log.2").exists()
