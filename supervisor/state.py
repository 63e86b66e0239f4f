"""The supervisor's state on disk: one SQLite file in the state directory.

It keeps the desired state (the applied fleet.yaml's text), the members, every replica with
its placement, join tokens (hashes only), the certificate pinned for each joined node (and
those revoked), the calibrations and link probes measured (with their age and the software
they were measured with, so a restart need not measure again) and an event log. The file,
its WAL and the directory are its owner's only (0600, 0700): they name every node and
replica. Writes are small and immediate
(autocommit, WAL), so a supervisor that is killed and started again finds the replicas it
was running and re-adopts them instead of restarting them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.pki import TokenRecord, private_dir
from supervisor.lifecycle import Replica
from supervisor.membership import Member

SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (node TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replicas (
    id TEXT PRIMARY KEY, model_id TEXT NOT NULL, generation INTEGER NOT NULL,
    state TEXT NOT NULL, record TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (secret_sha256 TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins (
    node TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, pinned_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS revoked (
    fingerprint TEXT PRIMARY KEY, node TEXT NOT NULL, revoked_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS measurements (
    key TEXT PRIMARY KEY, kind TEXT NOT NULL, versions TEXT NOT NULL,
    measured_at REAL NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL,
    node TEXT NOT NULL DEFAULT '', replica TEXT NOT NULL DEFAULT '', message TEXT NOT NULL);
"""
KEEP_REPLICAS_PER_MODEL = 20
KEEP_EVENTS = 10_000


@dataclass(frozen=True)
class Desired:
    """The last applied fleet.yaml: its text and where it came from."""

    text: str
    source: str
    applied_at: float


@dataclass(frozen=True)
class StoredMeasurement:
    """A calibration or a link probe as measured (`supervisor/measuring.py` reads it back):
    `versions` is what it was measured with, so a change of software measures again."""

    key: str  # a calibration's timing_key, or "NODE -> PEER" for a probe
    kind: str  # "calibration" or "probe"
    versions: str
    measured_at: float
    record: dict[str, Any]


class State:
    """One connection, used from the event loop's thread only (every call is short)."""

    def __init__(self, path: Path) -> None:
        private_dir(path.parent)
        self.path = path
        # Created 0600 before SQLite opens it: SQLite gives its -wal and -shm the same mode.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)  # a file from before this rule
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        for companion in self.companions():
            if companion.exists():
                os.chmod(companion, 0o600)

    def companions(self) -> tuple[Path, Path]:
        """The WAL and shared-memory files SQLite keeps beside the database."""
        return (self.path.with_name(self.path.name + "-wal"),
                self.path.with_name(self.path.name + "-shm"))

    def close(self) -> None:
        self.db.close()

    # settings ----------------------------------------------------------------------------
    def _get(self, key: str) -> Any:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def _put(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)",
                        (key, json.dumps(value)))

    def desired(self) -> Desired | None:
        raw = self._get("desired")
        return Desired(**raw) if raw else None

    def set_desired(self, text: str, source: str, now: float | None = None) -> None:
        self._put("desired", {"text": text, "source": source,
                              "applied_at": time.time() if now is None else now})

    def rebalance_epoch(self) -> int:
        return int(self._get("rebalance_epoch") or 0)

    def bump_rebalance_epoch(self) -> int:
        epoch = self.rebalance_epoch() + 1
        self._put("rebalance_epoch", epoch)
        return epoch

    # members -----------------------------------------------------------------------------
    def members(self) -> dict[str, Member]:
        rows = self.db.execute("SELECT record FROM members").fetchall()
        return {m.node: m for m in (Member.from_dict(json.loads(r[0])) for r in rows)}

    def put_member(self, member: Member) -> None:
        self.db.execute("INSERT OR REPLACE INTO members (node, record) VALUES (?, ?)",
                        (member.node, json.dumps(member.to_dict())))

    # pinned certificates -----------------------------------------------------------------
    def pin(self, node: str) -> str | None:
        """The SHA-256 fingerprint of the one certificate `node` may call with, if pinned."""
        row = self.db.execute("SELECT fingerprint FROM pins WHERE node = ?", (node,)).fetchone()
        return row[0] if row else None

    def put_pin(self, node: str, fingerprint: str, now: float | None = None) -> None:
        self.db.execute("INSERT OR REPLACE INTO pins (node, fingerprint, pinned_at) "
                        "VALUES (?, ?, ?)", (node, fingerprint, time.time() if now is None else now))

    def is_revoked(self, fingerprint: str) -> bool:
        return self.db.execute("SELECT 1 FROM revoked WHERE fingerprint = ?",
                               (fingerprint,)).fetchone() is not None

    def revoke(self, node: str, now: float | None = None) -> str | None:
        """Forget `node` (member and pin); its pinned certificate stays refused for good.
        Returns the fingerprint revoked, if one was pinned."""
        fingerprint = self.pin(node)
        if fingerprint is not None:
            self.db.execute("INSERT OR REPLACE INTO revoked (fingerprint, node, revoked_at) "
                            "VALUES (?, ?, ?)",
                            (fingerprint, node, time.time() if now is None else now))
        self.db.execute("DELETE FROM pins WHERE node = ?", (node,))
        self.db.execute("DELETE FROM members WHERE node = ?", (node,))
        return fingerprint

    # replicas ----------------------------------------------------------------------------
    def replicas(self) -> dict[str, Replica]:
        rows = self.db.execute("SELECT record FROM replicas ORDER BY generation").fetchall()
        return {r.id: r for r in (Replica.from_dict(json.loads(row[0])) for row in rows)}

    def put_replica(self, replica: Replica) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO replicas (id, model_id, generation, state, record, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (replica.id, replica.model_id, replica.generation, replica.state,
             json.dumps(replica.to_dict()), time.time()))
        self.db.execute(
            "DELETE FROM replicas WHERE model_id = ? AND generation <= ?",
            (replica.model_id, replica.generation - KEEP_REPLICAS_PER_MODEL))

    # tokens ------------------------------------------------------------------------------
    def tokens(self) -> list[TokenRecord]:
        rows = self.db.execute("SELECT record FROM tokens").fetchall()
        return [TokenRecord.from_dict(json.loads(r[0])) for r in rows]

    def put_token(self, record: TokenRecord) -> None:
        self.db.execute("INSERT OR REPLACE INTO tokens (secret_sha256, record) VALUES (?, ?)",
                        (record.secret_sha256, json.dumps(record.to_dict())))

    def use_token(self, record: TokenRecord) -> None:
        """A join token is good for one join."""
        self.db.execute("DELETE FROM tokens WHERE secret_sha256 = ?", (record.secret_sha256,))

    # measurements ------------------------------------------------------------------------
    def measurements(self) -> list[StoredMeasurement]:
        rows = self.db.execute(
            "SELECT key, kind, versions, measured_at, record FROM measurements").fetchall()
        return [StoredMeasurement(key, kind, versions, measured_at, json.loads(record))
                for key, kind, versions, measured_at, record in rows]

    def put_measurement(self, stored: StoredMeasurement) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO measurements (key, kind, versions, measured_at, record) "
            "VALUES (?, ?, ?, ?, ?)", (stored.key, stored.kind, stored.versions,
                                       stored.measured_at, json.dumps(stored.record)))

    # events ------------------------------------------------------------------------------
    def log_event(self, kind: str, message: str, *, node: str = "", replica: str = "",
                  now: float | None = None) -> int:
        cursor = self.db.execute(
            "INSERT INTO events (at, kind, node, replica, message) VALUES (?, ?, ?, ?, ?)",
            (time.time() if now is None else now, kind, node, replica, message))
        seq = int(cursor.lastrowid or 0)
        if seq % 1000 == 0:
            self.db.execute("DELETE FROM events WHERE seq <= ?", (seq - KEEP_EVENTS,))
        return seq

    def events(self, after: int = 0, limit: int = 200) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT seq, at, kind, node, replica, message FROM events WHERE seq > ? "
            "ORDER BY seq DESC LIMIT ?", (after, limit)).fetchall()
        keys = ("seq", "at", "kind", "node", "replica", "message")
        return [dict(zip(keys, row)) for row in reversed(rows)]
