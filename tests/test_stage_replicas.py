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
    assert _header(plain)["v"] == PROTOCOL_VERSION == 8


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
