"""Engine logs: each engine's log is rotated at its size cap, and the logs of old engines
are pruned when a new one starts (the newest `engine_logs_keep`, none older than
`engine_logs_max_age_s`, a running engine's never)."""

from __future__ import annotations

import asyncio
import sys

from agent.spawn import LogFile, engine_logs_to_prune
from tests.agent.conftest import agent_config, client, free_port, serving, wait_state

DAY = 86400.0


def test_which_logs_are_pruned():
    files = [LogFile("engine-old.log", 0.0), LogFile("engine-old.log.1", 0.0),
             LogFile("engine-mid.log", 5 * DAY), LogFile("engine-new.log", 9 * DAY),
             LogFile("engine-run.log", 0.0), LogFile("calibration.log", 0.0),
             LogFile("engine-new.log.2", 8 * DAY)]
    now = 10 * DAY
    assert engine_logs_to_prune(files, frozenset({"run"}), keep=2, max_age_s=30 * DAY,
                                now=now) == ["engine-old.log", "engine-old.log.1"]
    assert engine_logs_to_prune(files, frozenset({"run"}), keep=5, max_age_s=2 * DAY,
                                now=now) == ["engine-mid.log", "engine-old.log",
                                             "engine-old.log.1"]
    assert engine_logs_to_prune(files, frozenset({"run", "old"}), keep=1, max_age_s=DAY,
                                now=now) == ["engine-mid.log"]


# An engine that writes past its log's size cap, then exits as an engine does.
CHATTY = ("import json, sys\n"
          "for i in range(400): print('x' * 120, flush=True)\n"
          "sys.stderr.write(json.dumps({'event': 'exiting', 'code': 3, 'reason': 'done'}) + "
          "'\\n')\n"
          "sys.exit(3)\n")


def test_engine_logs_rotate_at_their_cap_and_old_engines_logs_are_pruned(fleet, tmp_path,
                                                                          tiny_model):
    config = agent_config(fleet, tmp_path, engine_command=(sys.executable, "-c", CHATTY),
                          engine_log_max_bytes=4096, engine_log_backups=2, engine_logs_keep=2)

    async def scenario():
        async with serving(config) as url, client(fleet) as session:
            for engine_id in ("g1", "g2", "g3", "g4"):
                body = dict(engine_id=engine_id, env={"FLEET_MODEL": str(tiny_model),
                                                      "FLEET_HTTP": f"127.0.0.1:{free_port()}"})
                async with session.post(url + "/v1/engines", json=body) as r:
                    assert r.status == 201, await r.text()
                view = await wait_state(session, url, engine_id, {"exited"}, 30)
                assert view["exit"]["code"] == 3

    asyncio.run(scenario())
    logs = sorted(p.name for p in config.logs_dir.glob("engine-*"))
    # When g4 started, g2 and g3 were the two newest engines that had exited: g1 went.
    # Each engine's 48 kB passed its 4 kB cap: rotated, never more than `backups` copies.
    assert not [name for name in logs if name.startswith("engine-g1.")], logs
    for engine_id in ("g2", "g3", "g4"):
        files = [name for name in logs if name.startswith(f"engine-{engine_id}.log")]
        assert f"engine-{engine_id}.log.1" in files and len(files) <= 3, logs
    assert (config.logs_dir / "engine-g4.log").stat().st_size <= 4096
