"""The one child-process wrapper: stop escalation, exit records, log tailing and rotation."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from agent.child import (
    ChildProcess,
    GracePeriods,
    LogTail,
    RotatingLog,
    explain_exit,
    is_stopped,
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
    # A SIGKILL the agent did not send: who sent it is not known, and nothing is guessed.
    assert explain_exit(-9, "itself", None, grace) == (
        None, "SIGKILL", "killed by SIGKILL from outside the agent")
    assert explain_exit(-9, "SIGTERM", None, grace, oom_kills=0)[2] == (
        "killed by SIGKILL from outside the agent")
    # Only the cgroup's own count names the out-of-memory killer.
    assert "out-of-memory killer (its cgroup counted 1 OOM kill(s)" in explain_exit(
        -9, "itself", None, grace, oom_kills=1)[2]
    # A drain done and logged (code 0), then the agent's SIGTERM ended the teardown: drained.
    assert explain_exit(-15, "SIGTERM", {"code": 0, "reason": "drained"}, grace) == (
        0, None, "drained")
    assert explain_exit(-9, "itself", {"code": 0, "reason": "drained"}, grace) == (
        0, None, "drained; then SIGKILL from outside the agent ended its teardown")
    # A last word that was not clean does not hide the signal.
    assert explain_exit(-15, "SIGTERM", {"code": 1, "reason": "ring dead"}, grace) == (
        None, "SIGTERM", "ended by the agent's SIGTERM")
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


def test_sigkill_ends_a_stopped_child(tmp_path):
    """A frozen engine (SIGSTOP: what the supervisor fails when its rank 0 stops answering)
    cannot run its SIGTERM handler, which would end it at once; the stop's SIGKILL does."""
    exits_on_term = IGNORES_TERM.replace("signal.SIG_IGN", "lambda *_: sys.exit(0)")

    async def scenario():
        lines = []
        child = ChildProcess.spawn("frozen", [sys.executable, "-c", exits_on_term], {},
                                   RotatingLog(tmp_path / "f.log"),
                                   on_line=lambda line, ev: lines.append(ev))
        child.start_monitor()
        await wait_until_async(lambda: lines, within_s=10, what="the child's first line")
        os.kill(child.pid, signal.SIGSTOP)
        await wait_until_async(lambda: is_stopped(child.pid, child.create_time), within_s=10,
                               what="the child stopped")
        # A grace longer than the test's own bound: only a kill that does not wait it out
        # ends the child in time (its memory is not held while a replacement loads).
        exit_ = await asyncio.wait_for(child.stop(GracePeriods(term_s=600, kill_s=5)), 60)
        assert exit_ is not None
        assert (exit_.signal, exit_.stopped_by) == ("SIGKILL", "SIGKILL")
        assert "stopped (SIGSTOP)" in exit_.reason
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


def test_oom_kill_counts_are_read_from_the_cgroup_files(tmp_path):
    from agent.oom_kills import oom_counter_path, read_oom_kills

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/fleet/agent.service\n")
    events = root / "fleet" / "agent.service" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert oom_counter_path(7, proc, root) == events and read_oom_kills(events) == 2
    (proc / "8").mkdir()  # cgroup v1, namespaced: the memory tree's root is its own cgroup
    (proc / "8" / "cgroup").write_text("4:memory:/elsewhere/abc\n0::/\n")
    v1 = root / "memory" / "memory.oom_control"
    v1.parent.mkdir()
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_counter_path(8, proc, root) == v1 and read_oom_kills(v1) == 5
    assert oom_counter_path(9, proc, root) is None  # no such process: nothing claimed
    assert read_oom_kills(None) is None and read_oom_kills(tmp_path / "absent") is None
