"""The gateway's start-up check that its stages form one consistent pipeline (services.gateway.engine.pipeline.check_pipeline):
a pure function over the stages' /info documents, so each mismatch is one row of a table."""

import pytest

from services.gateway.engine.pipeline import check_pipeline, stalled_hop
from tests.stage_infos import FP, make_info


def info(start: int, stop: int, position: str, fingerprint: str = FP, max_seq_len: int = 2048, rope=None):
    return make_info(fingerprint=fingerprint, layers=(start, stop), position=position, kv_max_seq_len=max_seq_len,
                     context={"model": 8192, "max_seq_len": max_seq_len, "why": "test", "rope": rope})


def test_a_consistent_pipeline_passes():
    assert check_pipeline([info(0, 17, "first"), info(17, 30, "last")], FP, 30) is None
    assert check_pipeline([info(0, 30, "only")], FP, 30) is None
    # stages whose memory holds different contexts serve together (the pipeline the least), when the rope is the same
    assert check_pipeline([info(0, 17, "first", max_seq_len=8192), info(17, 30, "last", max_seq_len=4096)], FP, 30) is None
    assert check_pipeline([info(0, 17, "first", max_seq_len=8192, rope="long"),
                           info(17, 30, "last", max_seq_len=6144, rope="long")], FP, 30) is None


@pytest.mark.parametrize("infos,says", [
    ([info(0, 17, "first"), "connection refused"], "stage 1 is unreachable: connection refused"),
    ([info(0, 17, "first"), info(17, 30, "last", fingerprint="other")], "stage 1 serves model fingerprint other"),
    ([info(0, 12, "first"), info(14, 30, "last")], "12"),
    ([info(0, 17, "first"), info(17, 29, "last")], "29"),
    ([info(0, 17, "first"), info(17, 30, "middle")], "stage 1 (17:30) reports position middle, expected last"),
    ([info(0, 17, "first", max_seq_len=4096, rope="short"), info(17, 30, "last", max_seq_len=8192, rope="long")],
     "choose different rope factors (short, long: LongRoPE's set depends on the context); start every stage with the "
     "same --max-seq-len"),
    ([info(0, 17, "first"), make_info(layers=(17, 30), position="last", kv_dtype="float32")],
     "the stages keep K/V in different dtypes (float16, float32 for stages 0..1); start every stage with the same "
     "--kv-dtype"),
], ids=["unreachable", "fingerprint", "gap", "uncovered", "position", "rope", "kv-dtype"])
def test_each_mismatch_is_named(infos, says):
    problem = check_pipeline(infos, FP, 30)
    assert problem is not None and says in problem, problem


def _seen(ins: list[int], outs: list[int]):
    return make_info(recent_mb_in=tuple(ins), recent_mb_out=tuple(outs))


@pytest.mark.parametrize("infos, mb, says", [
    ([_seen([], []), _seen([], [])], 7, "hop the gateway -> stage 0: micro-batch 7 sent"),
    ([_seen([5, 9], [5, 9]), _seen([5], [5])], 9, "hop stage 0 -> stage 1: micro-batch 9"),
    ([_seen([3], [3]), _seen([3], [])], 3, "stage 1: micro-batch 3 sent 12 s ago never came back; stage 1 took it in"),
    ([_seen([1, 2], [1]), _seen([1], [1])], 2, "stage 0: micro-batch 2"),
    ([_seen([4], [4]), _seen([4], [4]), _seen([4], [4])], 4, "hop stage 2 -> the gateway: micro-batch 4"),
])
def test_a_lost_micro_batch_is_placed_where_it_stopped(infos, mb, says):
    assert stalled_hop(infos, mb, 12.3).startswith(says) or says in stalled_hop(infos, mb, 12.3)
