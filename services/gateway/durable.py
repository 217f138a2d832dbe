"""The durable request log: what a resumable request needs to go on after the gateway itself restarts (a deploy, an
OOM kill, a node drain) -- its request body, its sampling seed, and the tokens it has produced so far, with their
log probabilities -- in an embedded SQLite database (--state-dir, by default one per gateway port in the user's data
directory).

A restarted gateway re-adopts every unfinished request it finds (Gateway.readopt): the same id, the same seed, its
tokens put back, and the prompt plus those tokens prefilled again (a prefix-cache hit where the stages kept them);
its event log is rebuilt by feeding the same outputs through a fresh OutputProcessor, so every event has its old
offset, and the event ids keep the store's epoch: a client that reconnects with its Last-Event-ID reads on, no gap,
no duplicate. Seeded draws are seeded by position, so the continuation is the one the first gateway would have
produced (bit for bit under --batch-invariant).

Writes are batched: outputs are buffered and written every FLUSH_S in one transaction, so a killed gateway loses at
most the last FLUSH_S of tokens, which the re-adopted request simply generates again, identically. Only requests
marked resumable are logged (the others end with their connection anyway). One gateway holds a state directory at a
time (an exclusive lock)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass

from shared.errors import StagemeshError

log = logging.getLogger("stagemesh.gateway.durable")

FLUSH_S = 0.2  # buffered outputs are written this often (a crash loses at most this much, regenerated identically)
KEEP_S = 600.0  # an unfinished request older than this is not re-adopted (its client gave up long ago)
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY, body TEXT NOT NULL, chat INTEGER NOT NULL,
    session TEXT, seed INTEGER NOT NULL, created REAL NOT NULL, ended INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS outputs (id TEXT NOT NULL, n INTEGER NOT NULL, token INTEGER NOT NULL, logprob REAL,
    top TEXT, PRIMARY KEY (id, n));
"""


def default_state_dir(port: int) -> str:
    """$XDG_DATA_HOME/stagemesh/gateway-<port> (else ~/.local/share/...): one log per gateway of this machine."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "stagemesh", f"gateway-{port}")


@dataclass
class StoredRequest:
    """An unfinished request as the store kept it."""

    id: str
    body: dict
    chat: bool
    session: str | None
    seed: int
    created: float
    outputs: list[tuple[int, float | None, list | None]]  # (token, logprob, top_logprobs as [[id, logprob], ...])


class RequestStore:
    def __init__(self, state_dir: str):
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            self._lock = open(os.path.join(state_dir, "lock"), "w")
        except OSError as e:
            raise StagemeshError(f"--state-dir {state_dir}: cannot be used ({e.strerror}); give another, or "
                                 "--state-dir off to keep no request log") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StagemeshError(f"--state-dir {state_dir} is held by another running gateway; give each gateway its "
                                 "own (--state-dir), or --state-dir off") from None
        self.path = os.path.join(state_dir, "requests.sqlite")
        self.db = sqlite3.connect(self.path, isolation_level=None)  # transactions are explicit (flush)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
        if row is None:
            self.epoch = secrets.token_hex(4)
            self.db.execute("INSERT INTO meta VALUES ('epoch', ?)", (self.epoch,))
        else:
            self.epoch = row[0]
        self._requests: list[tuple] = []
        self._outputs: list[tuple] = []
        self._ended: list[str] = []

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int) -> None:
        self._requests.append((request_id, json.dumps(body), int(chat), session, seed, time.time()))

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None:
        """The n-th output token of a request (n from 0)."""
        self._outputs.append((request_id, n, token, logprob, None if top is None else json.dumps(
            [[int(t), float(lp)] for t, lp in top])))

    def end(self, request_id: str) -> None:
        self._ended.append(request_id)

    def flush(self) -> None:
        """Write what is buffered, in one transaction."""
        if not (self._requests or self._outputs or self._ended):
            return
        requests, outputs, ended = self._requests, self._outputs, self._ended
        self._requests, self._outputs, self._ended = [], [], []
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO requests (id, body, chat, session, seed, created) "
                                "VALUES (?, ?, ?, ?, ?, ?)", requests)
            self.db.executemany("INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?)", outputs)
            self.db.executemany("DELETE FROM outputs WHERE id = ?", [(i,) for i in ended])
            self.db.executemany("DELETE FROM requests WHERE id = ?", [(i,) for i in ended])

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]:
        """The requests a previous gateway left running, oldest first; those older than keep_s are dropped."""
        self.db.execute("DELETE FROM outputs WHERE id IN (SELECT id FROM requests WHERE created < ?)",
                        (time.time() - keep_s,))
        self.db.execute("DELETE FROM requests WHERE created < ?", (time.time() - keep_s,))
        found = []
        for rid, body, chat, session, seed, created in self.db.execute(
                "SELECT id, body, chat, session, seed, created FROM requests ORDER BY created").fetchall():
            outs = self.db.execute("SELECT n, token, logprob, top FROM outputs WHERE id = ? ORDER BY n",
                                   (rid,)).fetchall()
            tokens = []
            for expect, (n, token, logprob, top) in enumerate(outs):
                if n != expect:  # a gap (never written so): keep what is contiguous, the rest is generated again
                    break
                tokens.append((token, logprob, None if top is None else json.loads(top)))
            found.append(StoredRequest(rid, json.loads(body), bool(chat), session, seed, created, tokens))
        return found

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.db.close()
            self._lock.close()
