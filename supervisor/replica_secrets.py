"""A replica's secrets on the supervisor's disk: the stage link's shared key and rank 0's API
secret, one 0600 file each in the state directory's keys/ (0700).

Both are made when the replica's stages are first spawned and sent to the agents inside the
mutual-TLS spawn request. They are files, not rows of the replica record, so that `status`
(which prints records) can never show them, and so that a restarted supervisor finds the API
secret again and keeps routing to the replica it re-adopts. They are deleted when the replica
ends (stopped or failed): a replica id is never started again.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from pathlib import Path

from agent.pki import private_dir, write_private

LINK_KEY, API_SECRET = "key", "api"  # file suffixes
SECRET_BYTES = 32


class ReplicaSecrets:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cache: dict[tuple[str, str], str] = {}

    def path(self, replica_id: str, kind: str) -> Path:
        return self.directory / f"{replica_id}.{kind}"

    def make(self, replica_id: str, kind: str) -> str:
        """The secret, made (random, hex) and written the first time it is asked for."""
        secret = self.read(replica_id, kind)
        if not secret:
            secret = secrets.token_hex(SECRET_BYTES)
            write_private(private_dir(self.directory) / self.path(replica_id, kind).name,
                          secret.encode())
            self.cache[(replica_id, kind)] = secret
        return secret

    def read(self, replica_id: str, kind: str) -> str:
        """The secret if it exists ("" if not); read from disk once, then from memory."""
        key = (replica_id, kind)
        if key not in self.cache:
            try:
                self.cache[key] = self.path(replica_id, kind).read_text().strip()
            except FileNotFoundError:
                return ""
        return self.cache[key]

    def forget(self, replica_id: str) -> None:
        for kind in (LINK_KEY, API_SECRET):
            self.cache.pop((replica_id, kind), None)
            self.path(replica_id, kind).unlink(missing_ok=True)

    def keep_only(self, replica_ids: Iterable[str]) -> list[str]:
        """Delete the files of every replica not named (ended while the supervisor was down);
        returns the replica ids whose files went."""
        if not self.directory.is_dir():
            return []
        private_dir(self.directory)  # a directory from before this rule
        keep = set(replica_ids)
        gone = sorted({p.stem for p in self.directory.iterdir()
                       if p.suffix in (f".{LINK_KEY}", f".{API_SECRET}")} - keep)
        for replica_id in gone:
            self.forget(replica_id)
        return gone
