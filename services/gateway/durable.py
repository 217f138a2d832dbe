"""The durable request log: what a resumable request needs to go on after the gateway itself restarts (a deploy, an
OOM kill, a node drain) -- its request body, its sampling seed, and the tokens it has produced so far, with their
log probabilities -- in an embedded SQLite database (--state-dir DIR, by default one per gateway port in the user's
data directory), or in Redis (--state-dir redis://HOST:PORT/DB, several gateways sharing it: RedisStore).

A request that ended stays in the log, with how it ended, for as long as an unfinished one would be taken back: a
restarted gateway rebuilds its events, so a client that had not read its tail yet reads it after the restart.

A restarted gateway re-adopts every unfinished request it finds (Gateway.readopt): the same id, the same seed, its
tokens put back, and the prompt plus those tokens prefilled again (a prefix-cache hit where the stages kept them);
its event log is rebuilt by feeding the same outputs through a fresh OutputProcessor, so every event has its old
offset, and the event ids keep the store's epoch: a client that reconnects with its Last-Event-ID reads on, no gap,
no duplicate. Seeded draws are seeded by position, so the continuation is the one the first gateway would have
produced (bit for bit under --batch-invariant).

Writes are batched: outputs are buffered and written every FLUSH_S in one transaction, so a killed gateway loses at
most the last FLUSH_S of tokens, which the re-adopted request simply generates again, identically. Only requests
marked resumable are logged (the others end with their connection anyway), at most --state-max-requests at once;
an unfinished request is taken back for --state-keep seconds after it began. One gateway holds a state directory at
a time (an exclusive lock); on Redis, each request belongs to the gateway that logged it for as long as that gateway
renews its lease, and any gateway sharing the log takes over the requests of one whose lease ran out.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

from shared.errors import StagemeshError

log = logging.getLogger("stagemesh.gateway.durable")

FLUSH_S = 0.2  # buffered outputs are written this often (a crash loses at most this much, regenerated identically)
KEEP_S = 600.0  # an unfinished request older than this is not re-adopted (its client gave up long ago)
LEASE_S = 5.0  # RedisStore: a gateway's requests are its own while it renews this lease (every flush)
TAKE_OVER_S = 1.0  # RedisStore: how often a gateway looks for requests whose gateway's lease ran out
PRUNE_S = 10.0  # how often a store drops the requests that began more than its keep_s ago
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
    extra: dict = field(default_factory=dict)  # what its surface logged with it (a background response's record)
    finish: dict | None = None  # an ended request's last output (finish_reason, error, code; its last token, if any)


class RequestStore(Protocol):
    """The request log, SQLite's or Redis's. add / output / end buffer; flush writes what is buffered; unfinished
    returns the requests this gateway may take back (and takes them); epoch: the event ids' first part, the same
    for every gateway of this log."""

    epoch: str
    shared: bool  # several gateways may use it at once (Redis): each takes over the others' when they stop

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None: ...

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None: ...

    def end(self, request_id: str, finish: dict) -> None: ...

    def flush(self) -> None: ...

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]: ...

    def close(self) -> None: ...


def open_store(where: str, owner: str, keep_s: float = KEEP_S) -> RequestStore:
    """--state-dir's value: a redis:// or rediss:// URL (RedisStore; `owner`, this gateway's name in it), else a
    directory (SqliteStore). keep_s (--state-keep): how long after it began a request is kept."""
    if where.startswith(("redis://", "rediss://")):
        return RedisStore(where, owner, keep_s=keep_s)
    return SqliteStore(where, keep_s)


def _top_list(top) -> list | None:
    """top_logprobs as the log keeps them: [[token id, logprob], ...]."""
    return None if top is None else [[int(t), float(lp)] for t, lp in top]


class SqliteStore:
    shared = False  # one gateway's (an exclusive lock)

    def __init__(self, state_dir: str, keep_s: float = KEEP_S):
        self.keep_s, self._pruned = keep_s, 0.0
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
        columns = [row[1] for row in self.db.execute("PRAGMA table_info(requests)")]
        for column in ("extra", "finish"):  # a log written before them
            if column not in columns:
                self.db.execute(f"ALTER TABLE requests ADD COLUMN {column} TEXT")
        row = self.db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
        if row is None:
            self.epoch = secrets.token_hex(4)
            self.db.execute("INSERT INTO meta VALUES ('epoch', ?)", (self.epoch,))
        else:
            self.epoch = row[0]
        self._requests: list[tuple] = []
        self._outputs: list[tuple] = []
        self._ended: list[tuple[str, str]] = []  # (id, its finish as JSON)

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None:
        self._requests.append((request_id, json.dumps(body), int(chat), session, seed, time.time(),
                               json.dumps(extra) if extra else None))

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None:
        """The n-th output token of a request (n from 0)."""
        top = _top_list(top)
        self._outputs.append((request_id, n, token, logprob, None if top is None else json.dumps(top)))

    def end(self, request_id: str, finish: dict) -> None:
        """The request ended with `finish` (its last output): kept, ended, for the retention window."""
        self._ended.append((request_id, json.dumps(finish)))

    def flush(self) -> None:
        """Write what is buffered, in one transaction."""
        if not (self._requests or self._outputs or self._ended or time.monotonic() - self._pruned > PRUNE_S):
            return
        requests, outputs, ended = self._requests, self._outputs, self._ended
        self._requests, self._outputs, self._ended = [], [], []
        if time.monotonic() - self._pruned > PRUNE_S:  # what began more than keep_s ago goes
            self._pruned = time.monotonic()
            self._drop_before(time.time() - self.keep_s)
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO requests (id, body, chat, session, seed, created, extra) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?)", requests)
            self.db.executemany("INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?)", outputs)
            self.db.executemany("UPDATE requests SET ended = 1, finish = ? WHERE id = ?", [(f, i) for i, f in ended])

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]:
        """The requests a previous gateway left, running or ended (finish set), oldest first; those older than keep_s
        are dropped."""
        self._drop_before(time.time() - keep_s)
        found = []
        for rid, body, chat, session, seed, created, extra, finish in self.db.execute(
                "SELECT id, body, chat, session, seed, created, extra, finish FROM requests ORDER BY created"
        ).fetchall():
            outs = self.db.execute("SELECT n, token, logprob, top FROM outputs WHERE id = ? ORDER BY n",
                                   (rid,)).fetchall()
            tokens = []
            for expect, (n, token, logprob, top) in enumerate(outs):
                if n != expect:  # a gap (never written so): keep what is contiguous, the rest is generated again
                    break
                tokens.append((token, logprob, None if top is None else json.loads(top)))
            found.append(StoredRequest(rid, json.loads(body), bool(chat), session, seed, created, tokens,
                                       json.loads(extra) if extra else {}, json.loads(finish) if finish else None))
        return found

    def _drop_before(self, cutoff: float) -> None:
        self.db.execute("DELETE FROM outputs WHERE id IN (SELECT id FROM requests WHERE created < ?)", (cutoff,))
        self.db.execute("DELETE FROM requests WHERE created < ?", (cutoff,))

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.db.close()
            self._lock.close()


# Takes one request for a gateway (KEYS[1]: the request's hash; ARGV: the gateway's owner id, the owner keys' prefix)
# when it is that gateway's own (logged by an earlier process of it) or its owner's lease is gone -- atomically, so
# two gateways never both take it.
_CLAIM = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return 0 end
if owner ~= ARGV[1] and redis.call('EXISTS', ARGV[2] .. owner) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
return 1
"""


class RedisStore:
    """The request log in Redis, under the key prefix of the URL's ?prefix= (default "stagemesh"), shared by every
    gateway given the same URL: <prefix>:epoch, <prefix>:open (a sorted set of request ids by start time),
    <prefix>:req:<id> (a hash: body, chat, session, seed, created, owner), <prefix>:out:<id> (a hash: n -> [token,
    logprob, top]) and <prefix>:owner:<owner id> (a gateway's lease, renewed at every flush, LEASE_S long). `owner`:
    the gateway's name in the log, the same across its restarts (host:port), so a restarted gateway takes its own
    requests back at once; a peer takes them once the lease has run out."""

    shared = True

    def __init__(self, url: str, owner: str | None = None, lease_s: float = LEASE_S, keep_s: float = KEEP_S):
        import redis  # the optional dependency (pip install 'stagemesh[redis]'): only where a redis:// log is asked for

        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", ["stagemesh"])[0]
        shown = urlunsplit(parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else ""),
                                          query=""))
        if not prefix or any(c in prefix for c in " :{}"):
            raise StagemeshError(f"--state-dir {shown}: ?prefix= must be a non-empty name without spaces, ':' or braces")
        self.shown = shown  # the URL without its password, for messages
        try:
            self.redis = redis.Redis.from_url(urlunsplit(parts._replace(query="")), socket_timeout=5,
                                              socket_connect_timeout=5)
            self.redis.ping()
        except (redis.RedisError, ValueError) as e:
            raise StagemeshError(f"--state-dir {shown}: cannot use Redis there ({type(e).__name__}: {e}); check the "
                                 "URL and that Redis is running, or give a directory, or --state-dir off") from None
        self._error = redis.RedisError
        self.prefix, self.lease_s, self.owner = prefix, lease_s, owner or secrets.token_hex(8)
        self.keep_s, self._pruned = keep_s, 0.0
        self._mine: set[str] = set()  # the requests this process logged or took: never taken again
        self.redis.set(self._key("epoch"), secrets.token_hex(4), nx=True)
        self.epoch = self.redis.get(self._key("epoch")).decode()
        self._claim = self.redis.register_script(_CLAIM)
        self._renew(self.redis)
        self._requests: list[tuple] = []
        self._outputs: list[tuple] = []
        self._ended: list[tuple[str, str]] = []  # (id, its finish as JSON)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _renew(self, client) -> None:
        client.set(self._key("owner", self.owner), "1", px=int(self.lease_s * 1000))

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None:
        self._mine.add(request_id)
        self._requests.append((request_id, json.dumps(body), int(chat), session or "", seed, time.time(),
                               json.dumps(extra or {})))

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None:
        self._outputs.append((request_id, n, json.dumps([token, logprob, _top_list(top)])))

    def end(self, request_id: str, finish: dict) -> None:
        self._ended.append((request_id, json.dumps(finish)))

    def flush(self) -> None:
        """Write what is buffered in one transaction, and renew this gateway's lease."""
        requests, outputs, ended = self._requests, self._outputs, self._ended
        self._requests, self._outputs, self._ended = [], [], []
        if time.monotonic() - self._pruned > PRUNE_S:  # what began more than keep_s ago goes
            self._pruned = time.monotonic()
            self._drop_before(time.time() - self.keep_s)
        pipe = self.redis.pipeline(transaction=True)
        self._renew(pipe)
        for rid, body, chat, session, seed, created, extra in requests:
            pipe.hset(self._key("req", rid), mapping={"body": body, "chat": chat, "session": session, "seed": seed,
                                                      "created": created, "extra": extra, "owner": self.owner})
            pipe.zadd(self._key("open"), {rid: created})
        for rid, n, out in outputs:
            pipe.hset(self._key("out", rid), n, out)
        for rid, finish in ended:  # kept, ended, until keep_s after it began (unfinished drops it)
            pipe.hset(self._key("req", rid), "finish", finish)
        pipe.execute()

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]:
        """The unfinished requests that gateways whose lease ran out left (taken: they are this gateway's now), oldest
        first; those older than keep_s are dropped. At start, a restarted gateway's own; while serving, a peer's."""
        self._drop_before(time.time() - keep_s)
        found = []
        for raw in self.redis.zrange(self._key("open"), 0, -1):
            rid = raw.decode()
            if rid in self._mine or not self._claim(keys=[self._key("req", rid)], args=[self.owner,
                                                                                        self._key("owner", "")]):
                continue  # this process's already, another live gateway's, or gone meanwhile
            self._mine.add(rid)
            req = {k.decode(): v.decode() for k, v in self.redis.hgetall(self._key("req", rid)).items()}
            outs = {int(n): json.loads(v) for n, v in self.redis.hgetall(self._key("out", rid)).items()}
            tokens = []
            for n in range(len(outs)):
                if n not in outs:  # a gap: keep what is contiguous, the rest is generated again
                    break
                token, logprob, top = outs[n]
                tokens.append((token, logprob, top))
            found.append(StoredRequest(rid, json.loads(req["body"]), bool(int(req["chat"])), req["session"] or None,
                                       int(req["seed"]), float(req["created"]), tokens,
                                       json.loads(req.get("extra") or "{}"),
                                       json.loads(req["finish"]) if req.get("finish") else None))
        return found

    def _drop_before(self, cutoff: float) -> None:
        old = [i.decode() for i in self.redis.zrangebyscore(self._key("open"), "-inf", cutoff)]
        if old:
            self.redis.delete(*(self._key(kind, rid) for rid in old for kind in ("req", "out")))
            self.redis.zrem(self._key("open"), *old)
            self._mine.difference_update(old)

    def close(self) -> None:
        """Write what is buffered and give the lease up: a gateway sharing the log may take the requests at once."""
        try:
            self.flush()
            self.redis.delete(self._key("owner", self.owner))
        finally:
            self.redis.close()
