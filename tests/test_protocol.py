"""The wire format: what the last stage samples reaches the gateway as it was, a forward's in-flight count reaches the
stage, and a malformed field is refused naming it. No processes: encode() and decode() only."""

import msgpack
import pytest
import torch

from shared.batch.sampling import MAX_TOP_LOGPROBS, LogitInputs, SamplingParams
from shared.batch.steps import Decode
from shared.errors import BadBatch
from shared.wire import protocol
from shared.wire.protocol import (
    PROTOCOL_VERSION,
    SAMPLING_MEMO_SIZE,
    BatchResult,
    ForwardBatch,
    ProtocolError,
    SeqEntry,
    decode,
    encode,
    sampling_rows,
)


def _result_header(**over) -> dict:
    h = {"v": PROTOCOL_VERSION, "kind": "result", "mb": 3, "seq_ids": ["a", "b"], "tokens": [5, 9],
         "logprobs": [-0.25, None], "captures": [], "tensors": []}
    h.update(over)
    return h


def test_top_logprobs_cross_the_wire_only_where_asked():
    top = [(5, -0.25), (7, -1.5), (2, -3.0)]
    got = decode(encode(BatchResult(3, ["a", "b"], [5, 9], [-0.25, None], top=[top, None])))
    assert (got.seq_ids, got.tokens, got.logprobs, got.top) == (["a", "b"], [5, 9], [-0.25, None], [top, None])
    plain = encode(BatchResult(3, ["a", "b"], [5, 9], [None, None]))
    assert "top" not in msgpack.unpackb(plain[0])  # no sequence asked: no key on the wire
    assert decode(plain).top == [None, None]


@pytest.mark.parametrize("top", [
    [[[5, -0.25]]],  # one entry for two sequences
    "everything",
    [[[5, -0.25]], [[-1, -0.5]]],  # negative token id
    [[[5, -0.25]], [[True, -0.5]]],  # a boolean is no token id
    [[[5, -0.25]], [[7, "-0.5"]]],  # logprob not a float
    [[[5, -0.25]], [[7, -0.5, 1]]],  # not a pair
    [[[5, -0.25]], [7, -0.5]],  # pairs not nested
    [[[5, -0.25]], [[i, -1.0] for i in range(MAX_TOP_LOGPROBS + 1)]],  # more than OpenAI's 20
])
def test_a_malformed_top_is_refused_naming_it(top):
    with pytest.raises(ProtocolError) as e:
        decode([msgpack.packb(_result_header(top=top), use_bin_type=True)])
    assert e.value.reason == "schema" and "result top" in str(e.value)
    decode([msgpack.packb(_result_header(top=[[[5, -0.25]] * MAX_TOP_LOGPROBS, None]), use_bin_type=True)])


def test_a_forward_carries_how_many_micro_batches_were_in_flight():
    """The gateway's count of micro-batches in flight reaches each stage (a stage alone in the pipeline may use the
    cores its idle neighbours leave); a header without it means alone, and a bad count is refused naming it."""
    seqs = [SeqEntry("a", Decode(5))]
    for n in (1, 2, 7):
        frames = encode(ForwardBatch(4, seqs, tokens=torch.tensor([3]), in_flight=n))
        assert decode(frames).in_flight == n
    header = msgpack.unpackb(encode(ForwardBatch(4, seqs, tokens=torch.tensor([3])))[0])
    assert "inflight" not in header  # alone: nothing on the wire
    for bad in (0, -1, True, "2", 1 << 20):
        frames = encode(ForwardBatch(4, seqs, tokens=torch.tensor([3])))
        h = msgpack.unpackb(frames[0])
        h["inflight"] = bad
        with pytest.raises(ProtocolError) as e:
            decode([msgpack.packb(h, use_bin_type=True), *frames[1:]])
        assert e.value.reason == "schema" and "'inflight'" in str(e.value)


def _forward_with_sampling(sampling: dict) -> list:
    """A one-sequence forward whose header carries `sampling` as that sequence's wire form."""
    frames = encode(ForwardBatch(4, [SeqEntry("a", Decode(5))], tokens=torch.tensor([3])))
    h = msgpack.unpackb(frames[0])
    h["seqs"][0]["sampling"] = sampling
    return [msgpack.packb(h, use_bin_type=True), *frames[1:]]


def test_sampling_parameters_decode_the_same_however_often_they_come():
    """A sequence's sampling parameters are validated once and then reused at every step and hop (the decoder's
    memo): equal values of another type are kept apart, a bad value is refused every time, and the memo is bounded."""
    for sampling in ({"temperature": 0.5, "top_p": 0.9, "seed": 7}, {"top_k": 1.0}, {"top_k": 1}, {}):
        for _ in range(2):
            got = decode(_forward_with_sampling(sampling)).seqs[0].sampling
            assert got == SamplingParams(**sampling)
            assert all(type(getattr(got, k)) is type(v) for k, v in sampling.items())  # 1 never becomes 1.0
    for _ in range(2):
        with pytest.raises(ProtocolError) as e:
            decode(_forward_with_sampling({"temperature": -1.0}))
        assert e.value.reason == "schema" and "temperature" in str(e.value)
    biased = {"logit_bias": [[5, -100.0]]}  # a list: not hashable, built each time
    assert decode(_forward_with_sampling(biased)).seqs[0].sampling.logit_bias == ((5, -100.0),)
    for seed in range(SAMPLING_MEMO_SIZE + 10):
        decode(_forward_with_sampling({"seed": seed}))
    assert len(protocol._SAMPLING_MEMO) <= SAMPLING_MEMO_SIZE


def test_sampling_parameters_travel_as_their_non_default_fields():
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=3, logit_bias=((4, 1.5),))
    wire = msgpack.unpackb(encode(ForwardBatch(4, [SeqEntry("a", Decode(5), params)], tokens=torch.tensor([3])))[0])
    assert wire["seqs"][0]["sampling"] == {"temperature": 0.7, "top_p": 0.95, "seed": 3, "logit_bias": [[4, 1.5]]}
    assert params.to_wire() is params.to_wire()  # worked out once per instance
    assert decode(encode(ForwardBatch(4, [SeqEntry("a", Decode(5), params)], tokens=torch.tensor([3])))).seqs[0].sampling == params


def test_a_decode_of_several_positions_and_its_several_samples_cross_the_wire():
    """A k-token decode step (the newest token and k - 1 drafts) reaches the stage as it was sent; the result's
    tokens come back flat with a count per sequence, and a plain micro-batch carries neither key."""
    batch = ForwardBatch(1, [SeqEntry("a", Decode(9, 4)), SeqEntry("b", Decode(3))],
                         tokens=torch.tensor([1, 2, 3, 4, 5]))
    got = decode(encode(batch))
    assert [s.step for s in got.seqs] == [Decode(9, 4), Decode(3)] and got.num_tokens == 5
    assert [s.sample_positions for s in got.seqs] == [[10, 11, 12, 13], [4]]
    assert "n" not in msgpack.unpackb(encode(ForwardBatch(1, [SeqEntry("b", Decode(3))],
                                                          tokens=torch.tensor([1])))[0])["seqs"][0]["step"]
    result = decode(encode(BatchResult(1, ["a", "b"], [7, 8, 9, 1, 2], [None] * 5, counts=[4, 1])))
    assert result.by_sequence() == {"a": [(7, None, None), (8, None, None), (9, None, None), (1, None, None)],
                                    "b": [(2, None, None)]}
    assert "counts" not in msgpack.unpackb(encode(BatchResult(1, ["a"], [7], [None]))[0])


@pytest.mark.parametrize("over", [
    {"counts": [2, 1]},  # 3 tokens counted, 2 sent
    {"counts": [1]},  # one count for two sequences
    {"counts": [0, 2]},  # a sequence with no token is not listed
    {"counts": [1, 65]},  # past MAX_DECODE_TOKENS
    {"counts": [1, True]},
])
def test_malformed_counts_are_refused_naming_them(over):
    with pytest.raises(ProtocolError) as e:
        decode([msgpack.packb(_result_header(**over), use_bin_type=True)])
    assert e.value.reason == "schema" and "counts" in str(e.value)  # named, whether the counts or the tokens are off


@pytest.mark.parametrize("step", [{"t": "decode", "pos": 4, "n": 0}, {"t": "decode", "pos": 4, "n": 65},
                                  {"t": "decode", "pos": 4, "n": 2.0}])
def test_a_decode_of_no_or_too_many_positions_is_refused(step):
    header = {"v": PROTOCOL_VERSION, "kind": "forward", "mb": 1, "seqs": [{"id": "a", "step": step}],
              "tensors": []}
    with pytest.raises(ProtocolError, match="'n'") as e:
        decode([msgpack.packb(header, use_bin_type=True)])
    assert e.value.reason == "schema"


def test_a_release_of_all_carries_what_it_spares_and_spares_nothing_alone():
    """A restarted gateway's release of everything but the sequences it re-adopts in place (Gateway.readopt)."""
    msg = protocol.ReleaseSeqs([], everything=True, spare=["a", "b"])
    assert decode(encode(msg)) == msg
    header = {"v": protocol.PROTOCOL_VERSION, "kind": "release", "seq_ids": [], "spare": ["a"], "tensors": []}
    # (spare without all: meaningless, refused)
    with pytest.raises(ProtocolError, match="spare"):
        decode([msgpack.packb(header, use_bin_type=True)])
    with pytest.raises(ProtocolError, match="spare"):
        decode([msgpack.packb({**header, "all": True, "spare": ["x" * 10_000]}, use_bin_type=True)])


def test_the_last_stage_samples_several_positions_of_a_step_only_without_logit_inputs():
    """one_position_a_step: a grammar's mask or a penalties' history holds for one position, so a decode of several
    positions with either is refused, naming the sequence; one position with them, or several without, sample."""
    grammar = LogitInputs(bytes([0b111, 0, 0, 0]))
    penalized = SamplingParams(repetition_penalty=1.3)
    fine = [SeqEntry("a", Decode(5), logit_inputs=grammar), SeqEntry("b", Decode(5, 3)),
            SeqEntry("c", Decode(5), penalized, logit_inputs=LogitInputs(None, ((3, 1),)))]
    producing, counts, params, positions, inputs = sampling_rows(fine)
    assert [e.seq_id for e in producing] == ["a", "b", "c"] and counts == [1, 3, 1]
    assert positions == [6, 6, 7, 8, 6] and inputs == [grammar, None, None, None, fine[2].logit_inputs]
    for bad in (SeqEntry("d", Decode(5, 2), logit_inputs=grammar), SeqEntry("e", Decode(5, 2), penalized)):
        with pytest.raises(BadBatch, match=f"sequence '{bad.seq_id}': a 2-token decode step .* one-token steps"):
            sampling_rows([fine[1], bad])
