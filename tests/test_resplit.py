"""The live re-split (issue 58): a mesh moves layers between neighbouring stages while it serves, their K/V with
them, and no request fails or changes. Pure checks of a split's validity, the wire messages, one stage's side in
process (StageRuntime pieces handed the messages the worker hands them), and a real 2-stage mesh re-split mid-stream
by `stagemesh rebalance`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.batch.sampling import SamplingParams
from shared.batch.steps import Decode, Prefill
from shared.errors import LayerRangeError
from shared.files.layers import LayerRange, check_resplit, split_at
from shared.runtime.resplit import StageResplit
from shared.runtime.stage_runtime import LocalPipeline, StageRuntime
from shared.wire.protocol import KVParcel, ProtocolError, Resplit, SeqEntry, decode, encode
from tests.conftest import greedy_step as _step

L = LayerRange


# ---- which splits a mesh can move to ------------------------------------------------------------------------------

@pytest.mark.parametrize("old, new", [
    ([L(0, 15), L(15, 30)], [L(0, 19), L(15 + 4, 30)]),
    ([L(0, 15), L(15, 30)], [L(0, 1), L(1, 30)]),
    ([L(0, 10), L(10, 20), L(20, 30)], [L(0, 12), L(12, 18), L(18, 30)]),
    ([L(0, 10), L(10, 20), L(20, 30)], [L(0, 10), L(10, 20), L(20, 30)]),
])
def test_a_split_that_moves_layers_between_neighbours_is_accepted(old, new):
    check_resplit(old, new, 30)


@pytest.mark.parametrize("old, new, says", [
    ([L(0, 15), L(15, 30)], [L(0, 15), L(15, 20), L(20, 30)], "3 stages and the mesh 2"),
    ([L(0, 15), L(15, 30)], [L(0, 12), L(14, 30)], "not contiguous"),
    ([L(0, 15), L(15, 30)], [L(0, 18), L(15, 30)], "not contiguous"),
    ([L(0, 15), L(15, 30)], [L(0, 20), L(20, 31)], "not contiguous from 0 to 30"),
    ([L(0, 15), L(15, 30)], [L(1, 20), L(20, 30)], "not contiguous"),
    ([L(0, 10), L(10, 20), L(20, 30)], [L(0, 21), L(21, 25), L(25, 30)], "layer 20 would move from stage 2 to stage 0"),
    ([L(0, 10), L(10, 20), L(20, 30)], [L(0, 5), L(5, 9), L(9, 30)], "from stage 0 to stage 2"),
])
def test_a_split_the_mesh_cannot_move_to_is_refused_naming_why(old, new, says):
    with pytest.raises(LayerRangeError, match=says):
        check_resplit(old, new, 30)


def test_a_stage_cannot_lose_all_its_layers():
    """A split point at the model's edge or repeated leaves a stage empty: refused before any re-split starts."""
    for points in ([0], [30], [15, 15]):
        with pytest.raises(LayerRangeError, match="strictly increasing"):
            split_at(30, points)
    with pytest.raises(LayerRangeError, match="empty"):
        L(15, 15)


# ---- the wire -----------------------------------------------------------------------------------------------------

def test_resplit_and_parcel_round_trip_and_bad_ones_are_refused():
    msg = Resplit(7, "prepare", [(0, 15), (15, 30)], [(0, 18), (18, 30)], report=[{"stage": 0, "load_s": 0.2}])
    back = decode(encode(msg))
    assert back == msg
    split = [(0, 15), (15, 30)]
    reroute = Resplit(8, "reroute", split, split, route=(1, "tcp://10.0.0.7:5551", None))
    assert decode(encode(reroute)) == reroute
    first = Resplit(9, "reroute", split, split, route=(0, "tcp://10.0.0.7:5551", "tcp://10.0.0.8:5552"))
    assert decode(encode(first)) == first
    probe = Resplit(10, "probe", split, split, route=(1, "tcp://10.0.0.7:5551", None))  # a replacement's probe
    assert decode(encode(probe)) == probe
    k, v = torch.randn(3, 3, 5, 64), torch.randn(3, 3, 5, 64)
    parcel = decode(encode(KVParcel(7, 0, "seq-a", 15, 18, k, v)))
    assert isinstance(parcel, KVParcel) and parcel.length == 5 and (parcel.to, parcel.start, parcel.stop) == (0, 15, 18)
    assert torch.equal(parcel.k, k) and torch.equal(parcel.v, v) and parcel.kept is False
    assert decode(encode(KVParcel(7, 0, "seq-a", 15, 18, k, v, kept=True))).kept is True  # a membership change's

    def frames_of(msg, **header):
        import msgpack
        frames = encode(msg)
        h = msgpack.unpackb(frames[0])
        h.update(header)
        return [msgpack.packb(h), *frames[1:]]

    bad = [
        frames_of(msg, phase="explode"),
        frames_of(msg, old=[[0, 15], [15, 30]], new=[[0, 30]]),
        frames_of(msg, new=[[0, 18], [18, 5000]]),
        frames_of(msg, new=[[3, 3], [3, 30]]),
        frames_of(msg, error="x" * 5000),
        frames_of(msg, report=[{"stage": "zero"}]),
        frames_of(KVParcel(7, 0, "seq-a", 15, 17, k, v)),  # 3 layers of K/V said to be 2
        frames_of(KVParcel(7, 0, "seq-a", 15, 18, k, v[:, :, :4])),  # k and v differ
        frames_of(KVParcel(7, 0, "seq-a", 18, 15, k, v)),
        frames_of(KVParcel(7, 0, "seq-a", 15, 18, k, v), kept="yes"),
        frames_of(msg, route=[1, "tcp://10.0.0.7:5551", None]),  # a route on a phase that is not a reroute
        frames_of(reroute, route=None),  # a reroute without one
        frames_of(probe, route=None),  # a probe without one
        frames_of(reroute, route=[2, "tcp://10.0.0.7:5551", None]),  # a place the split does not have
        frames_of(reroute, route=[1, "http://10.0.0.7:5551", None]),  # not a ZeroMQ address
        frames_of(reroute, route=[1, "tcp://10.0.0.7:5551", "tcp://" + "x" * 300]),
        frames_of(reroute, route=[1, "tcp://10.0.0.7:5551"]),
    ]
    for frames in bad:
        with pytest.raises(ProtocolError):
            decode(frames)
    ids = encode(KVParcel(7, 0, "seq-a", 15, 18, k.to(torch.int64), v.to(torch.int64)))
    with pytest.raises(ProtocolError, match="floating"):
        decode(ids)


# ---- one stage's side, in process -----------------------------------------------------------------------------------

def _generate(pipe: LocalPipeline, prompts: dict[str, list[int]], steps: int, resplit_at: dict[int, list[LayerRange]]):
    seqs = {s: list(p) for s, p in prompts.items()}
    done: dict[str, int] = {}
    all_logits = []
    for i in range(steps):
        if i in resplit_at:
            _resplit(pipe, resplit_at[i], rid=i)
        tokens, logits = _step(pipe, seqs, done)
        all_logits.append(logits)
        for s, t in tokens.items():
            seqs[s].append(t)
            done[s] = done.get(s, 0) + 1
    return seqs, all_logits


def _resplit(pipe: LocalPipeline, new: list[LayerRange], rid: int) -> list[dict]:
    """What the mesh does, in process: each phase through every piece in order, parcels delivered to the piece
    they are for (in a mesh, along the ring)."""
    old = [(p.model.layers.start, p.model.layers.stop) for p in pipe.pieces]
    sides = [StageResplit(pipe.pieces[0].model.config.num_layers) for _ in pipe.pieces]
    for phase in ("prepare", "move", "commit"):
        msg = Resplit(rid, phase, old, [(r.start, r.stop) for r in new])
        for i, side in enumerate(sides):
            if phase == "prepare":
                side.prepare(msg, pipe.pieces[i])
            elif phase == "move":
                for parcel in side.parcels(msg, pipe.pieces[i]):
                    parcel = decode(encode(parcel))  # as it travels
                    assert sides[parcel.to].take(parcel, pipe.pieces[parcel.to])
            else:
                pipe.pieces[i], report = side.commit(msg, pipe.pieces[i])
                assert report["released"] == 0, report
    assert [p.model.layers for p in pipe.pieces] == new
    return []


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_moving_layers_and_their_kv_between_pieces_changes_no_number(smollm2):
    """Two pieces split at 15 decode two sequences; the split moves to 19 (K/V downstream -> upstream) and then to
    11 (upstream -> downstream) between steps: every step's logits equal those of the pieces left at 15, exactly
    (float32), and the pieces hold the new layers."""
    loader = smollm2.loader
    prompts = {"a": smollm2.tokenizer.encode("The capital of France is"),
               "b": smollm2.tokenizer.encode("Once upon a time, in a land far away, there lived")}
    steps = 8
    ref_pipe = LocalPipeline.load(loader, split_at(30, [15]), torch.float32, kv_slots=4, max_seq_len=128)
    ref, ref_logits = _generate(ref_pipe, prompts, steps, {})
    pipe = LocalPipeline.load(loader, split_at(30, [15]), torch.float32, kv_slots=4, max_seq_len=128)
    got, logits = _generate(pipe, prompts, steps, {3: split_at(30, [19]), 6: split_at(30, [11])})
    assert got == ref
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {i} differs after the re-split"
    assert [len(p.model.layers) for p in pipe.pieces] == [11, 19]
    assert pipe.pieces[1].kv.k[0].shape[0] == ref_pipe.pieces[1].kv.k[0].shape[0]  # the same rows


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_a_sequence_whose_kv_did_not_arrive_is_released_not_computed_wrong(smollm2):
    """A parcel lost on the way: the receiving piece releases that sequence at the commit (its next step answers
    unknown_sequence, which the gateway replays) and keeps the other."""
    from shared.errors import UnknownSequence

    prompts = {"a": smollm2.tokenizer.encode("Hello there"), "b": smollm2.tokenizer.encode("Good morning")}
    pipe = LocalPipeline.load(smollm2.loader, split_at(30, [15]), torch.float32, kv_slots=4, max_seq_len=64)
    seqs = {s: list(p) for s, p in prompts.items()}
    tokens, _ = _step(pipe, seqs, {})
    old, new = [(0, 15), (15, 30)], [(0, 17), (17, 30)]
    sides = [StageResplit(30), StageResplit(30)]
    for i, side in enumerate(sides):
        side.prepare(Resplit(1, "prepare", old, new), pipe.pieces[i])
    for parcel in sides[1].parcels(Resplit(1, "move", old, new), pipe.pieces[1]):
        assert parcel.to == 0 and (parcel.start, parcel.stop) == (15, 17)
        if parcel.seq_id == "a":
            assert sides[0].take(parcel, pipe.pieces[0])
    reports = []
    for i, side in enumerate(sides):
        pipe.pieces[i], report = side.commit(Resplit(1, "commit", old, new), pipe.pieces[i])
        reports.append(report)
    assert [r["released"] for r in reports] == [1, 0]
    assert "b" not in pipe.pieces[0].kv and "a" in pipe.pieces[0].kv
    with pytest.raises(UnknownSequence):
        pipe.run([SeqEntry("b", Decode(len(seqs["b"])), SamplingParams())], torch.tensor([tokens["b"]]))


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_a_commit_sent_again_brings_a_half_moved_mesh_to_the_new_split(smollm2):
    """A commit a stage died in (piece 0 committed, piece 1 restarted on its old range with nothing prepared), sent
    again: piece 0 -- already on its new range -- keeps its runtime and K/V; piece 1 loads its new range with an
    empty cache (the gateway replays its sequences); the pieces then compute what pieces loaded at the new split
    compute. A stage whose range is in neither split refuses, naming its layers."""
    from shared.runtime.resplit import ResplitRefused

    prompt = {"a": smollm2.tokenizer.encode("The river ran past the mill and")}
    pipe = LocalPipeline.load(smollm2.loader, split_at(30, [15]), torch.float32, kv_slots=4, max_seq_len=64)
    _step(pipe, {"a": list(prompt["a"])}, {})
    old, new = [(0, 15), (15, 30)], [(0, 19), (19, 30)]
    first, second = StageResplit(30), StageResplit(30)
    first.prepare(Resplit(7, "prepare", old, new), pipe.pieces[0])
    second.prepare(Resplit(7, "prepare", old, new), pipe.pieces[1])
    for parcel in second.parcels(Resplit(7, "move", old, new), pipe.pieces[1]):
        assert first.take(parcel, pipe.pieces[0])
    pipe.pieces[0], _ = first.commit(Resplit(7, "commit", old, new), pipe.pieces[0])
    committed = pipe.pieces[0]
    again = Resplit(7, "commit", old, new)
    for i, side in enumerate([first, StageResplit(30)]):  # piece 1: restarted, nothing prepared
        pipe.pieces[i], report = side.commit(again, pipe.pieces[i], index=i)
        assert report["stage"] == i, report
    assert pipe.pieces[0] is committed and "a" in committed.kv
    assert [p.model.layers for p in pipe.pieces] == split_at(30, [19]) and not pipe.pieces[1].kv.holders
    for piece in pipe.pieces:
        piece.release("a")
    ref = LocalPipeline.load(smollm2.loader, split_at(30, [19]), torch.float32, kv_slots=4, max_seq_len=64)
    fresh = {"b": smollm2.tokenizer.encode("Bells rang over the harbour while")}
    assert torch.equal(_step(pipe, dict(fresh), {})[1], _step(ref, dict(fresh), {})[1])
    stray = LocalPipeline.load(smollm2.loader, split_at(30, [11]), torch.float32, kv_slots=2, max_seq_len=64)
    with pytest.raises(ResplitRefused, match="serves layers 0:11"):
        StageResplit(30).commit(again, stray.pieces[0])


def _prompt_logits(ids: list[int]):
    """logits(pieces, seq): the prompt `ids` run through `pieces` as one pipeline, as sequence `seq` (released after)."""
    def logits(pieces: list, seq: str) -> torch.Tensor:
        pipe = LocalPipeline(pieces)
        out = pipe.run([SeqEntry(seq, Prefill(len(ids), 0, len(ids), True), SamplingParams())], torch.tensor(ids))
        pipe.release(seq)
        return out
    return logits


def _auto_piece(model):
    """load(layers): a float32 piece of `model` with weights auto (integer-dot kernels, stacked), 2 rows of 64."""
    return lambda layers: StageRuntime.load(model.loader, layers, torch.float32, weights="auto", kv_slots=2,
                                            max_seq_len=64)


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_a_piece_narrowed_from_its_own_weights_computes_what_one_loaded_from_the_file_does(smollm2):
    """A stage giving layers away builds its smaller range from the weights it holds (TransformerModel.rebuilt with
    nothing gained: its stacked integer-dot kernels restacked, nothing read from the file): the two narrowed pieces
    together compute exactly the whole piece's logits and what pieces loaded from the file compute, the whole piece is unchanged
    after it, and a one-layer piece holds tensors of its own (not rows of the whole piece's stacks)."""
    ids = smollm2.tokenizer.encode("The capital of France is")
    logits, load = _prompt_logits(ids), _auto_piece(smollm2)

    whole = load(L(0, 30))
    assert all(getattr(k, "stack", None) is not None for b in whole.model.blocks for k in b.linears().values())
    before = logits([whole], "a")
    head, tail = whole.reload(L(0, 11)), whole.reload(L(11, 30))
    assert [p.model.layers for p in (head, tail)] == [L(0, 11), L(11, 30)]
    assert head.model.output is None and tail.model.embedding is None and tail.model.output is whole.model.output
    assert torch.equal(logits([head, tail], "b"), before)
    assert torch.equal(logits([load(L(0, 11)), load(L(11, 30))], "c"), before)
    assert torch.equal(logits([whole], "d"), before)  # the whole piece serves on as it was
    one = whole.reload(L(5, 6))
    stacks = {id(k.stack) for b in whole.model.blocks for k in b.linears().values() if k.stack is not None}
    for k in one.model.blocks[0].linears().values():
        assert k.stack is None and all(getattr(k, f)._base is None for f in k.STACKED), k.kind
        assert id(k.stack) not in stacks


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_a_piece_that_gains_layers_reads_only_those_and_computes_what_one_loaded_from_the_file_does(smollm2,
                                                                                                     monkeypatch):
    """A stage taking layers on (a leave's taker, a re-split's growing side) reads only the layers it gains from the
    file (TransformerModel.rebuilt; from_gguf asked for nothing else) and keeps the blocks it holds: a split at 11
    moved to 19 (the first piece grows, the second narrows) and three pieces whose middle one shifts (it gains above
    and gives below) compute exactly the logits of the whole model."""
    from shared.models import TransformerModel

    ids = smollm2.tokenizer.encode("The capital of France is")
    logits, load = _prompt_logits(ids), _auto_piece(smollm2)

    before = logits([load(L(0, 30))], "a")
    pieces = [load(L(0, 11)), load(L(11, 30)), load(L(0, 8)), load(L(8, 20)), load(L(20, 30))]
    read: list[LayerRange] = []
    from_gguf = TransformerModel.from_gguf.__func__

    def recorded(cls, loader, layers=None, *args, **kwargs):
        read.append(layers)
        return from_gguf(cls, loader, layers, *args, **kwargs)

    monkeypatch.setattr(TransformerModel, "from_gguf", classmethod(recorded))
    grown, narrowed = pieces[0].reload(L(0, 19)), pieces[1].reload(L(19, 30))
    assert read == [L(11, 19)], read  # the gained layers alone
    assert grown.model.embedding is pieces[0].model.embedding and grown.model.output is None
    assert torch.equal(logits([grown, narrowed], "b"), before)
    read.clear()
    moved = [pieces[2].reload(L(0, 10)), pieces[3].reload(L(10, 22)), pieces[4].reload(L(22, 30))]
    assert read == [L(8, 10), L(20, 22)], read
    assert moved[2].model.output is pieces[4].model.output
    assert torch.equal(logits(moved, "c"), before)
    assert torch.equal(logits(pieces[2:], "d"), before)  # the pieces it came from serve on as they were
    read.clear()
    apart = pieces[2].reload(L(20, 30))  # no layer in common: loaded whole
    assert read == [L(20, 30)] and apart.model.output is not pieces[4].model.output


# ---- a real mesh, re-split mid-stream -------------------------------------------------------------------------------

STREAMS = 6
MAX_TOKENS = 64


LONG_TOKENS = 128  # streams that outlast two re-splits asked one after the other (the second came at ~70 tokens)
SHORT_TOKENS = 36  # streams that outlast a kill in a re-split whose prepare is not held (it came within ~12 tokens)


def _body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": f"Story {i}: the lighthouse keeper opened the door and", "max_tokens": max_tokens,
            "temperature": 0.8, "seed": 1000 + i, "ignore_eos": True, "stream": True}


async def _streams(url: str, on_token=None, max_tokens: int = MAX_TOKENS) -> tuple[list[str], list[float]]:
    """STREAMS concurrent seeded streams; their texts, and each one's longest gap between tokens (s). on_token(i, n)
    is awaited after stream i's n-th chunk."""
    import time

    import aiohttp

    from loadtest.client import sse_events

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[str, float]:
        text, gap, last, n = [], 0.0, None, 0
        async with s.post(url + "/v1/completions", json=_body(i, max_tokens)) as r:
            assert r.status == 200, await r.text()
            async for chunk in sse_events(r):
                assert "error" not in chunk, chunk
                text += [c["text"] for c in chunk["choices"]]
                now = time.perf_counter()
                gap, last, n = (max(gap, now - last) if last else 0.0), now, n + 1
                if on_token is not None:
                    await on_token(i, n)
            assert chunk["choices"][0]["finish_reason"] == "length", chunk
        return "".join(text), gap

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        out = await asyncio.gather(*(one(s, i) for i in range(STREAMS)))
    return [t for t, _ in out], [g for _, g in out]


async def _rebalance(url: str, *args: str) -> tuple[int, str, str]:
    from tests.conftest import stagemesh_cmd

    proc = await asyncio.create_subprocess_exec(*stagemesh_cmd("rebalance", url, *args),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.processes
async def test_a_resplit_mid_stream_changes_no_text_and_a_stage_killed_in_one_leaves_one_split(tmp_path, monkeypatch):
    """One `up --split 15 --batch-invariant`, six concurrent seeded streams, the undisturbed run's texts computed once
    (LONG_TOKENS long where two re-splits must fall mid-stream, SHORT_TOKENS elsewhere); the gateway holds before the
    move and the commit of every re-split (STAGEMESH_RESPLIT_HOLD), where the second half kills a stage. (Each half
    used to start an up of its own and compute the same reference texts: one up proves both, in order -- the first
    half's "no sequence replayed" before any kill.)

    The boundary moves mid-stream: `stagemesh rebalance --split 19` moves four layers (and every live sequence's K/V
    of them) from stage 1 up to stage 0, then `--split 12` moves seven down to stage 1: every request finishes, every
    text equals the undisturbed run's, no sequence was replayed (the K/V moved, it was not recomputed), and /v1/mesh,
    the stages' /info and /metrics report the new split. A split the mesh cannot move to is refused naming why; a
    stage killed after a re-split comes back with the range it was moved to.

    A stage killed in a re-split: back at split 15, each case kills a stage with a phase's message in hand
    (services/testing/resplit_faults.py) while every stream still runs: stage 1 in the move (stage 0's K/V parcels
    sent to it), stage 0 in the move (none sent), stage 1 in the commit (stage 0 has committed: the split half moved).
    Every stream still finishes with its undisturbed text; the mesh ends in one split that every stage and the
    gateway's route agree on -- the old one after a move, the new one after a commit -- with no KV slot held; and a
    re-split afterwards is done."""
    import json
    import os
    import signal
    import time

    from services.testing.harness import start_up
    from services.testing.resplit_faults import HOLD_ENV, HOLD_S, mesh_pipeline, resplit_with_a_kill, settled

    # the phases a stage is killed in (resplit_with_a_kill waits for "<phase> (held)"); the prepare is not held, so
    # the streams run no further than they must before a kill
    monkeypatch.setenv(HOLD_ENV, f"move:{HOLD_S:g},commit:{HOLD_S:g}")
    # (its stages polled every 0.5 s, not 2 s: each of the four kills is seen sooner, the same way)
    gw = start_up(2, "float32", str(tmp_path), "--split", "15", "--batch-invariant", "--auto-rebalance", "off",
                  "--stage-poll", "0.5")
    try:
        assert [list(gw.stage_info(i).layers) for i in range(2)] == [[0, 15], [15, 30]]
        # the undisturbed texts of the long streams and of the short ones (the same prompts and seeds, another length)
        (reference, _), (short_reference, _) = await asyncio.gather(_streams(gw.url, max_tokens=LONG_TOKENS),
                                                                    _streams(gw.url, max_tokens=SHORT_TOKENS))

        # ---- the boundary moves mid-stream, twice
        tokens = [0] * STREAMS
        done: list[tuple[str, tuple[int, str, str], int]] = []

        async def on_token(i: int, n: int) -> None:
            tokens[i] = n

        async def move() -> None:
            """Each re-split once every stream has a few tokens more, while all are still running."""
            for split in ("19", "12"):
                floor = min(tokens) + 3
                while min(tokens) < floor:
                    await asyncio.sleep(0.05)
                result = await _rebalance(gw.url, "--split", split, "--json")
                done.append((split, result, min(tokens)))

        mover = asyncio.create_task(move())
        texts, gaps = await asyncio.wait_for(_streams(gw.url, on_token, LONG_TOKENS), 600)
        await asyncio.wait_for(mover, 60)
        assert [split for split, _, _ in done] == ["19", "12"], done
        for split, (rc, out, err), least in done:
            assert rc == 0, err
            result = json.loads(out)
            assert result["changed"] and result["split"] == split, result
            assert result["moved_bytes"] > 0 and result["released"] == 0, result
            assert 0 < least < LONG_TOKENS, f"the re-split to {split} did not happen mid-stream ({least} tokens)"
        assert texts == reference
        assert gw.metric("stagemesh_gateway_replayed_sequences_total") == 0  # moved, not recomputed
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
        assert gw.metric("stagemesh_gateway_resplits_total", outcome="done", trigger="asked") == 2
        assert [list(gw.stage_info(i).layers) for i in range(2)] == [[0, 12], [12, 30]]
        mesh = json.loads(gw.get("/v1/mesh")[1])["pipelines"][0]
        assert mesh["split"] == "12" and mesh["resplits_done"] == 2, mesh
        assert [r["split"] for r in mesh["resplits"]] == ["19", "12"]
        print(f"worst inter-token gap across the re-splits: {max(gaps):.3f} s; pauses "
              f"{[json.loads(r[1])['pause_s'] for _, r, _ in done]}; fewest tokens when each was done "
              f"{[least for _, _, least in done]} of {LONG_TOKENS}")

        # a split the mesh cannot move to is refused with the reason, and the mesh serves on as it was (each
        # `rebalance` a process of its own, all asked at once)
        refusals = [("0", "strictly increasing"), ("30", "strictly increasing"), ("31", "strictly increasing"),
                    ("10,20", "3 stages and the mesh 2"), ("ten", "comma-separated")]
        refused = await asyncio.gather(*(_rebalance(gw.url, "--split", split) for split, _ in refusals))
        for (split, says), (rc, _out, err) in zip(refusals, refused):
            assert rc != 0 and says in err and "refused the re-split" in err, (split, err)
        status, body = await _post(gw.url + "/v1/mesh/resplit", {"split": "12", "stage": 3})
        assert status == 400 and "unknown field" in body
        status, body = await _post(gw.url + "/v1/mesh/resplit", {"split": [12], "pipeline": 4})
        assert status == 400 and "pipeline" in body
        assert gw.metric("stagemesh_gateway_resplits_total", outcome="refused", trigger="asked") == 1  # 10,20 (the rest: parse)
        # (the mesh serves the same texts after them: the restarted stage's round below streams through this split)
        assert [list(gw.stage_info(i).layers) for i in range(2)] == [[0, 12], [12, 30]]

        # a stage that dies after the re-split comes back (up restarts it) with the range it was moved to
        victim = gw.stage_info(1).incarnation
        os.kill(gw.stage_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            try:
                info = gw.stage_info(1)
            except OSError:
                continue
            if info.incarnation != victim and gw.get("/ready")[0] == 200:
                break
        assert info.incarnation != victim and list(info.layers) == [12, 30], info
        restarted, _ = await _streams(gw.url, max_tokens=SHORT_TOKENS)
        assert restarted == short_reference

        # ---- a stage killed in a re-split, from split 15
        status, body = await _post(gw.url + "/v1/mesh/resplit", {"split": "15"})
        assert status == 200, body
        state = await settled(gw, 2)
        assert state["agree"] and state["route"] == "15", state
        # (split asked, phase, victim, the split the mesh must end in)
        cases = [("19", "move", 1, "15"), ("12", "move", 0, "15"), ("19", "commit", 1, "19")]
        for split, phase, victim, ends_in in cases:
            tokens = [0] * STREAMS
            outcome: list[dict] = []

            async def on_token(i: int, n: int, tokens=tokens) -> None:
                tokens[i] = n

            async def kill(split=split, phase=phase, victim=victim, tokens=tokens, outcome=outcome) -> None:
                while min(tokens) < 3:
                    await asyncio.sleep(0.05)
                outcome.append(await resplit_with_a_kill(gw, split, phase, victim))
                outcome.append({"most_tokens_after_the_kill": max(tokens)})

            killer = asyncio.create_task(kill())
            texts, _ = await asyncio.wait_for(_streams(gw.url, on_token, max_tokens=SHORT_TOKENS), 600)
            await asyncio.wait_for(killer, 120)
            case = (split, phase, victim, outcome)
            assert outcome[0]["status"] == 503, case  # not done: refused (move) or failed and sent again (commit)
            # every stream was still running when the victim died (read once the re-split answered, later still)
            assert outcome[1]["most_tokens_after_the_kill"] < SHORT_TOKENS, case
            assert texts == short_reference, case
            state = await settled(gw, 2)
            assert state["agree"] and state["route"] == ends_in, (case, state)
            assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
            print(f"killed stage {victim} in the {phase} of a re-split to {split}: at most "
                  f"{outcome[1]['most_tokens_after_the_kill']} of {SHORT_TOKENS} tokens by then")
        assert gw.metric("stagemesh_gateway_resplits_total", outcome="refused", trigger="asked") == 1 + 2
        assert gw.metric("stagemesh_gateway_resplits_total", outcome="failed", trigger="asked") == 1
        assert gw.metric("stagemesh_gateway_resplits_total", outcome="recommitted", trigger="asked") == 1

        # the mesh moves again, and serves the same texts in its new split
        status, body = await _post(gw.url + "/v1/mesh/resplit", {"split": "12"})
        assert status == 200, body
        state = await settled(gw, 2)
        assert state["agree"] and state["route"] == "12" == mesh_pipeline(gw)["split"], state
        again, _ = await _streams(gw.url, max_tokens=SHORT_TOKENS)
        assert again == short_reference
    finally:
        gw.stop()


async def _post(url: str, body: dict) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.text()


# ---- --auto-rebalance's policy --------------------------------------------------------------------------------------

def _infos(layers: list[tuple[int, int]], busy: list[float], microbatches: int, clock: float,
           head: list[float] | None = None):
    from types import SimpleNamespace
    return [SimpleNamespace(layers=r, incarnation=f"x{i}", busy_seconds=b, microbatches=microbatches, clock_s=clock,
                            head_seconds=head[i] if head else 0.0, cpu_seconds=0.0, cpu_limit=0.0)
            for i, (r, b) in enumerate(zip(layers, busy))]


class _Mesh:
    """Stage counters that grow as a mesh at work: each window, every stage computes `per_mb` ms a micro-batch.
    timed_head: the last stage reports its head's share of that apart (head_seconds), as a stage does."""

    def __init__(self, layers, timed_head: bool = False):
        self.layers, self.busy, self.mb, self.t = layers, [0.0] * len(layers), 0, 0.0
        self.head = [0.0] * len(layers) if timed_head else None

    def tick(self, ms_per_layer: list[float], head: float, seconds: float = 10.0, microbatches: int = 100):
        self.t += seconds
        self.mb += microbatches
        for i, (a, b) in enumerate(self.layers):
            blocks = (b - a) + (head if i == len(self.layers) - 1 else 0)
            self.busy[i] += microbatches * blocks * ms_per_layer[i] / 1e3
            if self.head is not None and i == len(self.layers) - 1:
                self.head[i] += microbatches * head * ms_per_layer[i] / 1e3
        return _infos(self.layers, self.busy, self.mb, self.t, self.head)


@pytest.fixture(scope="module")
def facts():
    from shared.files.gguf_loader import GgufLoader
    from shared.files.model_registry import resolve_model
    from shared.runtime.plan import ModelFacts
    return ModelFacts.from_gguf(GgufLoader(resolve_model("smollm2")), kv_itemsize=4)


def test_auto_rebalance_moves_only_after_two_windows_agree_and_then_waits(facts):
    """Stage 1 twice as slow a layer at 15:15: the first window only makes the proposal a candidate, the second
    (the same proposal) returns it -- layers moving to stage 0; after the re-split nothing is proposed until two whole
    windows of the new split agree, and a split that is about as good (gain under --rebalance-gain) is never proposed."""
    from services.gateway.engine.balance import Balancer

    head = facts.head_cost_in_layers
    mesh = _Mesh([(0, 15), (15, 30)])
    b = Balancer(facts, window_s=10.0, min_gain=1.15)
    assert b.observe(mesh.tick([1.0, 2.0], head), 8) is None  # the window's start
    assert b.observe(mesh.tick([1.0, 2.0], head), 8) is None  # a candidate
    split = b.observe(mesh.tick([1.0, 2.0], head), 8)
    assert split is not None and split[0].stop > 15, split
    b.resplit_ended()
    mesh.layers = [(r.start, r.stop) for r in split]
    slower = [b.observe(mesh.tick([1.0, 4.0], head), 8) for _ in range(3)]
    assert slower[:2] == [None, None] and slower[2] is not None  # measured afresh: start, candidate, then moves
    assert slower[2][0].stop > split[0].stop

    even = Balancer(facts, window_s=10.0, min_gain=1.15)
    mesh = _Mesh([(0, 17), (17, 30)])
    assert all(even.observe(mesh.tick([1.0, 1.05], head), 8) is None for _ in range(6))
    assert even.last_proposal is not None and even.last_proposal["predicted_gain"] < 1.15


def test_auto_rebalance_does_not_flap_nor_measure_an_idle_or_changing_mesh(facts):
    from services.gateway.engine.balance import Balancer

    head = facts.head_cost_in_layers
    b = Balancer(facts, window_s=10.0, min_gain=1.15)
    mesh = _Mesh([(0, 15), (15, 30)])
    b.observe(mesh.tick([1.0, 2.0], head), 8)
    for speeds in ([1.0, 2.0], [2.0, 1.0], [1.0, 2.0], [2.0, 1.0]):  # each window proposes the other way
        assert b.observe(mesh.tick(speeds, head), 8) is None
    idle = Balancer(facts, window_s=10.0, min_gain=1.15)
    mesh = _Mesh([(0, 15), (15, 30)])
    assert all(idle.observe(mesh.tick([1.0, 3.0], head, microbatches=2), 8) is None for _ in range(5))


def test_auto_rebalance_prices_the_head_the_last_stage_timed(facts):
    """The last stage's head (final norm + lm_head + sampling) costs what it costs here -- 9 blocks, not the 4.4 the
    model's weights suggest: timed apart (head_seconds), the proposal puts the boundary where the stages' times are
    equal (26 for stage 1 at half speed: 26 = 2 * (4 + 9)); priced in blocks it stops short."""
    from services.gateway.engine.balance import Balancer

    assert facts.head_cost_in_layers < 9
    proposals = {}
    for timed in (True, False):
        b, mesh = Balancer(facts, window_s=10.0, min_gain=1.15), _Mesh([(0, 15), (15, 30)], timed_head=timed)
        for _ in range(2):
            b.observe(mesh.tick([1.0, 2.0], 9.0), 8)
        proposals[timed] = int(b.last_proposal["split_proposed"])
    assert proposals[True] == 26 and proposals[False] < 26, proposals


def test_a_process_pinned_to_one_core_counts_one_usable_core():
    """A stage's default threads are the cores it may run on (its affinity: a taskset, a container's cpuset), not
    the machine's: more torch threads than usable cores spin against each other."""
    import os
    import subprocess
    import sys

    code = "import os; from shared.cpu import usable_cores; print(usable_cores(), os.cpu_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})).stdout.split()
    assert out == ["1", str(os.cpu_count())], out


def test_a_stage_under_a_cpu_limit_is_as_slow_as_its_cpu_time_over_the_limit():
    """A throttled stage stalls for the rest of each CFS period, computing or waiting, so its busy seconds alone make
    it look faster than it serves: its window is priced at its CPU time over its cgroup's limit where that is longer,
    its head scaled alike; a stage without a limit, or within it, keeps its busy time."""
    from shared.runtime.plan import StageTime

    layers = LayerRange(22, 30)
    free = StageTime.measured(layers, 100, busy_s=1.6, head_s=0.4, cpu_s=1.5, cpu_limit=0.0)
    assert (free.ms_per_microbatch, free.head_ms) == pytest.approx((16.0, 4.0))
    within = StageTime.measured(layers, 100, busy_s=1.6, head_s=0.4, cpu_s=0.5, cpu_limit=0.5)  # 10 ms < 16 ms
    assert within.ms_per_microbatch == pytest.approx(16.0)
    limited = StageTime.measured(layers, 100, busy_s=1.6, head_s=0.4, cpu_s=1.2, cpu_limit=0.5)  # 24 ms a batch
    assert (limited.ms_per_microbatch, limited.head_ms) == pytest.approx((24.0, 6.0))
    assert StageTime.measured(layers, 100, busy_s=1.6).head_ms is None


def test_the_cpu_limit_is_read_from_the_process_cgroup(tmp_path):
    from shared.cpu import cpu_limit

    def tree(cgroup: str, files: dict[str, str]):
        (tmp_path / "proc").write_text(cgroup)
        for name, text in files.items():
            (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "fs" / name).write_text(text)
        return cpu_limit(str(tmp_path / "proc"), str(tmp_path / "fs"))

    v1 = "4:memory:/x\n1:cpu,cpuacct:/kubepods/pod1\n0::/\n"
    assert tree(v1, {"cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "150000",
                     "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000"}) == 1.5
    assert tree(v1, {"cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "-1"}) == 0.0  # no limit
    v2 = "0::/system.slice/stage.service\n"
    assert tree(v2, {"system.slice/stage.service/cpu.max": "50000 100000\n"}) == 0.5
    assert tree(v2, {"system.slice/stage.service/cpu.max": "max 100000\n"}) == 0.0
    assert tree("0::/inside\n", {"cpu.max": "200000 100000\n"}) == 2.0  # a container sees its group as the root
    assert cpu_limit(str(tmp_path / "absent"), str(tmp_path / "fs")) == 0.0


def test_a_far_proposal_is_approached_one_neighbour_step_at_a_time():
    from services.gateway.engine.balance import toward

    old = split_at(30, [10, 20])
    step = toward(old, split_at(30, [25, 28]), 30)
    assert step == split_at(30, [20, 28]), step  # boundary 1 stops at stage 2's old start: no layer moves two hops
    check_resplit(old, step, 30)
    assert toward(old, split_at(30, [5, 15]), 30) == split_at(30, [5, 15])  # within reach: all the way
    assert toward(old, old, 30) is None


@pytest.mark.processes
async def test_auto_rebalance_moves_a_lopsided_split_while_streams_run(tmp_path):
    """`up --split 27 --auto-rebalance --rebalance-window 2`: stage 0 holds 27 of 30 layers, far from balanced on
    one host. Under streams the gateway re-splits by itself (trigger "auto", counted), the boundary moves down, no
    request fails, and the streams that ran across it have the texts the same requests give afterwards."""
    import json

    from services.testing.harness import start_up

    gw = start_up(2, "float32", str(tmp_path), "--split", "27", "--batch-invariant", "--auto-rebalance", "on",
                  "--rebalance-window", "2", "--rebalance-gain", "1.1")
    try:
        auto = 0.0
        across = None
        for _ in range(12):
            before = gw.metric("stagemesh_gateway_resplits_total", outcome="done", trigger="auto")
            texts, _ = await asyncio.wait_for(_streams(gw.url), 300)
            auto = gw.metric("stagemesh_gateway_resplits_total", outcome="done", trigger="auto")
            if auto > before:
                across = texts
                break
        assert across is not None, f"no automatic re-split in 12 rounds of streams (log {gw.log_path})"
        mesh = json.loads(gw.get("/v1/mesh")[1])["pipelines"][0]
        assert int(mesh["split"]) < 27 and mesh["resplits"][-1]["trigger"] == "auto", mesh
        assert mesh["auto_rebalance"]["window_s"] == 2.0 and mesh["auto_rebalance"]["min_gain"] == 1.1
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
        after, _ = await asyncio.wait_for(_streams(gw.url), 300)
        assert after == across
    finally:
        gw.stop()
