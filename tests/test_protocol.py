"""The wire format: what the last stage samples reaches the gateway as it was, a forward's in-flight count reaches the
stage, and a malformed field is refused naming it. No processes: encode() and decode() only."""

import msgpack
import pytest
import torch

from shared.protocol import (
    PROTOCOL_VERSION,
    BatchResult,
    ForwardBatch,
    ProtocolError,
    SeqEntry,
    decode,
    encode,
)
from shared.sampling import MAX_TOP_LOGPROBS
from shared.steps import Decode


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
