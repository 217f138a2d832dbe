"""The live re-split (issue 58): a mesh moves layers between neighbouring stages while it serves, their K/V with
them, and no request fails or changes. Pure checks of a split's validity, the wire messages, one stage's side in
process (StageRuntime pieces handed the messages the worker hands them), and a real 2-stage mesh re-split mid-stream
by `stagemesh rebalance`."""

from __future__ import annotations

import pytest
import torch

from shared.batch.sampling import SamplingParams
from shared.batch.steps import Decode, Prefill
from shared.errors import LayerRangeError
from shared.files.layers import LayerRange, check_resplit, split_at
from shared.runtime.resplit import StageResplit
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import KVParcel, ProtocolError, Resplit, SeqEntry, decode, encode

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
    k, v = torch.randn(3, 3, 5, 64), torch.randn(3, 3, 5, 64)
    parcel = decode(encode(KVParcel(7, 0, "seq-a", 15, 18, k, v)))
    assert isinstance(parcel, KVParcel) and parcel.length == 5 and (parcel.to, parcel.start, parcel.stop) == (0, 15, 18)
    assert torch.equal(parcel.k, k) and torch.equal(parcel.v, v)

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
    ]
    for frames in bad:
        with pytest.raises(ProtocolError):
            decode(frames)
    ids = encode(KVParcel(7, 0, "seq-a", 15, 18, k.to(torch.int64), v.to(torch.int64)))
    with pytest.raises(ProtocolError, match="floating"):
        decode(ids)


# ---- one stage's side, in process -----------------------------------------------------------------------------------

def _step(pipe: LocalPipeline, seqs: dict[str, list[int]], done: dict[str, int]) -> dict[str, int]:
    """One micro-batch of every sequence (its prompt first, then one decode): the greedy next token of each."""
    work, ids = [], []
    for seq_id, tokens in seqs.items():
        if seq_id not in done:
            work.append(SeqEntry(seq_id, Prefill(len(tokens), 0, len(tokens), True), SamplingParams()))
            ids += tokens
        else:
            work.append(SeqEntry(seq_id, Decode(len(tokens) - 1), SamplingParams()))
            ids.append(tokens[-1])
    logits = pipe.run(work, torch.tensor(ids))
    return {w.seq_id: int(row.argmax()) for w, row in zip(work, logits)}, logits


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
