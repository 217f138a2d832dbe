"""Replicas of a stage (issue 68 item 3): a layer range served by several stage processes, each sequence bound to one
chain of them at admission. The wire (a forward's route, the hops phase, every field validated), a stage's PUSH per
next-hop instance, the chain table and the scheduler's micro-batches per chain; then real processes: a 2-stage mesh
whose second range gets a replica by `stagemesh join --as replica`, both used, every micro-batch of a sequence through
one, and a replica SIGKILLed under streams (only its sequences replay, texts identical to an undisturbed run)."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from shared.batch.steps import Decode
from shared.wire import protocol
from shared.wire.protocol import (
    PROTOCOL_VERSION,
    ForwardBatch,
    ProtocolError,
    ReleaseSeqs,
    Resplit,
    SeqEntry,
    decode,
    encode,
)


def _forward(route=None) -> ForwardBatch:
    return ForwardBatch(7, [SeqEntry("a", Decode(3))], tokens=torch.tensor([5], dtype=torch.int64), route=route)


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0])


# ---- the wire ----------------------------------------------------------------------------------------------------

def test_a_forward_names_its_route_only_in_a_mesh_with_replicas():
    plain = encode(_forward())
    assert "route" not in _header(plain) and decode(plain).route is None
    routed = encode(_forward(("inst-b", "inst-c")))
    assert _header(routed)["route"] == ["inst-b", "inst-c"]
    assert decode(routed).route == ("inst-b", "inst-c")
    assert decode(encode(_forward(()))).route == ()  # exhausted: the last stage's
    assert _header(plain)["v"] == PROTOCOL_VERSION >= 8


@pytest.mark.parametrize("route", ["inst-b", [""], ["x" * 65], [3], [None], ["a"] * (protocol.MAX_STAGES + 1)])
def test_a_malformed_route_is_refused_naming_it(route):
    frames = encode(_forward())
    h = _header(frames)
    h["route"] = route
    with pytest.raises(ProtocolError, match="route must be a list") as e:
        decode([msgpack.packb(h), *frames[1:]])
    assert e.value.reason == "schema"


def _hops_msg(hops) -> list:
    return encode(Resplit(1, "hops", [(0, 15), (15, 30)], [(0, 15), (15, 30)], hops=hops))


def test_the_hops_phase_crosses_the_wire_and_its_fields_are_checked():
    hop = {"id": "abc", "layers": [15, 30], "address": "tcp://127.0.0.1:5", "key": None}
    assert decode(_hops_msg([hop, {**hop, "id": "def"}])).hops == [hop, {**hop, "id": "def"}]
    bad = [[hop, hop],  # an id twice
           [{**hop, "layers": [0, 15]}],  # the first range takes no replicas
           [{**hop, "address": "http://x"}],
           [{**hop, "key": "short"}],
           [{**hop, "extra": 1}]]
    for hops in bad:
        with pytest.raises(ProtocolError, match="hops must be"):
            decode(_hops_msg(hops))
    h = _header(_hops_msg([hop]))
    del h["hops"]
    with pytest.raises(ProtocolError, match="hops go with its hops phase"):
        decode([msgpack.packb(h)])
    h = _header(encode(Resplit(1, "prepare", [(0, 15), (15, 30)], [(0, 10), (10, 30)])))
    h["hops"] = [hop]
    with pytest.raises(ProtocolError, match="hops go with its hops phase"):
        decode([msgpack.packb(h)])


# ---- a stage's sockets to the next range's instances ----------------------------------------------------------------

def test_a_stage_sends_by_the_route_to_one_push_per_instance_and_releases_to_all(tmp_path):
    from shared.wire.transport import ZmqTransport

    ctx = zmq.Context()
    pulls = {}
    for name in ("primary", "replica"):
        s = ctx.socket(zmq.PULL)
        s.bind(f"ipc://{tmp_path}/{name}")
        s.RCVTIMEO = 5000
        pulls[name] = s
    t = ZmqTransport(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/primary", (ForwardBatch,), keys=None)
    try:
        t.set_hops([("p1", f"ipc://{tmp_path}/primary", None), ("r1", f"ipc://{tmp_path}/replica", None)])
        assert t.hops["p1"] is None and t.hops["r1"] is not None  # the primary is the outbound itself
        for mb, via in ((1, "r1"), (2, "p1"), (3, None), (4, "r1")):
            assert t.send_from_thread(ForwardBatch(mb, [SeqEntry("a", Decode(3))], hidden=torch.zeros(1, 4)),
                                      via=via)
        got = {name: [decode(s.recv_multipart()).mb_id for _ in range(2)] for name, s in pulls.items()}
        assert got == {"primary": [2, 3], "replica": [1, 4]}
        t.set_hops([("p1", f"ipc://{tmp_path}/primary", None)])  # the replica is gone: its socket closed
        assert list(t.hops) == ["p1"]
        with pytest.raises(KeyError):
            t.send_from_thread(_forward(), via="r1")
    finally:
        t.close()
        for s in pulls.values():
            s.close(0)
        ctx.term()
    assert isinstance(decode(encode(ReleaseSeqs(["a"]))), ReleaseSeqs)


# ---- the chain table and the scheduler ------------------------------------------------------------------------------

def _table(ms=(None, None)):
    from services.gateway.engine.chains import ChainTable, Instance

    table = ChainTable()
    table.follow([Instance("s0", "http://a", (0, 15), "tcp://a:1", None, primary=True),
                  Instance("s1", "http://b", (15, 30), "tcp://b:1", None, primary=True, ms_per_mb=ms[0])])
    assert not table.replicated and table.choose() is None and table.hops() == []
    table.add(Instance("r1", "http://c", (15, 30), "tcp://c:1", None, ms_per_mb=ms[1]))
    return table


def test_chains_are_chosen_by_predicted_work_and_the_first_range_takes_no_replica():
    from services.gateway.engine.chains import Instance

    table = _table()
    chosen = []
    for i in range(4):
        chain = table.choose()
        table.bind(f"q{i}", chain)
        chosen.append(chain)
    assert chosen == [("s1",), ("r1",), ("s1",), ("r1",)]  # equal speeds: by load, the primary first on a tie
    assert [h["id"] for h in table.hops()] == ["s1", "r1"]
    slow = _table(ms=(10.0, 40.0))  # the replica 4x slower: it takes a sequence once the primary holds 4
    picks = []
    for i in range(5):
        chain = slow.choose()
        slow.bind(f"q{i}", chain)
        picks.append(chain[0])
    assert picks == ["s1", "s1", "s1", "s1", "r1"]
    with pytest.raises(ValueError, match="first range takes no replicas"):
        table.add(Instance("r0", "http://d", (0, 15), "tcp://d:1", None))
    assert table.remove("r1") is not None and not table.replicated


def test_the_scheduler_forms_micro_batches_per_chain_and_a_lost_instance_replays_only_its_sequences():
    from services.gateway.engine.request import Request
    from services.gateway.engine.scheduler import Scheduler
    from shared.config import SchedulerConfig

    sched = Scheduler(2, SchedulerConfig(prefix_cache=False), kv_slots=8)
    sched.chains = _table()
    reqs = [Request(prompt_ids=[1, 2, 3], max_tokens=8, seq_id=f"q{i}") for i in range(4)]
    now = time.perf_counter()
    for r in reqs:
        sched.submit(r, now)
    assert [r.chain for r in reqs] == [("s1",), ("r1",), ("s1",), ("r1",)]
    plan = sched.schedule(now)
    assert len(plan.batches) == 4  # K = 2 per chain in use
    for mb in plan.batches:
        assert {r.chain for r in mb.requests} == {mb.route}
    by_route = {}
    for mb in plan.batches:
        by_route.setdefault(mb.route, []).extend(r.seq_id for r in mb.requests)
    assert by_route == {("s1",): ["q0", "q2"], ("r1",): ["q1", "q3"]}
    assert sched.chains.remove("r1") is not None  # the membership takes it out of the table first
    update = sched.instance_lost("r1", "it died")
    assert sorted(update.abandoned) == sorted(mb.mb_id for mb in plan.batches if mb.route == ("r1",))
    # no replica left: its sequences run unrouted (the primary chain), the others keep theirs ...
    assert [r.chain for r in reqs] == [("s1",), None, ("s1",), None]
    assert [r.replay_due for r in reqs] == [False, True, False, True]  # ... and only its sequences replay
    assert all(sched.inflight[mb.mb_id] for mb in plan.batches if mb.route == ("s1",))


def test_a_prefix_is_kept_on_its_chain_and_draws_a_new_sequence_there_while_that_chain_s_load_allows():
    """With replicas the prefix cache stays on: a finished sequence is kept on its chain (the same tokens on two
    chains are two prefixes), a new one with that prefix goes to the prefix's chain unless that chain's predicted work
    is past PREFIX_CHAIN_SLACK x the least loaded one's (then it attaches what the least loaded chain keeps), and a
    lost instance takes the prefixes kept through it, released where the rest of their chain holds them."""
    from services.gateway.engine.chains import PREFIX_CHAIN_SLACK
    from services.gateway.engine.request import Request
    from services.gateway.engine.scheduler import Scheduler
    from shared.config import SchedulerConfig

    sched = Scheduler(2, SchedulerConfig(prefix_cache=True), kv_slots=8, kv_rows=16)
    sched.chains = _table()
    prompt = list(range(100, 140))  # 40 tokens: two whole blocks of 16
    now = time.perf_counter()
    first = [Request(prompt_ids=[*prompt, i], max_tokens=4, seq_id=f"p{i}") for i in range(2)]
    for r in first:
        sched.submit(r, now)
    assert [r.chain for r in first] == [("s1",), ("r1",)]  # no prefix yet: by load
    prefills = sched.schedule(now).batches
    for r in first:
        r.computed = len(r.prompt_ids)  # its prompt's K/V is on its chain
        sched.finish(r, "stop")
    assert sorted(sched.schedule(now).keep) == ["p0", "p1"]
    assert {s: p.chain for s, p in sched.prefix._prefixes.items()} == {"p0": ("s1",), "p1": ("r1",)}

    def admit(seq_id: str) -> Request:
        req = Request(prompt_ids=[*prompt, 9], max_tokens=4, seq_id=seq_id)
        sched.submit(req, now)
        return req

    near = admit("q0")  # loads equal: the most recently kept prefix's chain (r1), attaching it
    assert near.chain == ("r1",) and near.attach == "p1" and near.computed == 32
    assert sched.chains.work(("r1",)) > PREFIX_CHAIN_SLACK * sched.chains.work(("s1",))  # r1: 2 to s1's 0 (+1 each)
    far = admit("q1")  # r1 too busy for its prefix: the least loaded chain, and the copy kept there
    assert far.chain == ("s1",) and far.attach == "p0" and far.computed == 32
    assert sched.chains.find("s1").bound == {"q1"} and sched.chains.find("r1").bound == {"q0"}

    sched.finish(near, "cancelled")  # q0 attached p1: not kept (a cancelled attacher keeps nothing new)
    assert sched.chains.remove("r1") is not None
    update = sched.instance_lost("r1", "it died")
    assert "p1" in sched.schedule(now).release  # its chain lost r1: released where the rest of it holds it
    assert set(sched.prefix._prefixes) == {"p0"} and far.chain == ("s1",)
    assert update.abandoned == [mb.mb_id for mb in prefills if mb.route == ("r1",)]  # (never answered here)


def test_a_promoted_replica_is_its_range_s_primary_under_its_own_id_and_follows_the_pipeline_s_polls():
    from services.gateway.engine.chains import Instance

    table = _table()
    table.find("r1").join_id = "j1"
    table.bind("q0", ("r1",))
    table.bind("q1", ("s1",))
    with pytest.raises(KeyError):
        table.promote("s1", "nope")
    promoted = table.promote("s1", "r1")
    assert [[i.id for i in r] for r in table.ranges] == [["s0"], ["r1"]] and promoted.primary
    assert not table.replicated and table.choose() is None and table.find("s1") is None
    # the pipeline's next poll names the promoted process by its incarnation at its URL: it stays r1, with q0
    table.follow([Instance("s0", "http://a", (0, 15), "tcp://a:1", None, primary=True),
                  Instance("inc-c", "http://c", (15, 30), "tcp://c:1", None, primary=True)])
    assert [[i.id for i in r] for r in table.ranges] == [["s0"], ["r1"]]
    assert table.ranges[1][0].bound == {"q0"} and table.ranges[1][0].join_id == "j1"


def test_an_unmeasured_stage_is_priced_by_its_cores_against_the_joiners():
    from services.gateway.engine.membership import per_layer_ms
    from services.gateway.engine.replica_joins import place_replica
    from tests.stage_infos import make_info

    # the benchmark's mesh: stage 0 with a whole core, stage 1 held to half of one (cgroup quota), a joiner with
    # half a core that measured 2 ms a layer; no stage ran --calibrate
    report = {"ms_per_layer": 2.0, "cores": 0.5}
    stage0 = make_info(layers=(0, 14), num_layers=28, threads=1, cpu_limit=0.0)
    stage1 = make_info(layers=(14, 28), num_layers=28, threads=1, cpu_limit=0.5)
    ms = [per_layer_ms(stage0, report), per_layer_ms(stage1, report)]
    assert ms == [1.0, 2.0]  # a whole core: half the joiner's cost; half a core, as the joiner: its cost
    # stage 1's 14 layers + a 2-layer head at 2 ms = 32 ms; with the replica 16, under stage 0's 14: 2.0x
    assert place_replica([(0, 14), (14, 28)], ms, [1, 1], 2.0, 2.0, 28).predicted_gain == 2.0
    # a stage that calibrated is priced by its calibration, whatever its cores
    timed = make_info(layers=(14, 28), num_layers=28, cpu_limit=0.5,
                      calibration={"rows": [1], "ms_per_step": [42.0], "free_bytes": 1})
    assert per_layer_ms(timed, report) == 3.0
    assert per_layer_ms(stage1, {"ms_per_layer": 2.0}) == 4.0  # a report without cores: measured on one


def test_a_replica_goes_to_the_slowest_range_after_the_first_and_status_draws_it():
    from services.cli.status import replica_lines
    from services.gateway.engine.replica_joins import place_replica

    # stage 1 (15:30 + a 2-layer head) at 2 ms a layer is the bottleneck: 34 ms; a replica as fast halves it to 17,
    # so stage 0 (15 ms) bounds the step: 34 / 17 = 2.0
    p = place_replica([(0, 15), (15, 30)], [1.0, 2.0], [1, 1], 2.0, 2.0, 30)
    assert (p.range, p.layers, p.step_ms_now, p.step_ms_after) == (1, (15, 30), 34.0, 17.0)
    assert p.predicted_gain == 2.0
    assert place_replica([(0, 15), (15, 30)], [9.0, 1.0], [1, 1], 1.0, 2.0, 30).predicted_gain == 1.0  # stage 0's
    assert place_replica([(0, 15), (15, 30)], [1.0, 2.0], [1, 1], 2.0, 2.0, 10) is None  # holds no whole range
    table = _table(ms=(10.0, 12.5))
    table.bind("q0", ("r1",))
    lines = replica_lines({"instances": table.view()})
    assert lines[0] == "stage 1 (15:30) has 2 processes:"
    assert "s1 http://b (primary: 0 sequences, 10.0 ms/mb)" in lines[1] and lines[1].lstrip().startswith("├─")
    assert "r1 http://c (replica: 1 sequences, 12.5 ms/mb)" in lines[2] and lines[2].lstrip().startswith("└─")
    assert replica_lines({"instances": None}) == []


def test_a_replica_whose_weights_mode_is_not_its_primary_s_is_refused_naming_both():
    from services.gateway.engine.membership import refusal
    from services.gateway.engine.pipeline import Pipeline
    from tests.stage_infos import FP, make_info

    pipe = Pipeline(["http://a", "http://b"], "tcp://127.0.0.1:1", FP, 30)
    pipe.infos = [make_info(layers=(0, 15), position="first", weights_mode="f32"),
                  make_info(layers=(15, 30), position="last", weights_mode="lean")]
    report = {"fingerprint": FP, "model": "m", "dtype": "float32", "batch_invariant": False, "max_seq_len": 2048,
              "kv_slots": 8, "weights_mode": "f32"}
    why = refusal(pipe, report, None, pipe.stages[1])  # a replica of 15:30, whose primary runs lean
    assert why is not None and "its weights run as f32" in why and "(layers 15:30) as lean" in why, why
    assert "--weights lean" in why
    assert refusal(pipe, {**report, "weights_mode": "lean"}, None, pipe.stages[1]) is None
    assert refusal(pipe, report, None, pipe.stages[0]) is None  # 0:15 runs f32 too
    assert refusal(pipe, report, None) is None  # a new stage: its weights mode is not compared
    # the checks before it still come first: another dtype is named, not the weights
    assert "computes in bfloat16" in refusal(pipe, {**report, "dtype": "bfloat16"}, None, pipe.stages[1])


# ---- real processes --------------------------------------------------------------------------------------------------

TOKEN = "replica-token-for-the-tests-0123456789"
STREAMS = 4
MAX_TOKENS = 48
PROMPT = "Log {i}: the lighthouse keeper wrote that the storm"
SHARED_PROMPT = ("The lighthouse keeper's log, kept in a careful hand through the long winter of the great storms, "
                 "begins each entry with the weather, the state of the lamp and the ships seen. Entry {i}:")


def _get(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def _replayed(gw_url: str) -> float:
    text = _get(gw_url + "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("stagemesh_gateway_replayed_sequences_total"))


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """A 2-stage mesh (CURVE, float32, --batch-invariant) behind a gateway with a join token."""
    from services.testing.harness import mesh_and_gateway

    log_dir = str(tmp_path_factory.mktemp("replicas"))
    with mesh_and_gateway(2, log_dir, "--join-token", TOKEN,
                          stage_flags=["--batch-invariant", "--compile-decode", "off"]) as (mesh, gw):
        joiners: list = []
        try:
            yield mesh, gw, log_dir, joiners, {}
        finally:
            for j in joiners:
                if j.poll() is None:
                    j.kill()


def _join_replica(gw_url: str, log_dir: str, joiners: list):
    import os
    import subprocess

    from tests.conftest import stagemesh_cmd

    path = os.path.join(log_dir, f"replica{len(joiners)}.log")
    with open(path, "w") as log:
        proc = subprocess.Popen(stagemesh_cmd("join", gw_url, "--token", TOKEN, "--model", "smollm2", "--dtype",
                                              "float32", "--batch-invariant", "--compile-decode", "off", "--listen",
                                              "tcp://127.0.0.1:0", "--http", "127.0.0.1:0", "--as", "replica"),
                                stdout=log, stderr=subprocess.STDOUT)
    joiners.append(proc)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        members = _get(gw_url + "/v1/mesh/members")
        if members["replicas"]:
            (replica,) = members["replicas"].values()
            return proc, path, replica
        assert proc.poll() is None, open(path).read()
        time.sleep(0.5)
    raise AssertionError(open(path).read())


@pytest.mark.processes
async def test_a_replica_joins_both_serve_and_each_sequence_keeps_its_chain_and_a_killed_one_replays_only_its_own(
        replicated):
    import asyncio
    import os
    import re
    import signal

    from services.testing.harness import seeded_streams

    mesh, gw, log_dir, joiners, shared = replicated

    async def streams(on_token=None):
        return await asyncio.wait_for(seeded_streams(gw.url, PROMPT, 900, STREAMS, MAX_TOKENS, on_token), 600)

    reference = shared["reference"] = await streams()  # one chain: no replica yet
    primary_url = mesh.stage_urls[1]
    proc, path, replica = await asyncio.to_thread(_join_replica, gw.url, log_dir, joiners)
    assert replica["layers"] == _get(primary_url + "/info")["layers"]
    before = {u: _get(u + "/info")["microbatches"] for u in (primary_url, replica["url"])}
    replayed0 = _replayed(gw.url)
    assert await streams() == reference  # both chains: every text the one-chain run's
    infos = {u: _get(u + "/info") for u in (primary_url, replica["url"])}
    assert all(infos[u]["microbatches"] > before[u] for u in before), (before, infos)  # both served
    # every micro-batch went through one of them (their ids disjoint), and no sequence replayed: a decode sent to the
    # instance that does not hold its K/V would have come back unknown_sequence and replayed
    assert not set(infos[primary_url]["recent_mb_in"]) & set(infos[replica["url"]]["recent_mb_in"])
    assert _replayed(gw.url) == replayed0

    # the prefix cache with a replica: a long shared prompt, twice; each chain keeps what it computed the first time,
    # and the second time every request attaches a prefix kept on the chain it is bound to and samples what it did
    def hits() -> float:
        return sum(float(line.split()[-1]) for line in _get(gw.url + "/metrics").splitlines()
                   if line.startswith("stagemesh_gateway_prefix_cache_hits_total"))

    hits0 = hits()
    cold = await asyncio.wait_for(seeded_streams(gw.url, SHARED_PROMPT, 500, STREAMS, 8), 600)
    assert all(_get(u + "/info")["kv_slots_cached"] > 0 for u in (primary_url, replica["url"]))  # kept on both chains
    assert await asyncio.wait_for(seeded_streams(gw.url, SHARED_PROMPT, 500, STREAMS, 8), 600) == cold
    assert hits() - hits0 >= STREAMS, _get(gw.url + "/v1/mesh")["gateway"]["prefix_cache"]
    assert _replayed(gw.url) == replayed0  # no prefix_miss replayed anything

    # SIGKILL the replica mid-stream: only the sequences bound to it replay, every text stays the reference's
    killed = asyncio.get_running_loop().create_future()

    def kill_midway(least: int) -> None:
        if least >= MAX_TOKENS // 4 and not killed.done():
            os.kill(proc.pid, signal.SIGKILL)
            killed.set_result(time.time())

    texts = await streams(kill_midway)
    assert texts == reference
    log_text = open(gw.log_path).read()
    lost = re.findall(r"instance \S+ lost \(.*?\): (\d+) sequences replay", log_text)
    assert len(lost) == 1, log_text[-3000:]
    bound = int(lost[0])
    assert 0 < bound < STREAMS, bound  # its own, not the others'
    assert _replayed(gw.url) - replayed0 == bound
    members = _get(gw.url + "/v1/mesh/members")
    assert not members["replicas"] and any(e["event"] == "lost" for e in members["events"]), members
    assert await streams() == reference  # one chain again


@pytest.mark.processes
async def test_a_killed_primary_is_replaced_by_its_replica_and_only_its_own_sequences_replay(replicated):
    """SIGKILL of the process stage 1 was started as, while a joined replica serves beside it: the replica takes its
    place (promotion), only the sequences that were on the dead one replay, every text is the one-chain run's."""
    import asyncio
    import os
    import re
    import signal

    from services.testing.harness import seeded_streams

    mesh, gw, log_dir, joiners, shared = replicated

    async def streams(on_token=None):
        return await asyncio.wait_for(seeded_streams(gw.url, PROMPT, 900, STREAMS, MAX_TOKENS, on_token), 600)

    reference = shared.get("reference") or await streams()
    primary = mesh.stages[1]
    proc, path, replica = await asyncio.to_thread(_join_replica, gw.url, log_dir, joiners)
    log_start = len(open(gw.log_path).read())
    replayed0 = _replayed(gw.url)
    killed = asyncio.get_running_loop().create_future()

    def kill_midway(least: int) -> None:
        if least >= MAX_TOKENS // 4 and not killed.done():
            os.kill(primary.proc.pid, signal.SIGKILL)
            killed.set_result(time.time())

    texts = await streams(kill_midway)
    assert killed.done()
    assert texts == reference
    log_text = open(gw.log_path).read()[log_start:]
    lost = re.findall(r"instance \S+ lost \(stage 1 at .*?\): (\d+) sequences replay", log_text)
    assert len(lost) == 1, log_text[-3000:]
    bound = int(lost[0])
    assert 0 < bound < STREAMS, bound  # the dead one's, not the replica's
    assert _replayed(gw.url) - replayed0 == bound
    assert "state lost" not in log_text, log_text[-3000:]  # no pipeline loss: nothing else replayed
    members = _get(gw.url + "/v1/mesh/members")
    assert any(e["event"] == "promoted" and e["url"] == replica["url"] for e in members["events"]), members
    assert not members["replicas"], members  # it is stage 1 now, not a replica: a joined stage (leave, loss)
    assert [m["url"] for m in members["joined"].values()] == [replica["url"]], members
    assert _get(replica["url"] + "/info")["microbatches"] > 0
    assert [st["url"].rstrip("/") for st in _get(gw.url + "/v1/mesh")["stages"]] == \
        [mesh.stage_urls[0].rstrip("/"), replica["url"].rstrip("/")]
    assert await streams() == reference  # the promoted process serves stage 1 alone
    assert proc.poll() is None
