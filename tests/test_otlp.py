"""Optional distributed tracing (--otlp-endpoint): the wire field, its validation, the flag's edge checks, and a
real `stagemesh up --stages 2` exporting to an OTLP/HTTP receiver run here (services/testing/otlp_receiver.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict

import aiohttp
import msgpack
import pytest
import torch

from services.cli.main import main as cli_main
from services.testing.harness import start_up
from services.testing.otlp_receiver import OtlpReceiver
from shared.batch.steps import Decode, Prefill
from shared.errors import StagemeshError
from shared.observe.otlp import INSTALL_HINT, OtlpTracer, otlp_endpoint, require_sdk
from shared.wire.protocol import ForwardBatch, ProtocolError, SeqEntry, decode, encode

TP_A = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TP_B = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _batch(**kw) -> ForwardBatch:
    return ForwardBatch(7, [SeqEntry("a", Prefill(3, 0, 3, True), traceparent=kw.pop("tp_a", None)),
                            SeqEntry("b", Decode(4), traceparent=kw.pop("tp_b", None))],
                        tokens=torch.arange(4, dtype=torch.int64), **kw)


# ---- the wire field ---------------------------------------------------------------------------------------------

def test_traceparents_cross_the_wire_only_when_given():
    traced = decode(encode(_batch(traceparent=TP_A, tp_a=TP_A, tp_b=TP_B)))
    assert traced.traceparent == TP_A
    assert [s.traceparent for s in traced.seqs] == [TP_A, TP_B]

    frames = encode(_batch())  # tracing off: no field anywhere in the header
    header = msgpack.unpackb(frames[0])
    assert "tp" not in header and all("tp" not in s for s in header["seqs"])
    plain = decode(frames)
    assert plain.traceparent is None and [s.traceparent for s in plain.seqs] == [None, None]


BAD_TRACEPARENTS = [
    TP_A.upper(),  # hex must be lowercase
    "01" + TP_A[2:],  # only version 00
    TP_A[:-1],  # too short
    TP_A + "-extra",  # too long
    "00-" + "0" * 32 + TP_A[35:],  # all-zero trace id
    TP_A[:36] + "0" * 16 + TP_A[52:],  # all-zero span id
    "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",  # not hex
    "x" * 10_000,  # unbounded string
    12345,
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
]


@pytest.mark.parametrize("bad", BAD_TRACEPARENTS, ids=range(len(BAD_TRACEPARENTS)))
@pytest.mark.parametrize("where", ["batch", "sequence"])
def test_protocol_rejects_a_bad_traceparent(bad, where):
    frames = encode(_batch(traceparent=TP_A, tp_a=TP_A, tp_b=TP_B))
    header = msgpack.unpackb(frames[0])
    (header if where == "batch" else header["seqs"][1])["tp"] = bad
    frames[0] = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(ProtocolError) as e:
        decode(frames)
    assert e.value.reason == "schema" and "traceparent" in str(e.value)


# ---- the flag at the edge -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://tempo.example.com/otlp/v1/traces", "https://tempo.example.com/otlp/v1/traces"),
    ("http://[::1]:4318", "http://[::1]:4318/v1/traces"),
])
def test_endpoint_is_normalized(url, expected):
    assert otlp_endpoint(url) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:4318", "grpc://collector:4317", "http://", "http://host:99999",
                                 "http://host:4318/v1/traces?x=1", "http://host:0", "ftp://host/v1/traces", ""])
def test_bad_endpoint_is_refused(url):
    with pytest.raises(StagemeshError, match="--otlp-endpoint"):
        otlp_endpoint(url)


def test_missing_sdk_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # what an absent package looks like
    with pytest.raises(StagemeshError, match=r"pip install -e '\.\[otlp\]'"):
        require_sdk()
    # `up` checks before it starts any stage: one line on stderr, exit 2
    assert cli_main(["up", "--otlp-endpoint", "http://127.0.0.1:4318", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert INSTALL_HINT in err and "\n" not in err


def test_bad_endpoint_stops_up_before_any_stage(capsys):
    assert cli_main(["up", "--otlp-endpoint", "collector:4318", "--port", "1"]) == 2
    out = capsys.readouterr()
    assert "--otlp-endpoint 'collector:4318'" in out.err and "starting" not in out.out


def test_tracer_exports_parent_links_and_errors():
    with OtlpReceiver() as rx:
        tracer = OtlpTracer(otlp_endpoint(rx.url), "unit")
        root = tracer.start("root")
        other = tracer.start("other")
        child = tracer.start("child", tracer.traceparent(root), [tracer.traceparent(other)], {"k": 1})
        tracer.end(child, {"j": 2}, error="failed")
        tracer.end(other)
        tracer.end(root)
        tracer.shutdown()  # flushes
        spans = {s.name: s for s in rx.spans()}
    assert set(spans) == {"root", "other", "child"}
    c = spans["child"]
    assert (c.trace_id, c.parent_span_id) == (spans["root"].trace_id, spans["root"].span_id)
    assert c.links == ((spans["other"].trace_id, spans["other"].span_id),)
    assert c.attributes == {"k": 1, "j": 2} and c.error and not spans["root"].error
    assert c.service == "unit" and spans["root"].parent_span_id == ""


# ---- a real mesh --------------------------------------------------------------------------------------------------

PROMPTS = ["Count to five:", "The capital of France is", "Once upon a time"]
MAX_TOKENS = 6


async def _complete_all(url: str) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async def one(prompt: str) -> dict:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def _wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.processes
def test_one_trace_per_request_with_a_span_per_microbatch_per_stage(tmp_path):
    with OtlpReceiver() as rx:
        # --max-inflight 1: every micro-batch carries every running request, so spans link across requests
        gw = start_up(2, "float32", str(tmp_path), "--otlp-endpoint", rx.url, "--max-inflight", "1")
        try:
            layers = [tuple(gw.stage_info(i).layers) for i in range(2)]
            responses = asyncio.run(_complete_all(gw.url))
        finally:
            gw.stop()  # SIGTERM: the gateway and both stages flush their spans on the way out
        expected_services = {"stagemesh-gateway", "stagemesh-stage-0", "stagemesh-stage-1"}
        _wait_for(lambda: {s.service for s in rx.spans()} >= expected_services)
        spans = rx.spans()

    by_id = {(s.trace_id, s.span_id): s for s in spans}
    roots = {s.attributes["stagemesh.request_id"]: s for s in spans if s.name == "stagemesh.request"}
    ids = {r["id"].removeprefix("cmpl-"): r for r in responses}
    assert set(roots) == set(ids), "one stagemesh.request span per request"
    assert len({r.trace_id for r in roots.values()}) == len(PROMPTS), "each request its own trace"
    for rid, root in roots.items():
        usage = ids[rid]["usage"]
        assert root.service == "stagemesh-gateway" and root.parent_span_id == "" and not root.error
        assert root.attributes["stagemesh.prompt_tokens"] == usage["prompt_tokens"]
        assert root.attributes["stagemesh.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
        assert root.attributes["stagemesh.finish_reason"] == ids[rid]["choices"][0]["finish_reason"] == "length"
    root_refs = {(r.trace_id, r.span_id) for r in roots.values()}

    microbatches = [s for s in spans if s.name == "stagemesh.microbatch"]
    computes = [s for s in spans if s.name == "stagemesh.stage.compute"]
    assert {s.service for s in microbatches} == {"stagemesh-gateway"}
    assert {s.name for s in spans} == {"stagemesh.request", "stagemesh.microbatch", "stagemesh.stage.compute"}
    for mb in microbatches:  # a child of one request's span, linked to the other requests it carried
        assert (mb.trace_id, mb.parent_span_id) in root_refs
        assert set(mb.links) <= root_refs and all(t != mb.trace_id for t, _ in mb.links)
        assert 1 + len(mb.links) == mb.attributes["stagemesh.sequences"]
    assert any(mb.links for mb in microbatches), "some micro-batch carried several requests"

    per_stage = defaultdict(list)
    for c in computes:
        per_stage[c.service].append(c)
        mb = by_id[(c.trace_id, c.parent_span_id)]  # parented to the gateway's span for its micro-batch ...
        assert mb.name == "stagemesh.microbatch"
        assert c.attributes["stagemesh.microbatch.id"] == mb.attributes["stagemesh.microbatch.id"]
        assert set(c.links) == set(mb.links)  # ... and linked to the same other requests
        assert c.attributes["stagemesh.sequences"] == mb.attributes["stagemesh.sequences"]
        assert c.attributes["stagemesh.tokens"] == mb.attributes["stagemesh.tokens"]
        assert mb.start_ns - 5e6 <= c.start_ns <= c.end_ns <= mb.end_ns + 5e6, "compute within send -> result"
        index = int(c.service.rsplit("-", 1)[1])
        assert c.attributes["stagemesh.stage.index"] == index
        assert c.attributes["stagemesh.stage.layers"] == f"{layers[index][0]}:{layers[index][1]}"
        assert 0 <= c.attributes["stagemesh.hop_ms"] < 1000 and 0 <= c.attributes["stagemesh.queue_wait_ms"] < 10_000
    assert any(c.attributes["stagemesh.hop_ms"] > 0 for c in computes)  # measured, not a default
    assert set(per_stage) == {"stagemesh-stage-0", "stagemesh-stage-1"}
    # the same micro-batches reached both stages: one compute span per micro-batch per stage
    mb_ids = sorted(mb.attributes["stagemesh.microbatch.id"] for mb in microbatches)
    for stage, cs in per_stage.items():
        assert sorted(c.attributes["stagemesh.microbatch.id"] for c in cs) == mb_ids, stage
    for rid, root in roots.items():  # every request's own trace shows compute on every stage
        stages_in_trace = {c.service for c in computes if c.trace_id == root.trace_id}
        assert stages_in_trace == {"stagemesh-stage-0", "stagemesh-stage-1"}, rid


@pytest.mark.processes
def test_without_the_flag_nothing_is_exported(tmp_path, monkeypatch):
    with OtlpReceiver() as rx:
        # an SDK configured from the environment would export here: stagemesh must not build one without the flag
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url)
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        gw = start_up(1, "float32", str(tmp_path))
        try:
            responses = asyncio.run(_complete_all(gw.url))
        finally:
            gw.stop()
        # the process has exited: an SDK's batch processor would have exported at its shutdown, before the exit
        assert gw.proc.poll() is not None
        assert len(responses) == len(PROMPTS)
        assert rx.requests == 0 and rx.spans() == []
