"""The secrets a spawn carries (the link key, rank 0's API secret) under a real agent
process: written owner-only under a 0700 state directory, handed to the engine as file paths
(never kept in the run record or a view), and deleted when the engine ends or is refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import stat
from pathlib import Path

from tests.agent.conftest import (
    AgentProcess,
    agent_config,
    client,
    fake_engine_command,
    free_port,
    read_records,
    wait_state,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_files_are_owner_only_and_gone_with_their_engine(fleet, tmp_path, tiny_model):
    config = agent_config(fleet, tmp_path / "state", engine_command=fake_engine_command())
    agent = AgentProcess(config, tmp_path / "agent.log")
    link_key, api_secret = secrets.token_hex(32), secrets.token_hex(32)
    keys = config.state_dir / "keys"

    async def scenario() -> None:
        await agent.wait_up(fleet)
        async with client(fleet) as session:
            # Only rank 0 serves the API: a secret for another rank is refused, nothing stays.
            async with session.post(agent.url + "/v1/engines", json={
                    "engine_id": "r1", "link_key": link_key, "api_secret": api_secret,
                    "env": {"FLEET_MODEL": str(tiny_model), "RANK": "1", "WORLD_SIZE": "2",
                            "FLEET_LAYERS": "1:2", "FLEET_LAYOUT": "0:1,1:2",
                            "FLEET_LISTEN": f"127.0.0.1:{free_port()}"}}) as r:
                body = await r.json()
                assert r.status == 422 and body["error"]["field"] == "api_secret", body
            assert not list(keys.glob("r1.*"))
            async with session.post(agent.url + "/v1/engines", json={
                    "engine_id": "r0", "link_key": link_key, "api_secret": api_secret,
                    "env": {"FLEET_MODEL": str(tiny_model),
                            "FLEET_HTTP": f"127.0.0.1:{free_port()}"}}) as r:
                assert r.status == 201, await r.text()
                spawned = await r.text()
            view = await wait_state(session, agent.url, "r0", {"ready", "exited"}, 60)
            assert view["state"] == "ready", view
            assert mode(config.state_dir) == 0o700 and mode(keys) == 0o700
            assert (keys / "r0.key").read_text() == link_key and mode(keys / "r0.key") == 0o600
            assert (keys / "r0.api").read_text() == api_secret
            assert mode(keys / "r0.api") == 0o600
            [record] = read_records(config)
            assert record["spec"]["env"]["FLEET_API_SECRET_FILE"] == str(keys / "r0.api")
            async with session.get(agent.url + "/v1/engines") as r:
                listed = await r.text()
            for text in (json.dumps(record), spawned, listed):
                assert api_secret not in text and link_key not in text
            # The engine was given the file's path in its environment contract.
            log = (config.logs_dir / "engine-r0.log").read_text()
            assert f'"api_secret_file": "{keys / "r0.api"}"' in log
            async with session.post(agent.url + "/v1/engines/r0/drain", json={}) as r:
                assert r.status == 202
            await wait_state(session, agent.url, "r0", {"exited"}, 30)
            assert not list(keys.glob("r0.*"))

    try:
        asyncio.run(scenario())
    finally:
        agent.stop()
