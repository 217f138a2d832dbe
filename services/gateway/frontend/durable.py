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
produced (bit for bit under --batch-invariant). A log belongs to one model (its file's fingerprint, the `mesh`):
a gateway serving another model neither takes its requests nor mixes its own in.

Writes are batched: add / output / end buffer (on the event loop's thread), and flush writes what is buffered in one
transaction every FLUSH_S (in a worker thread: a slow disk or a far Redis never stalls the event loop), so a killed
gateway loses at most the last FLUSH_S of tokens, which the re-adopted request simply generates again, identically;
a flush that fails (Redis away for a moment) keeps its batch for the next one. Only requests marked resumable are
logged (the others end with their connection anyway), at most --state-max-requests at once; a request is kept, and
taken back, for --state-keep seconds after it began. One gateway holds a state directory at a time (an exclusive
lock); on Redis, each request belongs to the gateway that logged it for as long as that gateway renews its lease,
and any gateway sharing the log takes over the requests of one whose lease ran out.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.config import is_url, parse_redis_url
from shared.errors import StagemeshError

log = logging.getLogger("stagemesh.gateway.durable")

FLUSH_S = 0.2  # buffered outputs are written this often (a crash loses at most this much, regenerated identically)
KEEP_S = 600.0  # an unfinished request older than this is not re-adopted (its client gave up long ago)
LEASE_S = 5.0  # RedisStore: a gateway's requests are its own while it renews this lease (every flush)
TAKE_OVER_S = 1.0  # RedisStore: how often a gateway looks for requests whose gateway's lease ran out
PRUNE_S = 10.0  # how often a store drops the requests that began more than its keep_s ago
MAX_BUFFERED = 200_000  # rows a store keeps for a log it cannot write (Redis down); past it a failed batch is dropped
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
    """The request log, SQLite's or Redis's. add / output / end buffer (called on the event loop's thread); flush
    writes what is buffered (from any one thread at a time); unfinished returns the requests this gateway may take
    back (and takes them); epoch: the event ids' first part, the same for every gateway of this log."""

    epoch: str
    shared: bool  # several gateways may use it at once (Redis): each takes over the others' when they stop

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None: ...

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None: ...

    def end(self, request_id: str, finish: dict) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def flush(self) -> None: ...

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]: ...

    def close(self) -> None: ...


def open_store(where: str, owner: str, mesh: str, keep_s: float = KEEP_S) -> RequestStore:
    """--state-dir's value: a redis:// or rediss:// URL (RedisStore; `owner`, this gateway's name in it), else a
    directory (SqliteStore). mesh: the served model's fingerprint (a log keeps one model's requests); keep_s
    (--state-keep): how long after it began a request is kept."""
    if is_url(where):
        return RedisStore(where, owner, mesh, keep_s=keep_s)
    return SqliteStore(where, mesh, keep_s)


DAMAGED_ROW = (ValueError, TypeError, KeyError, AttributeError)  # a row that is not what the log writes (json's errors too)


def _stored(rid: str, body, chat, session, seed, created, outputs: dict, extra, finish) -> StoredRequest:
    """One logged request as written (body, extra, finish as JSON text), checked: DAMAGED_ROW where it is not."""
    body, extra = json.loads(body), json.loads(extra) if extra else {}
    finish = json.loads(finish) if finish else None
    if not isinstance(body, dict) or not isinstance(extra, dict) or not isinstance(finish, dict | None):
        raise ValueError("its body, extra or finish is not a JSON object")
    return StoredRequest(rid, body, bool(int(chat)), session or None, int(seed), float(created), _contiguous(outputs),
                         extra, finish)


def _skipped(rid: str, where: str, e: Exception) -> None:
    log.warning("request %s in the request log %s is damaged (%s: %s): skipped, and dropped from the log", rid, where,
                type(e).__name__, str(e)[:200])


def _top_list(top) -> list | None:
    """top_logprobs as the log keeps them: [[token id, logprob], ...]."""
    return None if top is None else [[int(t), float(lp)] for t, lp in top]


class _Batch:
    """What add / output / end buffered since the last flush. The event loop's thread appends, a flush (in a worker
    thread) takes everything at once and puts it back in front when the write failed, so a log away for a moment
    loses nothing -- up to MAX_BUFFERED rows, past which the failed batch is dropped (those requests are then taken
    back with fewer tokens, or not at all, and generated again)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: list[tuple] = []
        self.outputs: list[tuple] = []
        self.ended: list[tuple[str, str]] = []  # (id, its finish as JSON)
        self.forgotten: list[str] = []  # ids whose rows go (after this batch's own writes: last in its transaction)

    def put(self, rows: list, row) -> None:
        with self._lock:
            rows.append(row)

    def take(self) -> tuple[list, list, list, list]:
        with self._lock:
            taken = self.requests, self.outputs, self.ended, self.forgotten
            self.requests, self.outputs, self.ended, self.forgotten = [], [], [], []
        return taken

    def put_back(self, taken: tuple[list, list, list, list]) -> None:
        requests, outputs, ended, forgotten = taken
        with self._lock:
            if len(requests) + len(outputs) + len(ended) + len(self.outputs) > MAX_BUFFERED:
                log.error("the request log cannot be written and %d rows wait: a batch is dropped (its requests are "
                          "generated again after a restart, or not taken back)", MAX_BUFFERED)
                self.forgotten = forgotten + self.forgotten  # a deletion is never dropped
                return
            self.requests, self.outputs, self.ended, self.forgotten = (
                requests + self.requests, outputs + self.outputs, ended + self.ended, forgotten + self.forgotten)


def _prune_and_take(store: SqliteStore | RedisStore) -> tuple | None:
    """A flush's start, either log: drop what began more than keep_s ago (at most every PRUNE_S), then take the
    buffered writes (_Batch.take: requests, outputs, ended, forgotten); None when nothing is buffered."""
    if time.monotonic() - store._pruned > PRUNE_S:
        store._pruned = time.monotonic()
        store._drop_before(time.time() - store.keep_s)
    taken = store._batch.take()
    return taken if any(taken) else None


def _private_dir(state_dir: str) -> None:
    """The state directory made 0700, or refused where other users may enter it, as the key directory is
    (shared/wire/mesh_keys.py): the log holds resumable requests' prompts and answers."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(state_dir).st_mode)
    if mode & 0o077:
        raise StagemeshError(f"--state-dir {state_dir} is open to other users (mode {mode:04o}), and the request log "
                             f"there holds resumable requests' prompts and answers: chmod 700 {state_dir}, or give a "
                             "directory of your own, or --state-dir off")


def _private_file(path: str) -> None:
    """`path` made, or kept, 0600 (its owner's alone) whatever the umask; nothing else is changed."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


class SqliteStore:
    """The request log in DIR/requests.sqlite (its -wal and -shm beside it, and DIR/lock): DIR 0700, every file
    0600 (_private_dir, _private_file); what began more than keep_s ago is pruned while it runs and as it closes."""

    shared = False  # one gateway's (an exclusive lock)

    def __init__(self, state_dir: str, mesh: str, keep_s: float = KEEP_S):
        self.keep_s, self._pruned = keep_s, 0.0
        lock = os.path.join(state_dir, "lock")
        try:
            _private_dir(state_dir)
            _private_file(lock)
            self._lock = open(lock, "w")
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
        self._io = threading.Lock()  # flush runs in a worker thread, one at a time
        self._batch = _Batch()
        try:
            self._open(state_dir, mesh)
        except sqlite3.DatabaseError as e:  # damaged (a truncated copy, a failing disk): moved aside, a fresh log
            self.db.close()
            aside = f"{self.path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            log.warning("the request log %s is damaged (%s): moved aside to %s, and a fresh log started (its "
                        "requests are not taken back; delete the copy once you no longer need it)", self.path, e,
                        aside)
            self._open(state_dir, mesh)

    def _open(self, state_dir: str, mesh: str) -> None:
        """Open (or make) the log, checked whole (PRAGMA quick_check), its schema current, its meta this model's;
        sqlite3.DatabaseError where the file is damaged."""
        _private_file(self.path)  # SQLite makes its -wal and -shm with the database's mode
        # transactions are explicit (flush)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        check = self.db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check}")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        for suffix in ("-wal", "-shm"):  # left by an older gateway with another mode
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o600)
        self.db.executescript(SCHEMA)
        columns = [row[1] for row in self.db.execute("PRAGMA table_info(requests)")]
        for column in ("extra", "finish"):  # a log written before them
            if column not in columns:
                self.db.execute(f"ALTER TABLE requests ADD COLUMN {column} TEXT")
        meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        self.epoch = meta.get("epoch") or secrets.token_hex(4)
        if meta.get("mesh", mesh) != mesh:  # another model's requests: not taken back by this one
            dropped = self.db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
            log.warning("--state-dir %s held the log of another model (%s, this is %s): its %d requests are dropped",
                        state_dir, meta["mesh"], mesh, dropped)
            self.db.execute("DELETE FROM outputs")
            self.db.execute("DELETE FROM requests")
        self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("epoch", self.epoch), ("mesh", mesh)])

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None:
        self._batch.put(self._batch.requests, (request_id, json.dumps(body), int(chat), session, seed, time.time(),
                                               json.dumps(extra) if extra else None))

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None:
        """The n-th output token of a request (n from 0)."""
        top = _top_list(top)
        self._batch.put(self._batch.outputs, (request_id, n, token, logprob, None if top is None else json.dumps(top)))

    def end(self, request_id: str, finish: dict) -> None:
        """The request ended with `finish` (its last output): kept, ended, for the retention window."""
        self._batch.put(self._batch.ended, (request_id, json.dumps(finish)))

    def forget(self, request_id: str) -> None:
        """The request's rows deleted at the next flush (DELETE /v1/responses/{id}): nothing of it stays at rest."""
        self._batch.put(self._batch.forgotten, request_id)

    def flush(self) -> None:
        """Write what is buffered, in one transaction."""
        with self._io:
            taken = _prune_and_take(self)
            if taken is None:
                return
            requests, outputs, ended, forgotten = taken
            try:
                with self.db:
                    self.db.execute("BEGIN")
                    self.db.executemany("INSERT OR REPLACE INTO requests (id, body, chat, session, seed, created, "
                                        "extra) VALUES (?, ?, ?, ?, ?, ?, ?)", requests)
                    self.db.executemany("INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?)", outputs)
                    self.db.executemany("UPDATE requests SET ended = 1, finish = ? WHERE id = ?",
                                        [(f, i) for i, f in ended])
                    self.db.executemany("DELETE FROM outputs WHERE id = ?", [(i,) for i in forgotten])
                    self.db.executemany("DELETE FROM requests WHERE id = ?", [(i,) for i in forgotten])
            except sqlite3.Error:
                self._batch.put_back(taken)
                raise

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]:
        """The requests a previous gateway left, running or ended (finish set), oldest first; those older than keep_s
        are dropped."""
        with self._io:
            self._drop_before(time.time() - keep_s)
            rows = self.db.execute("SELECT id, body, chat, session, seed, created, extra, finish FROM requests "
                                   "ORDER BY created").fetchall()
            found = []
            for rid, body, chat, session, seed, created, extra, finish in rows:
                outs = self.db.execute("SELECT n, token, logprob, top FROM outputs WHERE id = ? ORDER BY n",
                                       (rid,)).fetchall()
                try:
                    outputs = {n: (token, logprob, None if top is None else json.loads(top))
                               for n, token, logprob, top in outs}
                    found.append(_stored(rid, body, chat, session, seed, created, outputs, extra, finish))
                except DAMAGED_ROW as e:
                    _skipped(rid, self.path, e)
                    self.db.execute("DELETE FROM outputs WHERE id = ?", (rid,))
                    self.db.execute("DELETE FROM requests WHERE id = ?", (rid,))
            return found

    def _drop_before(self, cutoff: float) -> None:
        self.db.execute("DELETE FROM outputs WHERE id IN (SELECT id FROM requests WHERE created < ?)", (cutoff,))
        self.db.execute("DELETE FROM requests WHERE created < ?", (cutoff,))

    def close(self) -> None:
        """Write what is buffered, prune what began more than keep_s ago (nothing older stays at rest after a clean
        stop), and let the directory go."""
        try:
            self.flush()
        finally:
            with self._io:
                try:
                    self._drop_before(time.time() - self.keep_s)
                finally:
                    self.db.close()
                    self._lock.close()


def _contiguous(outputs: dict[int, tuple]) -> list[tuple]:
    """A request's outputs 0, 1, ... up to the first gap (never written so; the rest is generated again)."""
    tokens = []
    while len(tokens) in outputs:
        tokens.append(outputs[len(tokens)])
    return tokens


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
    """The request log in Redis, shared by every gateway given the same URL and serving the same model, under the
    keys <prefix>:<mesh>: (the URL's ?prefix=, default "stagemesh"; the model file's fingerprint) -- epoch, open (a
    sorted set of request ids by start time), req:<id> (a hash: body, chat, session, seed, created, owner, extra,
    finish), out:<id> (a hash: n -> [token, logprob, top]) and owner:<owner id> (a gateway's lease, renewed at
    every flush, LEASE_S long). req: and out: expire keep_s after the request began, in Redis itself, whether or not
    a gateway still prunes this log. `owner`: the gateway's name in the log, the same across its restarts
    (host:port), so a restarted gateway takes its own requests back at once; a peer takes them once the lease has
    run out. A gateway whose own lease ran out (stalled, or cut off from Redis, for longer than LEASE_S) finds out at
    its next flush which of its requests a peer took meanwhile, and stops writing theirs (they are the peer's)."""

    shared = True

    def __init__(self, url: str, owner: str, mesh: str, lease_s: float = LEASE_S, keep_s: float = KEEP_S):
        target = parse_redis_url(url)
        self.shown = target.shown  # the URL without its password, for messages
        try:
            import redis  # the optional dependency: only where a redis:// log is asked for
        except ImportError:
            raise StagemeshError(f"--state-dir {self.shown}: the Redis client is not installed: pip install "
                                 "'stagemesh[redis]' (or give a directory, or --state-dir off)") from None
        try:
            self.redis = redis.Redis.from_url(target.url, socket_timeout=5, socket_connect_timeout=5)
            self.redis.ping()
        except (redis.RedisError, ValueError) as e:
            raise StagemeshError(f"--state-dir {self.shown}: cannot use Redis there ({type(e).__name__}: {e}); check "
                                 "the URL and that Redis is running, or give a directory, or --state-dir off") from None
        self._gone = (redis.ConnectionError, redis.TimeoutError, OSError)  # Redis away: a batch waits (refused: dropped)
        self.prefix, self.mesh, self.owner, self.lease_s = target.prefix, mesh, owner, lease_s
        self.keep_s, self._pruned = keep_s, 0.0
        self._io = threading.Lock()  # one flush or unfinished at a time
        self._mine: dict[str, float] = {}  # the requests this process logged or took (never taken again) -> created
        self._lost: set[str] = set()  # requests of this process a peer took while its lease had run out
        self.redis.set(self._key("epoch"), secrets.token_hex(4), nx=True)
        self.epoch = self.redis.get(self._key("epoch")).decode()
        self._claim = self.redis.register_script(_CLAIM)
        self.redis.set(self._key("owner", owner), "1", px=int(lease_s * 1000))
        self._batch = _Batch()

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, self.mesh, *parts))

    def add(self, request_id: str, body: dict, chat: bool, session: str | None, seed: int,
            extra: dict | None = None) -> None:
        created = time.time()
        self._mine[request_id] = created
        self._batch.put(self._batch.requests, (request_id, json.dumps(body), int(chat), session or "", seed, created,
                                               json.dumps(extra or {})))

    def output(self, request_id: str, n: int, token: int, logprob: float | None, top) -> None:
        if request_id not in self._lost:
            self._batch.put(self._batch.outputs, (request_id, n, json.dumps([token, logprob, _top_list(top)])))

    def end(self, request_id: str, finish: dict) -> None:
        if request_id not in self._lost:
            self._batch.put(self._batch.ended, (request_id, json.dumps(finish)))

    def forget(self, request_id: str) -> None:
        """The request's keys deleted at the next flush (DELETE /v1/responses/{id}), whichever gateway holds it."""
        self._mine.pop(request_id, None)
        self._batch.put(self._batch.forgotten, request_id)

    def flush(self) -> None:
        """Renew this gateway's lease, and write what is buffered in one transaction."""
        with self._io:
            self._renew()
            taken = _prune_and_take(self)
            if taken is None:
                return
            requests, outputs, ended, forgotten = taken
            pipe = self.redis.pipeline(transaction=True)
            expires: dict[str, int] = {}  # key -> when it goes (ms since the epoch): keep_s after its request began
            for rid, body, chat, session, seed, created, extra in requests:
                pipe.hset(self._key("req", rid), mapping={"body": body, "chat": chat, "session": session,
                                                          "seed": seed, "created": created, "extra": extra,
                                                          "owner": self.owner})
                pipe.zadd(self._key("open"), {rid: created})
                expires[self._key("req", rid)] = int((created + self.keep_s) * 1000)
            for rid, n, out in outputs:
                if rid not in self._lost:
                    pipe.hset(self._key("out", rid), n, out)
                    expires[self._key("out", rid)] = int((self._mine.get(rid, time.time()) + self.keep_s) * 1000)
            for rid, finish in ended:  # kept, ended, until keep_s after it began (unfinished drops it)
                if rid not in self._lost:
                    pipe.hset(self._key("req", rid), "finish", finish)
            for key, at in expires.items():
                pipe.pexpireat(key, at)
            for rid in forgotten:  # after its own writes above
                pipe.delete(self._key("req", rid), self._key("out", rid))
                pipe.zrem(self._key("open"), rid)
            try:
                pipe.execute()
            except self._gone:  # not written, or not known to be: written again (the same values)
                self._batch.put_back(taken)
                raise

    def _renew(self) -> None:
        """Renew the lease; where it had run out, find which requests peers took meanwhile (self._lost)."""
        lease = self._key("owner", self.owner)
        if self.redis.set(lease, "1", px=int(self.lease_s * 1000), xx=True):
            return
        # Set again first: from here no peer takes one more, so what is not ours now stays another's.
        self.redis.set(lease, "1", px=int(self.lease_s * 1000))
        # a restarted (emptied) Redis lost the epoch too: this gateway's, put back, keeps clients' event ids valid
        self.redis.set(self._key("epoch"), self.epoch, nx=True)
        mine = list(self._mine)
        pipe = self.redis.pipeline(transaction=False)
        for rid in mine:
            pipe.hget(self._key("req", rid), "owner")
        lost = [rid for rid, owner in zip(mine, pipe.execute()) if owner is not None and owner.decode() != self.owner]
        if lost:
            log.warning("this gateway's lease in the request log ran out and other gateways took %d of its requests: "
                        "they go on here unlogged (their clients read them here) and there", len(lost))
            self._lost.update(lost)
            for rid in lost:
                self._mine.pop(rid, None)

    def unfinished(self, keep_s: float = KEEP_S) -> list[StoredRequest]:
        """The unfinished requests that gateways whose lease ran out left (taken: they are this gateway's now), oldest
        first; those older than keep_s are dropped. At start, a restarted gateway's own; while serving, a peer's."""
        with self._io:
            self._drop_before(time.time() - keep_s)
            ids = [raw.decode() for raw in self.redis.zrange(self._key("open"), 0, -1)]
            ids = [rid for rid in ids if rid not in self._mine and rid not in self._lost]
            owners = self._pipelined(lambda pipe, rid: pipe.hget(self._key("req", rid), "owner"), ids)
            gone = [rid for rid, owner in zip(ids, owners) if owner is None]  # expired in Redis
            if gone:
                self.redis.zrem(self._key("open"), *gone)
            others = sorted({o.decode() for o in owners if o is not None} - {self.owner})
            alive = self._pipelined(lambda pipe, o: pipe.exists(self._key("owner", o)), others)
            dead = {o for o, live in zip(others, alive) if not live} | {self.owner}
            found = []
            for rid, owner in zip(ids, owners):
                if owner is None or owner.decode() not in dead:
                    continue
                if not self._claim(keys=[self._key("req", rid)], args=[self.owner, self._key("owner", "")]):
                    continue  # another gateway's (it renewed its lease, or took it first), or gone meanwhile
                try:
                    req = {k.decode(): v.decode() for k, v in self.redis.hgetall(self._key("req", rid)).items()}
                    outs = {int(n): tuple(json.loads(v)) for n, v in self.redis.hgetall(self._key("out", rid)).items()}
                    found.append(_stored(rid, req["body"], req["chat"], req["session"], req["seed"], req["created"],
                                         outs, req.get("extra"), req.get("finish")))
                except (*DAMAGED_ROW, UnicodeDecodeError) as e:
                    _skipped(rid, self.shown, e)
                    self.redis.delete(self._key("req", rid), self._key("out", rid))
                    self.redis.zrem(self._key("open"), rid)
                    continue
                self._mine[rid] = float(req["created"])
            return found

    def _pipelined(self, call, items: list) -> list:
        pipe = self.redis.pipeline(transaction=False)
        for item in items:
            call(pipe, item)
        return pipe.execute() if items else []

    def _drop_before(self, cutoff: float) -> None:
        old = [i.decode() for i in self.redis.zrangebyscore(self._key("open"), "-inf", cutoff)]
        if old:
            self.redis.delete(*(self._key(kind, rid) for rid in old for kind in ("req", "out")))
            self.redis.zrem(self._key("open"), *old)
            for rid in old:
                self._mine.pop(rid, None)
            self._lost.difference_update(old)

    def close(self) -> None:
        """Write what is buffered and give the lease up: a gateway sharing the log may take the requests at once."""
        try:
            self.flush()
            self.redis.delete(self._key("owner", self.owner))
        finally:
            self.redis.close()
