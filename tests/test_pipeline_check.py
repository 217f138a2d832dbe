"""The gateway's start-up check that its stages form one consistent pipeline (services.gateway.pipeline.check_pipeline):
a pure function over the stages' /info documents, so each mismatch is one row of a table."""

import pytest

from services.gateway.pipeline import check_pipeline

FP = "abc123"


def info(start: int, stop: int, position: str, fingerprint: str = FP, max_seq_len: int = 2048) -> dict:
    return {"fingerprint": fingerprint, "model": "m", "layers": [start, stop], "position": position,
            "kv": {"max_seq_len": max_seq_len}}


def test_a_consistent_pipeline_passes():
    assert check_pipeline([info(0, 17, "first"), info(17, 30, "last")], FP, 30) is None
    assert check_pipeline([info(0, 30, "only")], FP, 30) is None


@pytest.mark.parametrize("infos,says", [
    ([info(0, 17, "first"), "connection refused"], "stage 1 is unreachable: connection refused"),
    ([info(0, 17, "first"), info(17, 30, "last", fingerprint="other")], "stage 1 serves model fingerprint other"),
    ([info(0, 12, "first"), info(14, 30, "last")], "12"),
    ([info(0, 17, "first"), info(17, 29, "last")], "29"),
    ([info(0, 17, "first"), info(17, 30, "middle")], "stage 1 (17:30) reports position middle, expected last"),
    ([info(0, 17, "first"), info(17, 30, "last", max_seq_len=4096)], "start every stage with the same --max-seq-len"),
], ids=["unreachable", "fingerprint", "gap", "uncovered", "position", "context"])
def test_each_mismatch_is_named(infos, says):
    problem = check_pipeline(infos, FP, 30)
    assert problem is not None and says in problem, problem
