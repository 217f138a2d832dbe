"""The scheduler alone: admission, token budget, chunked prefill beside running decodes, deadlines, cancellation,
replay bookkeeping, error codes -- and the output processor it reports to.

The scheduler under test is the real one; behind it, in place of ZeroMQ, a client that records each micro-batch
and, when the test says so, computes it for real on a tiny random GGUF (LocalPipeline + the last stage's
sampling) -- so the tests choose when results arrive, which a live mesh cannot do deterministically."""

from __future__ import annotations

import asyncio
import itertools
import math

import aiohttp
import pytest
import torch

from services.gateway.metrics import GatewayMetrics
from services.gateway.output import OutputProcessor
from services.gateway.pipeline import Pipeline
from services.gateway.scheduler import QueueFull, Scheduler, SeqOutput, Sequence
from shared.config import ServingConfig
from shared.errors import UnknownSequence
from shared.generation import generate_tokens, run_local
from shared.gguf_loader import GgufLoader
from shared.pipeline_client import PipelineError
from shared.protocol import BatchError, BatchResult, ForwardBatch
from shared.runtime import LocalPipeline
from shared.sampling import SamplingParams
from tests.factories import TinySpec, write_tiny_gguf

CONTEXT = 512


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("sched") / "tiny.gguf"), TinySpec(arch="llama"))


class RecordingClient:
    """PipelineClient's interface; micro-batches wait until the test delivers them (computed for real)."""

    def __init__(self, pipeline: LocalPipeline):
        self.local = pipeline
        self.sent: dict[int, tuple[ForwardBatch, asyncio.Future]] = {}
        self.order: list[ForwardBatch] = []
        self.released: list[list[str]] = []
        self.kept: list[str] = []
        self.abandoned: list[int] = []
        self._ids = itertools.count(1)

    def next_mb_id(self) -> int:
        return next(self._ids)

    async def submit(self, batch: ForwardBatch) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.sent[batch.mb_id] = (batch, fut)
        self.order.append(batch)
        return fut

    def abandon(self, mb: int) -> None:
        self.abandoned.append(mb)
        _, fut = self.sent.pop(mb)
        fut.cancel()

    async def release(self, ids: list[str], keep: list[str] = ()) -> None:
        self.released.append(list(ids))
        self.kept.extend(keep)
        for sid in ids:
            self.local.release(sid)
        for sid in keep:
            self.local.keep(sid)

    def deliver(self, mb: int | None = None) -> ForwardBatch:
        """Compute micro-batch mb (default: the oldest pending) and resolve its future."""
        mb = min(self.sent) if mb is None else mb
        batch, fut = self.sent.pop(mb)
        sampled = run_local(self.local, batch.seqs, batch.tokens.tolist())
        ids = list(sampled)
        fut.set_result(BatchResult(mb, ids, [sampled[i][0] for i in ids], [sampled[i][1] for i in ids], [],
                                   top=[sampled[i][2] for i in ids]))
        return batch

    def fail(self, mb: int, code: str, message: str) -> None:
        batch, fut = self.sent.pop(mb)
        fut.set_exception(PipelineError(BatchError(mb, "stage[0:2]", code, message, [s.seq_id for s in batch.seqs])))


class Harness:
    def __init__(self, tiny_path: str, kv_slots: int = 4, max_inflight: int = 1, prefix_cache: bool = True, **serving):
        local = LocalPipeline.load(GgufLoader(tiny_path), None, torch.float32, kv_slots=kv_slots, max_seq_len=CONTEXT)
        self.client = RecordingClient(local)
        self.pipeline = Pipeline(["http://unused"], "tcp://unused", "fp", 2)
        self.pipeline.infos = [{"kv": {"slots": kv_slots, "max_seq_len": CONTEXT}}]
        self.pipeline.problem, self.pipeline.client = None, self.client
        self.scheduler = Scheduler(self.pipeline, GatewayMetrics(), max_inflight, ServingConfig(**serving),
                                   prefix_cache=prefix_cache)
        self.ids = itertools.count()

    def seq(self, prompt_len: int = 5, max_tokens: int = 8, **kw) -> Sequence:
        prompt = [(7 * i + 3) % 200 + 1 for i in range(prompt_len)]
        return Sequence(seq_id=f"s{next(self.ids)}", prompt_ids=prompt, params=SamplingParams(), max_tokens=max_tokens,
                        **kw)

    async def step(self) -> None:
        await asyncio.sleep(0)  # let done-callbacks of delivered futures run first
        await self.scheduler._step()

    async def deliver_all(self) -> None:
        while self.client.sent:
            self.client.deliver()
            await self.step()


def drain(seq: Sequence) -> list[SeqOutput]:
    out = []
    while not seq.outputs.empty():
        out.append(seq.outputs.get_nowait())
    return out


async def test_admission_is_bounded_by_kv_slots_and_the_queue(tiny_path):
    h = Harness(tiny_path, kv_slots=2, max_queue=1)
    a, b, c = h.seq(), h.seq(), h.seq()
    for s in (a, b, c):
        h.scheduler.submit(s)
    assert set(h.scheduler.running) == {a.seq_id, b.seq_id} and list(h.scheduler.waiting) == [c]
    with pytest.raises(QueueFull):
        h.scheduler.submit(h.seq())
    assert list(h.scheduler.waiting) == [c]  # the refused request left no trace
    h.scheduler.cancel(a)
    await h.step()
    assert c.seq_id in h.scheduler.running and not h.scheduler.waiting


async def test_a_burst_onto_free_slots_is_admitted_not_refused(tiny_path):
    """Requests that a free slot will take at once never count against the queue bound."""
    h = Harness(tiny_path, kv_slots=4, max_queue=4)
    burst = [h.seq() for _ in range(8)]
    for s in burst:
        h.scheduler.submit(s)  # raises QueueFull if the admissible four counted as queued
    assert len(h.scheduler.running) == 4 and len(h.scheduler.waiting) == 4


async def test_every_microbatch_keeps_the_token_budget(tiny_path):
    h = Harness(tiny_path, kv_slots=4, max_inflight=1, token_budget=24, prefill_chunk=16)
    seqs = [h.seq(prompt_len=20, max_tokens=3) for _ in range(4)]
    for s in seqs:
        h.scheduler.submit(s)
    await h.step()
    await h.deliver_all()
    sizes = [b.num_tokens for b in h.client.order]
    assert max(sizes) <= 24 and sum(sizes) == 4 * 20 + 4 * 2  # every prompt token once, then 2 decodes each
    assert all(s.finish_reason == "length" for s in seqs)


async def test_a_long_prompt_is_chunked_and_never_stalls_running_decodes(tiny_path):
    h = Harness(tiny_path, kv_slots=4, max_inflight=1, prefill_chunk=32, token_budget=512)
    decoders = [h.seq(prompt_len=4, max_tokens=100) for _ in range(2)]
    for s in decoders:
        h.scheduler.submit(s)
    await h.step()
    h.client.deliver()  # both prompts done: the two now decode
    await h.step()
    long = h.seq(prompt_len=150, max_tokens=2)
    h.scheduler.submit(long)
    while long.prefilling:
        await h.step()
        h.client.deliver()
        await asyncio.sleep(0)
    with_long = [b for b in h.client.order if any(e.seq_id == long.seq_id for e in b.seqs)]
    assert len(with_long) == math.ceil(150 / 32)  # five chunks
    for b in with_long:
        kinds = {e.seq_id: type(e.step).__name__ for e in b.seqs}
        assert kinds[long.seq_id] == "Prefill" and b.num_tokens <= 32 + len(decoders)
        assert all(kinds.get(d.seq_id) == "Decode" for d in decoders)  # every decode rides along each chunk


async def test_deadline_ends_waiting_and_running_requests_and_frees_slots(tiny_path):
    h = Harness(tiny_path, kv_slots=1)
    running, waiting = h.seq(max_tokens=50, deadline=0.0), h.seq(deadline=0.0)
    h.scheduler.submit(running)
    h.scheduler.submit(waiting)
    running.deadline = waiting.deadline = math.inf
    await h.step()
    h.client.deliver()
    await h.step()
    assert running.computed > 0
    running.deadline = waiting.deadline = 0.0  # both past due now
    await h.step()
    for s in (running, waiting):
        assert drain(s)[-1] == SeqOutput(finish_reason="timeout", error="the request exceeded its deadline")
    assert not h.scheduler.running and not h.scheduler.waiting
    await h.step()
    assert [running.seq_id] in h.client.released  # the slot it held on every stage is freed; the waiter held none
    assert not any(waiting.seq_id in r for r in h.client.released)


async def test_cancel_while_waiting_and_while_in_flight(tiny_path):
    h = Harness(tiny_path, kv_slots=1)
    flying, queued = h.seq(max_tokens=50), h.seq()
    h.scheduler.submit(flying)
    h.scheduler.submit(queued)
    h.scheduler.cancel(queued)
    assert drain(queued) == [SeqOutput(finish_reason="cancelled")] and not h.scheduler.waiting
    await h.step()
    assert flying.in_flight
    h.scheduler.cancel(flying)
    await h.step()
    assert h.client.released == [[flying.seq_id]]  # sent after the micro-batch that holds it
    h.client.deliver()  # its late result is dropped: no token after the cancel
    await h.step()
    assert drain(flying) == [SeqOutput(finish_reason="cancelled")] and flying.output_ids == []
    assert h.scheduler.metrics.registry.get_sample_value("stagemesh_gateway_requests_total", {"outcome": "cancelled"}) == 2


async def test_replay_after_a_lost_pipeline_continues_the_same_tokens(tiny_path):
    h = Harness(tiny_path, kv_slots=2, max_inflight=1)
    seq = h.seq(prompt_len=6, max_tokens=12)
    expected = list(generate_tokens(h.client.local, seq.prompt_ids, SamplingParams(), 12))
    h.scheduler.submit(seq)
    for _ in range(5):  # prefill + 4 decodes
        await h.step()
        h.client.deliver()
    await h.step()  # the sixth micro-batch is in flight when the pipeline is lost
    in_flight = next(iter(h.client.sent))
    h.pipeline.mark_lost("test: stage restarted")
    await h.step()
    assert h.client.abandoned == [in_flight]
    assert seq.replays == 1 and h.client.released[-1] == [seq.seq_id]  # survivors' slots freed before replaying
    replay = h.client.order[-1]
    assert replay.seqs[0].step.start_position == 0 and replay.num_tokens == 6 + 5  # prompt + the 5 tokens so far
    await h.deliver_all()
    assert seq.output_ids == expected and seq.finish_reason == "length"


async def test_a_stage_that_forgot_a_sequence_is_recognised_by_its_error_code(tiny_path):
    h = Harness(tiny_path)
    seq = h.seq()
    h.scheduler.submit(seq)
    await h.step()
    epoch = h.pipeline.epoch
    h.client.fail(next(iter(h.client.sent)), UnknownSequence.code, "whatever words a stage chooses")
    await asyncio.sleep(0)
    assert h.pipeline.epoch == epoch + 1 and not seq.done  # replayed, not failed
    h2 = Harness(tiny_path)
    other = h2.seq()
    h2.scheduler.submit(other)
    await h2.step()
    h2.client.fail(next(iter(h2.client.sent)), "bad_input", "sequence s0 has no KV slot")  # the old magic words
    await asyncio.sleep(0)
    assert h2.pipeline.epoch == 0 and drain(other)[-1].finish_reason == "error"


async def test_a_sequence_replayed_too_often_fails_with_a_reason(tiny_path):
    h = Harness(tiny_path)
    h.scheduler.max_replays = 1
    seq = h.seq()
    h.scheduler.submit(seq)
    for _ in range(2):
        await h.step()
        h.pipeline.mark_lost("stage 1 vanished")
    await h.step()
    assert drain(seq)[-1] == SeqOutput(finish_reason="error", error="the pipeline failed 1 times during this request; "
                                                                    "the last time: stage 1 vanished")  # the cause


def test_text_held_for_a_stop_string_reaches_the_client_when_eos_arrives(smollm2):
    """Held-back text that could begin a stop string is flushed when the sequence ends on EOS."""
    tok = smollm2.tokenizer
    seq = Sequence(seq_id="s", prompt_ids=[1], stop_ids=tok.eos_ids)
    proc = OutputProcessor(seq, tok, stop=[" Hello world"])
    events, ids = [], tok.encode("Say Hello")
    for t in ids:
        events += proc.process(SeqOutput(t))
    assert "".join(e["text"] for e in events) == "Say"  # " Hello" is held back: it may begin the stop string
    final = proc.process(SeqOutput(tok.eos_id, finish_reason="stop"))
    assert [e["type"] for e in final] == ["token", "done"] and final[0]["text"] == " Hello"
    assert final[1]["finish_reason"] == "stop" and final[1]["usage"]["completion_tokens"] == len(ids) + 1


def test_a_completed_stop_string_is_never_shown_and_ends_as_stop(smollm2):
    tok = smollm2.tokenizer
    seq = Sequence(seq_id="s", prompt_ids=[1])
    proc = OutputProcessor(seq, tok, stop=[" world"])
    shown = []
    for t in tok.encode("Hello world and more"):
        shown += proc.process(SeqOutput(t))
        if proc.stop_string_hit:
            break
    shown += proc.process(SeqOutput(finish_reason="stop"))
    assert "".join(e["text"] for e in shown if e["type"] == "token") == "Hello"
    assert shown[-1]["type"] == "done" and shown[-1]["finish_reason"] == "stop"


@pytest.mark.processes
async def test_queue_full_is_429_with_retry_after_through_the_real_gateway(tmp_path):
    from services.launch import start_up

    gw = start_up(1, "bfloat16", str(tmp_path), "--kv-slots", "1", "--max-queue", "1")
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        async with aiohttp.ClientSession() as s:
            async def post():
                async with s.post(gw.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            results = await asyncio.gather(*(post() for _ in range(3)))
        statuses = sorted(r[0] for r in results)
        assert statuses == [200, 200, 429], results
        refused = next(r for r in results if r[0] == 429)
        assert refused[1] == "1" and refused[2]["error"]["code"] == "queue_full"
    finally:
        gw.stop()
