"""Hosts that join and leave a running mesh (issue 68): `stagemesh join` proves the gateway's join token, is placed as
a new stage and the pipeline goes from N to N+1 stages under running streams; SIGTERM gives its layers back (N+1 ->
N); SIGKILL is noticed and covered the same way. Real processes on loopback: a one-stage mesh with CURVE and
--batch-invariant, a gateway with --join-token, and joiners started by the command a host would run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

from shared.files.layers import LayerRange
from shared.runtime.stage_runtime import LocalPipeline
from tests.conftest import greedy_step as _step
from tests.conftest import stagemesh_cmd

TOKEN = "join-token-for-the-tests-0123456789"
STREAMS = 3
MAX_TOKENS = 64
JOIN_TOKENS = 160  # the join's streams: long enough to be running when the change comes (the joiner loads first)
PROMPT = "Note {i}: when the ferry left the harbour the captain"


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


async def _streams(url: str, on_token=None, max_tokens: int = MAX_TOKENS) -> list[str]:
    from services.testing.harness import seeded_streams

    return await seeded_streams(url, PROMPT, 700, STREAMS, max_tokens, on_token)


class Joinable:
    def __init__(self, mesh, gw, log_dir: str):
        self.mesh, self.gw, self.log_dir = mesh, gw, log_dir
        self.joiners: list[subprocess.Popen] = []

    def join(self, *extra: str) -> tuple[subprocess.Popen, str]:
        path = os.path.join(self.log_dir, f"join{len(self.joiners)}.log")
        with open(path, "w") as log:
            proc = subprocess.Popen(stagemesh_cmd("join", self.gw.url, "--token", TOKEN, "--model", "smollm2",
                                                  "--dtype", "float32", "--batch-invariant", "--compile-decode", "off",
                                                  "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0", *extra),
                                    stdout=log, stderr=subprocess.STDOUT)
        self.joiners.append(proc)
        return proc, path

    def pipeline(self) -> dict:
        return json.loads(self.gw.get("/v1/mesh")[1])["pipelines"][0]

    def events(self) -> list[dict]:
        return json.loads(self.gw.get("/v1/mesh/members")[1])["events"]

    def wait_event(self, event: str, after: int, timeout: float = 240) -> dict:
        """The first membership event `event` past the first `after` events."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events()[after:] if e["event"] == event]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no {event!r} event: {self.events()}")

    def wait_stages(self, n: int, timeout: float = 240) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.pipeline()
            if len(p["stages"]) == n and p["ready"] and all(s.get("layers") for s in p["stages"]):
                return [s["layers"] for s in p["stages"]]
            time.sleep(0.25)
        raise AssertionError(f"the mesh did not reach {n} stages: {self.pipeline()['stages']}")


@contextlib.contextmanager
def one_stage_mesh(log_dir: str, *gateway_flags: str):
    """A one-stage mesh (CURVE, float32, batch-invariant) and a gateway with --join-token TOKEN and `gateway_flags`
    (its split pinned: the tests assert where joiners go)."""
    from services.testing.harness import mesh_and_gateway

    with mesh_and_gateway(1, log_dir, "--join-token", TOKEN, "--auto-rebalance", "off", *gateway_flags,
                          stage_flags=["--batch-invariant", "--compile-decode", "off"]) as (mesh, gw):
        m = Joinable(mesh, gw, log_dir)
        try:
            yield m
        finally:
            for j in m.joiners:
                if j.poll() is None:
                    j.kill()


@pytest.fixture(scope="module")
def joinable(tmp_path_factory):
    with one_stage_mesh(str(tmp_path_factory.mktemp("join"))) as m:
        yield m


@pytest.mark.processes
def test_a_wrong_or_missing_token_gets_401_and_learns_nothing(joinable):
    url = joinable.gw.url
    status, hello, _ = _post(url + "/join/hello", {})
    assert status == 200 and len(hello["nonce"]) == 32
    report = {"fingerprint": "x", "url": "http://127.0.0.1:1", "address": "tcp://127.0.0.1:1"}
    for body in ({"nonce": hello["nonce"], "key": None, "report": report, "proof": "0" * 64},  # a wrong token's
                 {"nonce": "f" * 32, "key": None, "report": report, "proof": "0" * 64}):  # a nonce never given
        status, answer, _ = _post(url + "/join", body)
        text = json.dumps(answer)
        assert status == 401 and answer["error"]["code"] == "invalid_join_token", answer
        assert "layers" not in answer and "tcp://" not in text and "fingerprint" not in text, answer
    status, answer, _ = _post(url + "/join", {"nonce": hello["nonce"]})  # fields missing
    assert status == 400 and "missing" in answer["error"]["message"], answer
    # the same token's proof over a nonce already used (a replay): refused too
    from services.gateway.engine.membership import join_proof

    proof = join_proof(TOKEN, hello["nonce"], None, report)
    status, answer, _ = _post(url + "/join", {"nonce": hello["nonce"], "key": None, "report": report, "proof": proof})
    assert status == 401, answer
    assert len(joinable.pipeline()["stages"]) == 1


@pytest.mark.processes
def test_joins_a_second_are_bounded(joinable):
    time.sleep(4)  # the bucket refills (the other tests' requests)
    statuses = [_post(joinable.gw.url + "/join/hello", {}) for _ in range(12)]
    limited = [(s, h) for s, _, h in statuses if s == 429]
    assert limited and all(int(h["Retry-After"]) >= 1 for _, h in limited), [s for s, _, _ in statuses]
    assert statuses[0][0] == 200
    time.sleep(4)


@pytest.mark.processes
def test_a_joiner_that_does_not_fit_is_refused_with_the_reason(joinable):
    time.sleep(3)
    cases = [(("--dtype", "bfloat16"), "computes in bfloat16"),
             (("--max-seq-len", "256"), "--max-seq-len"),
             (("--memory-budget", "1000000", "--as", "stage"), "cannot hold a layer")]
    for extra, says in cases:
        proc, path = joinable.join(*extra)
        assert proc.wait(240) == 2, open(path).read()
        out = open(path).read()
        assert says in out and "refused" in out, out
        time.sleep(1.5)
    assert len(joinable.pipeline()["stages"]) == 1


@pytest.mark.timing
@pytest.mark.processes
async def test_a_host_joins_leaves_and_is_lost_under_running_streams_and_no_text_changes(joinable):
    """Join mid-stream (1 -> 2 stages: the giver hands the joiner its layers' K/V, so nothing replays), SIGTERM
    mid-stream (2 -> 1: the leaver sends its K/V to the taker, nothing replays), join again, SIGKILL mid-stream
    (covered within 2 s, by a replay): every stream ends with the undisturbed run's text, nothing fails, and the
    joined stage computes."""
    m = joinable
    gw = m.gw
    reference, long_reference = await _streams(gw.url), await _streams(gw.url, max_tokens=JOIN_TOKENS)
    loop = asyncio.get_running_loop()

    # join: streams start once the joiner is placed (it loads its layers, then the change comes mid-stream); they
    # go on through the change with their K/V -- no replay -- and end with the undisturbed texts
    seen = len(m.events())
    proc, path = m.join("--as", "stage")
    await asyncio.to_thread(m.wait_event, "placed", seen)
    failovers = gw.metric("stagemesh_gateway_pipeline_failovers_total")
    began = time.time()
    texts = await asyncio.wait_for(_streams(gw.url, max_tokens=JOIN_TOKENS), 600)
    ended = time.time()
    joined = await asyncio.to_thread(m.wait_event, "joined", seen)
    split = await asyncio.to_thread(m.wait_stages, 2)
    assert texts == long_reference
    assert began < joined["time"] < ended, ("the join did not come mid-stream", began, joined, ended)
    assert joined["kv_moved"] is True, joined
    assert gw.metric("stagemesh_gateway_pipeline_failovers_total") == failovers  # nothing replayed
    assert split[0][0] == 0 and split[-1][1] == 30 and len(split) == 2, split
    texts = await asyncio.wait_for(_streams(gw.url), 600)  # served through both stages
    assert texts == reference
    stages = m.pipeline()["stages"]
    assert stages[1]["microbatches"] > 0, stages
    assert "serving layers" in open(path).read()

    # leave by SIGTERM mid-stream
    left = loop.create_future()

    def leave_midway(least: int) -> None:
        if least >= MAX_TOKENS // 4 and not left.done():
            proc.send_signal(signal.SIGTERM)
            left.set_result(None)

    seen, failovers = len(m.events()), gw.metric("stagemesh_gateway_pipeline_failovers_total")
    texts = await asyncio.wait_for(_streams(gw.url, leave_midway), 600)
    assert texts == reference
    assert await asyncio.to_thread(proc.wait, 120) == 0, open(path).read()
    assert await asyncio.to_thread(m.wait_stages, 1) == [[0, 30]]
    # the leaver sent its K/V to the stage that took its layers: nothing replayed
    assert (await asyncio.to_thread(m.wait_event, "left", seen))["kv_moved"] is True
    assert gw.metric("stagemesh_gateway_pipeline_failovers_total") == failovers

    # join again, then SIGKILL mid-stream
    proc, path = m.join("--as", "stage")
    await asyncio.to_thread(m.wait_stages, 2)
    killed = loop.create_future()

    def kill_midway(least: int) -> None:
        if least >= MAX_TOKENS // 4 and not killed.done():
            os.kill(proc.pid, signal.SIGKILL)
            killed.set_result(time.time())

    texts = await asyncio.wait_for(_streams(gw.url, kill_midway), 600)
    assert texts == reference
    assert await asyncio.to_thread(m.wait_stages, 1) == [[0, 30]]
    events = json.loads(gw.get("/v1/mesh/members")[1])["events"]
    noticed = [e for e in events if e["event"] == "noticed"]
    assert noticed and noticed[-1]["time"] - killed.result() <= 2.0, (killed.result(), events)
    assert [e["event"] for e in events if e["event"] in ("joined", "left", "lost")] == ["joined", "left", "joined",
                                                                                          "lost"], events
    assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0


@pytest.mark.timing
@pytest.mark.processes
async def test_a_joiner_that_never_becomes_ready_is_dropped_without_pausing_anyone(tmp_path):
    """A gateway with --join-ready-timeout 4: a joiner is placed, then stopped (SIGSTOP) before it loads its layers
    and says it is ready. Streams run through the one-stage mesh meanwhile: the joiner is dropped after the timeout
    with no membership change (the mesh stays one stage, nothing replayed, no stream waits on it: its worst gap within
    an undisturbed run's + 1 s), and the joiner, let go again, is told it was dropped and exits with an error."""
    with one_stage_mesh(str(tmp_path), "--join-ready-timeout", "4") as m:
        gw = m.gw
        gaps: list[float] = []

        def gap_meter():
            """on_token for one run of streams: the gaps between any two chunks, after each stream's first."""
            seen = [0, time.perf_counter()]

            def on_token(_least: int) -> None:
                now = time.perf_counter()
                seen[0] += 1
                if seen[0] > STREAMS:
                    gaps.append(now - seen[1])
                seen[1] = now
            return on_token

        reference = await _streams(gw.url, gap_meter())
        calm = max(gaps)  # an undisturbed run's worst gap between any two chunks
        gaps.clear()
        failovers = gw.metric("stagemesh_gateway_pipeline_failovers_total")
        proc, path = m.join("--as", "stage")

        def stop_once_placed() -> float:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                if json.loads(gw.get("/v1/mesh/members")[1])["waiting"]:
                    proc.send_signal(signal.SIGSTOP)
                    return time.monotonic()
                time.sleep(0.05)
            raise AssertionError(f"the joiner was never placed: {open(path).read()}")

        stopped_at = await asyncio.to_thread(stop_once_placed)

        def dropped() -> list[dict]:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                members = json.loads(gw.get("/v1/mesh/members")[1])
                if not members["waiting"]:
                    return members["events"]
                time.sleep(0.2)
            raise AssertionError(f"the joiner was not dropped: {members}")

        watch = asyncio.create_task(asyncio.to_thread(dropped))
        rounds = 0
        while not watch.done() or rounds < 1:  # streams run while it is placed, and across its drop
            assert await asyncio.wait_for(_streams(gw.url, gap_meter()), 600) == reference
            rounds += 1
        events = await watch
        assert time.monotonic() - stopped_at >= 4 - 0.5
        assert [e["event"] for e in events] == ["placed", "dropped"], events
        assert "not ready within 4 s" in events[-1]["error"], events
        # nothing paused: no membership change ran (the events say so), and no stream's gap grew past what the
        # undisturbed run's did by more than the load on a shared machine makes of it
        assert max(gaps) < 2 * calm + 1.0, (max(gaps), calm)
        assert len(m.pipeline()["stages"]) == 1
        assert gw.metric("stagemesh_gateway_pipeline_failovers_total") == failovers  # nothing replayed
        proc.send_signal(signal.SIGCONT)  # it loads, says it is ready and hears 410: it was dropped
        assert await asyncio.to_thread(proc.wait, 240) != 0
        out = open(path).read()
        assert "410" in out and "not waiting to be ready" in out, out
        assert len(m.pipeline()["stages"]) == 1


@pytest.mark.processes
async def test_up_does_not_restart_its_stage_beside_a_joined_host_the_gateway_covers_its_loss(tmp_path):
    """`up --stages 1 --join-token`: a host joins (2 stages), then up's own stage is SIGKILLed mid-stream. up does
    not restart it with the flags it started with (its range and neighbours are no longer those, nor its neighbours'
    keys up's): the gateway notices it and routes around it, the joined host taking every layer; no stream fails and
    the texts are the undisturbed run's."""
    from services.testing.harness import start_up

    gw = start_up(1, "float32", str(tmp_path), "--batch-invariant", "--compile-decode", "off", "--join-token", TOKEN,
                  "--auto-rebalance", "off")
    m = Joinable(None, gw, str(tmp_path))
    try:
        reference = await _streams(gw.url)
        proc, path = m.join("--as", "stage")
        await asyncio.to_thread(m.wait_stages, 2)
        own = gw.stage_pids()[0]
        loop = asyncio.get_running_loop()
        killed = loop.create_future()

        def kill_midway(least: int) -> None:
            if least >= MAX_TOKENS // 4 and not killed.done():
                os.kill(own, signal.SIGKILL)
                killed.set_result(time.time())

        texts = await asyncio.wait_for(_streams(gw.url, kill_midway), 600)
        assert texts == reference
        assert await asyncio.to_thread(m.wait_stages, 1) == [[0, 30]]
        await asyncio.sleep(2 * 0.25 + 1)  # several supervisor polls
        assert 0 not in gw.stage_pids(), gw.stage_pids()  # not restarted
        out = open(gw.log_path).read()
        assert "stage 0 exited; not restarted" in out, out[-2000:]
        events = json.loads(gw.get("/v1/mesh/members")[1])["events"]
        assert [e["event"] for e in events if e["event"] in ("joined", "noticed", "lost")] == ["joined", "noticed",
                                                                                              "lost"], events
        assert await asyncio.wait_for(_streams(gw.url), 600) == reference  # served by the joined host alone
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
        assert proc.poll() is None
    finally:
        for j in m.joiners:
            if j.poll() is None:
                j.kill()
        gw.stop()


# ---- one stage's side of a join and a leave, in process ---------------------------------------------------------------

class _Side:
    """What services.stage.membership.StageMembership uses of its StageWorker -- the identity, the runtime, sends and
    the two sockets' calls -- around a real StageRuntime; what it sends is collected, each message as it would
    travel (encoded, decoded)."""

    def __init__(self, runtime, incarnation: str):
        from types import SimpleNamespace

        from services.stage.membership import StageMembership

        self.runtime = runtime
        self.identity = SimpleNamespace(incarnation=incarnation, name=f"stage {incarnation}", index=None,
                                        position=runtime.model.position)
        self.sent: list = []
        self.io = SimpleNamespace(send=self._send, transport=SimpleNamespace(
            keys=None, next_hop="tcp://127.0.0.1:1", route_to=lambda *a: None, accept_from=lambda *a: None))
        self.membership = StageMembership(self)

    def _send(self, msg, via=None) -> bool:
        from shared.wire.protocol import decode, encode

        self.sent.append(decode(encode(msg)))
        return True

    def _serve_with(self, runtime) -> None:
        self.runtime = runtime

    def phase(self, msg) -> list:
        """This side's part of one membership phase (as StageWorker._resplit dispatches it): what it sent."""
        self.sent = []
        self.membership.begin(msg)
        if msg.phase == "load":
            self.membership.load(msg, self.runtime)
            self.io.send(msg)
        else:
            getattr(self.membership, msg.phase)(msg)
        return self.sent


def _change(rid: int, phase: str, members: list[tuple[str, int, int]]):
    from shared.wire.protocol import Resplit

    wire = [{"incarnation": inc, "layers": [a, b], "address": f"tcp://127.0.0.1:{2000 + i}", "key": None}
            for i, (inc, a, b) in enumerate(members)]
    return Resplit(rid, phase, [(0, 30)], [(a, b) for _, a, b in members], members=wire,
                   gateway={"address": "tcp://127.0.0.1:1999", "key": None, "sends": None})


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_a_join_and_a_leave_move_kv_and_a_stage_never_computes_from_part_of_it(smollm2):
    """One piece serving 0:30 decodes two sequences; a joiner takes 17:30: the giver keeps 0:17's K/V and gives
    17:30's, and the two go on computing exactly the logits of the piece left alone -- but the joiner holds no
    sequence one chunk of whose layers did not come (it answers unknown_sequence: the gateway replays it, nothing is
    computed from zeros). Then the joiner leaves: its K/V goes to the taker along the accept, whose held sequence
    lacking some of it is released the same way."""
    import dataclasses

    from shared.errors import UnknownSequence
    from shared.wire.protocol import KVParcel

    prompts = {"a": smollm2.tokenizer.encode("The capital of France is"),
               "b": smollm2.tokenizer.encode("Once upon a time, in a land far away")}
    ref = LocalPipeline.load(smollm2.loader, [LayerRange(0, 30)], torch.float32, kv_slots=4, max_seq_len=64)
    pipe = LocalPipeline.load(smollm2.loader, [LayerRange(0, 30)], torch.float32, kv_slots=4, max_seq_len=64)
    seqs, done = {s: list(p) for s, p in prompts.items()}, {}
    for piece in (ref, pipe):
        tokens, _ = _step(piece, {s: list(t) for s, t in seqs.items()}, {})
    for s, t in tokens.items():
        seqs[s].append(t)
        done[s] = 1
    giver, joiner = _Side(pipe.pieces[0], "g"), _Side(pipe.pieces[0].reload(LayerRange(17, 30)), "j")
    members = [("g", 0, 17), ("j", 17, 30)]
    for phase in ("load", "accept", "route"):
        for side in (giver, joiner):
            side.phase(_change(5, phase, members))
    parcels = [p for p in giver.phase(_change(5, "give", members)) if isinstance(p, KVParcel)]
    assert {p.seq_id for p in parcels} == {"a", "b"} and all((p.to, p.start, p.stop) == (1, 17, 30) for p in parcels)
    joiner.phase(_change(5, "give", members))
    for p in parcels:  # b's parcel arrives cut short: 3 of its 13 layers
        cut = p if p.seq_id == "a" else dataclasses.replace(p, stop=20, k=p.k[:3], v=p.v[:3])
        assert joiner.membership.take(cut) is True
    assert "a" in joiner.runtime.kv and "b" not in joiner.runtime.kv
    assert giver.runtime.model.layers == LayerRange(0, 17) and set(giver.runtime.kv.holders) == {"a", "b"}
    joined = LocalPipeline([giver.runtime, joiner.runtime])
    _, got = _step(joined, {"a": seqs["a"]}, {"a": 1})
    _, want = _step(ref, {"a": seqs["a"]}, {"a": 1})
    assert torch.equal(got, want)  # a decodes on with its moved K/V, as if nothing moved
    with pytest.raises(UnknownSequence):
        _step(joined, {"b": seqs["b"]}, {"b": 1})

    # the joiner leaves: its layers (and a's K/V, one position on) go to the giver along the accept
    giver.runtime.release("b")
    joined.pieces[0].kv.allocate("c")  # a sequence the leaver holds no K/V for: the taker must release it
    seqs["a"].append(int(got[0].argmax()))
    members = [("g", 0, 30)]
    giver.phase(_change(6, "load", members))
    sent = joiner.phase(_change(6, "accept", members))
    assert [p.seq_id for p in sent if isinstance(p, KVParcel)] == ["a"] and sent[-1].report[0]["left"] == 1
    giver.phase(_change(6, "accept", members))
    for p in sent[:-1]:
        assert giver.membership.take(p) is True
    giver.phase(_change(6, "route", members))
    assert giver.runtime.model.layers == LayerRange(0, 30) and set(giver.runtime.kv.holders) == {"a"}
    _, got = _step(LocalPipeline([giver.runtime]), {"a": seqs["a"]}, {"a": 2})
    _, want = _step(ref, {"a": seqs["a"]}, {"a": 2})
    assert torch.equal(got, want)


def test_a_cache_adopts_a_whole_sequence_and_refuses_one_that_is_not_its_shape():
    """KVCache.adopt (a joiner taking a sequence whose K/V came whole): its positions are the sequence's, a kept one
    is a cached prefix; K/V of other layers, heads or lengths per layer is refused naming the shape."""
    from shared.errors import BadBatch
    from shared.models.kv_cache import KVCache

    kv = KVCache(num_layers=2, num_slots=2, max_seq_len=16, num_kv_heads=3, head_dim=8, dtype=torch.float32,
                 prefix_slots=1)
    k = [torch.randn(3, 5, 8) for _ in range(2)]
    v = [torch.randn(3, 5, 8) for _ in range(2)]
    kv.adopt("a", k, v)
    slot, n = kv.row_of("a")
    assert n == 5 and torch.equal(kv.k[1][slot, :, :5], k[1]) and torch.equal(kv.v[0][slot, :, :5], v[0])
    kv.adopt("p", k, v, kept=True)
    assert kv.is_kept("p") and not kv.is_kept("a")
    for bad_k, bad_v in ((k[:1], v[:1]), ([k[0], k[1][:, :4]], v), ([t[:2] for t in k], [t[:2] for t in v])):
        with pytest.raises(BadBatch, match="is not 2 layers"):
            kv.adopt("b", bad_k, bad_v)
    assert "b" not in kv
