"""The scheduler alone: admission, token budget, chunked prefill beside running decodes, deadlines, cancellation,
replay bookkeeping, error codes -- and the output processor it reports to.

The last section drives the pure policy (Scheduler.plan / on_result) directly: no event loop, no pipeline. The
others run the real engine loop around it (Engine); behind it, in place of ZeroMQ, a client that records each
micro-batch and, when the test says so, computes it for real on a tiny random GGUF (LocalPipeline + the last
stage's sampling) -- so the tests choose when results arrive, which a live mesh cannot do deterministically."""

from __future__ import annotations

import asyncio
import itertools
import math

import aiohttp
import pytest
import torch

from services.gateway.engine.core import Engine
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.pipeline import Pipeline
from services.gateway.engine.request import Request, RequestOutput
from services.gateway.engine.scheduler import MicroBatch, QueueFull, Scheduler
from services.gateway.frontend.output import DoneEvent, OutputProcessor, TokenEvent
from shared.batch.sampling import SamplingParams
from shared.batch.steps import Decode
from shared.config import SchedulerConfig
from shared.errors import KVCacheFull, UnknownSequence
from shared.files.gguf_loader import GgufLoader
from shared.runtime.generation import SequenceState, generate_tokens, run_local
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.pipeline_client import PipelineError
from shared.wire.protocol import BatchError, BatchResult, ForwardBatch
from tests.stage_infos import make_info

CONTEXT = 512


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
        rows = [row for i in ids for row in sampled[i]]
        fut.set_result(BatchResult(mb, ids, [t for t, _, _ in rows], [lp for _, lp, _ in rows], [],
                                   top=[top for _, _, top in rows], counts=[len(sampled[i]) for i in ids]))
        return batch

    def fail(self, mb: int, code: str, message: str) -> None:
        batch, fut = self.sent.pop(mb)
        fut.set_exception(PipelineError(BatchError(mb, "stage[0:2]", code, message, [s.seq_id for s in batch.seqs])))


class Harness:
    def __init__(self, tiny_path: str, kv_slots: int = 4, max_inflight: int = 1, prefix_cache: bool = True,
                 prefix_slots: int = 0, prefix_memory: int | None = None, on_output=None, **serving):
        """on_output: where the engine's outputs go (None: self.outputs, per request)."""
        local = LocalPipeline.load(GgufLoader(tiny_path), None, torch.float32, kv_slots=kv_slots, max_seq_len=CONTEXT,
                                   prefix_slots=prefix_slots, prefix_memory=prefix_memory)
        self.client = RecordingClient(local)
        self.pipeline = Pipeline(["http://unused"], "tcp://unused", "fp", 2)
        kv = local.pieces[0].kv  # what the stage's /info says of it
        self.pipeline.infos = [make_info(weights_mode=local.pieces[0].model.weights, kv_slots=kv_slots,
                                         kv_max_seq_len=CONTEXT, kv_prefix_slots=prefix_slots,
                                         kv_prefix_memory_bytes=kv.prefix_bytes, kv_position_bytes=kv.position_bytes)]
        self.pipeline.problem, self.pipeline.client = None, self.client
        self.outputs: dict[str, list[RequestOutput]] = {}  # what the engine reported, per request, not yet read
        self.engine = Engine(self.pipeline, GatewayMetrics(), max_inflight,
                             SchedulerConfig(prefix_cache=prefix_cache, **serving),
                             on_output=on_output or (lambda req, out: self.outputs.setdefault(req.seq_id, []).append(out)))
        self.scheduler = self.engine.scheduler
        self.ids = itertools.count()

    def seq(self, prompt_len: int = 5, max_tokens: int = 8, **kw) -> Request:
        prompt = [(7 * i + 3) % 200 + 1 for i in range(prompt_len)]
        return Request(seq_id=f"s{next(self.ids)}", prompt_ids=prompt, params=SamplingParams(), max_tokens=max_tokens,
                        **kw)

    async def step(self) -> None:
        await asyncio.sleep(0)  # let done-callbacks of delivered futures run first
        await self.engine.step()

    async def deliver_all(self) -> None:
        while self.client.sent:
            self.client.deliver()
            await self.step()


def drain(h: Harness, seq: Request) -> list[RequestOutput]:
    """What the engine reported for seq since the last drain."""
    return h.outputs.pop(seq.seq_id, [])


async def test_admission_is_bounded_by_kv_slots_and_the_queue(tiny_path):
    h = Harness(tiny_path, kv_slots=2, max_queue=1)
    a, b, c = h.seq(), h.seq(), h.seq()
    for s in (a, b, c):
        h.engine.submit(s)
    assert set(h.scheduler.running) == {a.seq_id, b.seq_id} and list(h.scheduler.waiting) == [c]
    with pytest.raises(QueueFull):
        h.engine.submit(h.seq())
    assert list(h.scheduler.waiting) == [c]  # the refused request left no trace
    h.engine.cancel(a)
    await h.step()
    assert c.seq_id in h.scheduler.running and not h.scheduler.waiting


async def test_a_burst_onto_free_slots_is_admitted_not_refused(tiny_path):
    """Requests that a free slot will take at once never count against the queue bound."""
    h = Harness(tiny_path, kv_slots=4, max_queue=4)
    burst = [h.seq() for _ in range(8)]
    for s in burst:
        h.engine.submit(s)  # raises QueueFull if the admissible four counted as queued
    assert len(h.scheduler.running) == 4 and len(h.scheduler.waiting) == 4


async def test_every_microbatch_keeps_the_token_budget(tiny_path):
    h = Harness(tiny_path, kv_slots=4, max_inflight=1, token_budget=24, prefill_chunk=16)
    seqs = [h.seq(prompt_len=20, max_tokens=3) for _ in range(4)]
    for s in seqs:
        h.engine.submit(s)
    await h.step()
    await h.deliver_all()
    sizes = [b.num_tokens for b in h.client.order]
    assert max(sizes) <= 24 and sum(sizes) == 4 * 20 + 4 * 2  # every prompt token once, then 2 decodes each
    assert all(s.finish_reason == "length" for s in seqs)


async def test_a_long_prompt_is_chunked_and_never_stalls_running_decodes(tiny_path):
    h = Harness(tiny_path, kv_slots=4, max_inflight=1, prefill_chunk=32, token_budget=512)
    decoders = [h.seq(prompt_len=4, max_tokens=100) for _ in range(2)]
    for s in decoders:
        h.engine.submit(s)
    await h.step()
    h.client.deliver()  # both prompts done: the two now decode
    await h.step()
    long = h.seq(prompt_len=150, max_tokens=2)
    h.engine.submit(long)
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
    h.engine.submit(running)
    h.engine.submit(waiting)
    running.deadline = waiting.deadline = math.inf
    await h.step()
    h.client.deliver()
    await h.step()
    assert running.computed > 0
    running.deadline = waiting.deadline = 0.0  # both past due now
    await h.step()
    for s in (running, waiting):
        assert drain(h, s)[-1] == RequestOutput(finish_reason="timeout", error="the request exceeded its deadline")
    assert not h.scheduler.running and not h.scheduler.waiting
    await h.step()
    assert [running.seq_id] in h.client.released  # the slot it held on every stage is freed; the waiter held none
    assert not any(waiting.seq_id in r for r in h.client.released)


async def test_cancel_while_waiting_and_while_in_flight(tiny_path):
    h = Harness(tiny_path, kv_slots=1)
    flying, queued = h.seq(max_tokens=50), h.seq()
    h.engine.submit(flying)
    h.engine.submit(queued)
    h.engine.cancel(queued)
    assert drain(h, queued) == [RequestOutput(finish_reason="cancelled")] and not h.scheduler.waiting
    await h.step()
    assert flying.in_flight
    h.engine.cancel(flying)
    await h.step()
    assert h.client.released == [[flying.seq_id]]  # sent after the micro-batch that holds it
    h.client.deliver()  # its late result is dropped: no token after the cancel
    await h.step()
    assert drain(h, flying) == [RequestOutput(finish_reason="cancelled")] and flying.output_ids == []
    assert h.engine.metrics.registry.get_sample_value("stagemesh_gateway_requests_total", {"outcome": "cancelled"}) == 2


@pytest.mark.parametrize("speculation", ["off", "auto"])
async def test_replay_after_a_lost_pipeline_continues_the_same_tokens(tiny_path, speculation):
    """auto: the tiny model repeats itself, so n-gram drafts stand and the lost micro-batch carries one."""
    h = Harness(tiny_path, kv_slots=2, max_inflight=1, speculation=speculation)
    h.scheduler.speculator.costs.observe = lambda rows, seconds: None  # the test's pace is no pass's cost: unmeasured
    seq = h.seq(prompt_len=6, max_tokens=12)
    expected = list(generate_tokens(h.client.local, seq.prompt_ids, SamplingParams(), 12))
    h.engine.submit(seq)
    for _ in range(5):  # prefill + 4 decodes
        await h.step()
        h.client.deliver()
    await h.step()  # the sixth micro-batch is in flight when the pipeline is lost
    in_flight = next(iter(h.client.sent))
    assert (h.client.sent[in_flight][0].num_tokens > 1) == (speculation == "auto")  # a decode and its draft
    so_far = len(seq.output_ids)
    assert so_far == 5 if speculation == "off" else so_far > 5  # drafts that stood: more than one token a step
    h.pipeline.mark_lost("test: stage restarted")
    await h.step()
    assert h.client.abandoned == [in_flight]
    assert seq.replays == 1 and h.client.released[-1] == [seq.seq_id]  # survivors' slots freed before replaying
    replay = h.client.order[-1]
    # prompt + the tokens so far (a draft in flight is forgotten: the replay's prefill counts every token it feeds)
    assert replay.seqs[0].step.start_position == 0 and replay.num_tokens == 6 + so_far and not seq.verifying
    await h.deliver_all()
    assert seq.output_ids == expected and seq.finish_reason == "length"


async def test_a_stage_that_forgot_a_sequence_is_recognised_by_its_error_code(tiny_path):
    h = Harness(tiny_path)
    seq = h.seq()
    h.engine.submit(seq)
    await h.step()
    epoch = h.pipeline.epoch
    h.client.fail(next(iter(h.client.sent)), UnknownSequence.code, "whatever words a stage chooses")
    await asyncio.sleep(0)
    assert h.pipeline.epoch == epoch + 1 and not seq.done  # replayed, not failed
    h2 = Harness(tiny_path)
    other = h2.seq()
    h2.engine.submit(other)
    await h2.step()
    h2.client.fail(next(iter(h2.client.sent)), "bad_input", "sequence s0 has no KV slot")  # the old magic words
    await asyncio.sleep(0)
    assert h2.pipeline.epoch == 0 and drain(h2, other)[-1].finish_reason == "error"


async def test_a_sequence_replayed_too_often_fails_with_a_reason(tiny_path):
    h = Harness(tiny_path)
    h.scheduler.max_replays = 1
    seq = h.seq()
    h.engine.submit(seq)
    for _ in range(2):
        await h.step()
        h.pipeline.mark_lost("stage 1 vanished")
    await h.step()
    assert drain(h, seq)[-1] == RequestOutput(finish_reason="error", error="the pipeline failed 1 times during this request; "
                                                                    "the last time: stage 1 vanished")  # the cause


def test_text_held_for_a_stop_string_reaches_the_client_when_eos_arrives(smollm2):
    """Held-back text that could begin a stop string is flushed when the sequence ends on EOS."""
    tok = smollm2.tokenizer
    seq = Request(seq_id="s", prompt_ids=[1], stop_ids=tok.eos_ids)
    proc = OutputProcessor(seq, tok, stop=[" Hello world"])
    events, ids = [], tok.encode("Say Hello")
    for t in ids:
        events += proc.process(RequestOutput(t))
    assert "".join(e.text for e in events) == "Say"  # " Hello" is held back: it may begin the stop string
    final = proc.process(RequestOutput(tok.eos_id, finish_reason="stop"))
    assert [e.type for e in final] == ["token", "done"] and final[0].text == " Hello"
    assert final[1].finish_reason == "stop" and final[1].usage.completion_tokens == len(ids) + 1


def test_a_completed_stop_string_is_never_shown_and_ends_as_stop(smollm2):
    tok = smollm2.tokenizer
    seq = Request(seq_id="s", prompt_ids=[1])
    proc = OutputProcessor(seq, tok, stop=[" world"])
    shown = []
    for t in tok.encode("Hello world and more"):
        shown += proc.process(RequestOutput(t))
        if proc.stop_string_hit:
            break
    shown += proc.process(RequestOutput(finish_reason="stop"))
    assert "".join(e.text for e in shown if isinstance(e, TokenEvent)) == "Hello"
    assert isinstance(shown[-1], DoneEvent) and shown[-1].finish_reason == "stop"
    assert shown[-1].to_json()["type"] == "done" and "trace" not in shown[-1].to_json()  # the websocket's JSON


@pytest.mark.processes
async def test_queue_full_is_429_with_retry_after_through_the_real_gateway(up):
    gw = up("--kv-slots", "1", "--max-queue", "1", dtype="bfloat16")
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


# ---- the policy alone: plan() and on_result() driven directly, no event loop, no pipeline, no sockets ------------

def policy(kv_slots: int = 4, max_inflight: int = 1, prefix_cache: bool = False, **serving) -> Scheduler:
    return Scheduler(max_inflight, SchedulerConfig(prefix_cache=prefix_cache, **serving), kv_slots=kv_slots)


def request(name: str, prompt_len: int = 5, max_tokens: int = 8, **kw) -> Request:
    return Request(seq_id=name, prompt_ids=[(7 * i + 3) % 200 + 1 for i in range(prompt_len)],
                   params=SamplingParams(), max_tokens=max_tokens, **kw)


def sampled(batch: MicroBatch, token: int = 9) -> BatchResult:
    """What the last stage answers for `batch`: `token` for every entry whose step produces one."""
    ids = [e.seq_id for e in batch.entries if e.step.produces_token]
    return BatchResult(batch.mb_id, ids, [token] * len(ids), [None] * len(ids))


def shape(batch: MicroBatch) -> list[tuple[str, str, int]]:
    """(request, step kind, tokens fed) per entry, in batch order (as planned: before its result)."""
    return [(e.seq_id, type(e.step).__name__, r.feeding) for e, r in zip(batch.entries, batch.requests)]


def test_plan_keeps_the_token_budget_and_chunks_each_prompt():
    s = policy(token_budget=24, prefill_chunk=16)
    reqs = [request(f"r{i}", prompt_len=20) for i in range(3)]
    for r in reqs:
        assert s.submit(r, now=0.0).admitted == [r]
    (batch,) = s.schedule(now=0.0).batches
    assert shape(batch) == [("r0", "Prefill", 16), ("r1", "Prefill", 8)]  # a chunk, then what the budget leaves
    assert batch.num_tokens == 24 and not s.schedule(now=0.0).batches  # one micro-batch in flight at K=1
    update = s.on_result(batch.mb_id, sampled(batch), None, now=0.0)
    assert update.outputs == []  # neither prompt is done: no token sampled yet
    (batch,) = s.schedule(now=0.0).batches
    assert shape(batch) == [("r0", "Prefill", 4), ("r1", "Prefill", 12), ("r2", "Prefill", 8)]
    assert [e.step.is_final_chunk for e in batch.entries] == [True, True, False]


def test_plan_puts_running_decodes_before_a_new_prompt_and_spreads_them_over_k_microbatches():
    s = policy(max_inflight=2, prefill_chunk=32, token_budget=512)
    a, b = request("a", max_tokens=50), request("b", max_tokens=50)
    for r in (a, b):
        s.submit(r, now=0.0)
    first = s.schedule(now=0.0).batches
    assert [shape(m) for m in first] == [[("a", "Prefill", 5)], [("b", "Prefill", 5)]]  # ceil(2 running / K=2)
    for m in first:
        outputs = s.on_result(m.mb_id, sampled(m), None, now=0.0).outputs
        assert [(r.seq_id, o.token, o.finish_reason) for r, o in outputs] == [(m.requests[0].seq_id, 9, None)]
    long = request("long", prompt_len=100)
    s.submit(long, now=0.0)
    batches = s.schedule(now=0.0).batches  # 3 running over K=2: two per micro-batch, decodes first
    assert [shape(m) for m in batches] == [[("a", "Decode", 1), ("b", "Decode", 1)], [("long", "Prefill", 32)]]


def test_a_finished_request_frees_its_slot_for_the_next_plan():
    s = policy(kv_slots=1)
    a, b = request("a", max_tokens=1), request("b")
    s.submit(a, now=0.0)
    assert s.submit(b, now=0.0).admitted == [] and list(s.waiting) == [b]  # the one slot is a's
    (batch,) = s.schedule(now=0.0).batches
    (out,) = s.on_result(batch.mb_id, sampled(batch, token=42), None, now=0.0).outputs
    assert out == (a, RequestOutput(42, None, None, "length")) and a.output_ids == [42] and a.seq_id not in s.running
    plan = s.schedule(now=0.0)
    assert plan.release == [a.seq_id] and plan.admitted == [b]  # its slot freed on every stage, then b runs there
    assert [shape(m) for m in plan.batches] == [[("b", "Prefill", 5)]]


def test_running_requests_hold_their_kv_positions_and_the_rest_wait_for_room():
    """live_positions: a running request holds its prompt and every token it may generate; a request that would
    pass the bound waits in the queue (slots free or not) until one ends; alone, one always runs."""
    s = policy(kv_slots=8)
    s.live_positions = 300
    a, b, c = (request(n, prompt_len=100, max_tokens=50) for n in "abc")  # 150 positions each
    for r in (a, b, c):
        s.submit(r, now=0.0)
    assert set(s.running) == {"a", "b"} and list(s.waiting) == [c] and s.held_positions == 300
    s.finish(a, "stop")
    assert s.schedule(now=0.0).admitted == [c] and set(s.running) == {"b", "c"}
    big = policy(kv_slots=8)
    big.live_positions = 100
    alone = request("alone", prompt_len=90, max_tokens=50)  # past the bound, and nothing else runs
    assert big.submit(alone, now=0.0).admitted == [alone]
    assert big.submit(request("next", prompt_len=5, max_tokens=5), now=0.0).admitted == []


def test_a_submit_over_the_queue_bound_is_refused_and_leaves_no_trace():
    s = policy(kv_slots=1, max_queue=1)
    s.submit(request("a"), now=0.0)
    s.submit(queued := request("b"), now=0.0)
    update = s.submit(request("c"), now=0.0)
    assert update.refused == "1 requests are already waiting; retry shortly" and list(s.waiting) == [queued]


def test_kv_full_requeues_the_started_requests_and_holds_admission_for_the_backoff():
    s = policy(kv_slots=4)
    a = request("a", max_tokens=50)
    s.submit(a, now=0.0)
    (batch,) = s.schedule(now=0.0).batches
    s.on_result(batch.mb_id, sampled(batch), None, now=0.0)  # a runs
    b, c = request("b"), request("c")
    s.submit(b, now=0.0)
    (batch,) = s.schedule(now=0.0).batches
    assert shape(batch) == [("a", "Decode", 1), ("b", "Prefill", 5)]
    full = PipelineError(BatchError(batch.mb_id, "stage[1:2]", KVCacheFull.code, "no free slot", ["a", "b"]))
    update = s.on_result(batch.mb_id, None, full, now=10.0)
    assert update.kv_full and update.requeued == [b] and update.outputs == [] and list(s.waiting) == [b]
    assert a.output_ids == [9] and not a.in_flight  # nothing of the failed micro-batch counted: a decodes again
    s.submit(c, now=10.5)
    plan = s.schedule(now=10.5)  # within the backoff: admission holds at the one that fits
    assert b.seq_id in plan.release and list(s.running) == ["a"] and [shape(m) for m in plan.batches] == [
        [("a", "Decode", 1)]]
    assert s.on_result(plan.batches[0].mb_id, sampled(plan.batches[0]), None, now=10.6).outputs
    assert [r.seq_id for r in s.schedule(now=11.5).admitted] == ["c"]  # after it: admits again (b was admitted before)
    assert list(s.running) == ["a", "b", "c"]


def test_errors_deadlines_and_a_lost_pipeline_come_back_as_outputs_and_replays():
    s = policy(kv_slots=2)
    a, b = request("a", max_tokens=50), request("b", deadline=5.0)
    s.submit(a, now=0.0)
    s.submit(b, now=0.0)
    (batch,) = s.schedule(now=0.0).batches
    s.on_result(batch.mb_id, sampled(batch), None, now=0.0)
    assert [(r.seq_id, o.finish_reason) for r, o in s.expire(now=6.0).outputs] == [("b", "timeout")]
    (batch,) = s.schedule(now=6.0).batches
    lost = s.pipeline_lost("stage 1 vanished")
    assert lost.abandoned == [batch.mb_id] and not s.inflight and a.replay_due and a.computed == 0
    assert s.on_result(batch.mb_id, sampled(batch), None, now=6.1).outputs == []  # a late answer: dropped
    plan = s.schedule(now=7.0)
    assert plan.replays == 1 and a.replays == 1 and "a" in plan.release  # survivors' slots freed first
    assert shape(plan.batches[0]) == [("a", "Prefill", 6)]  # its prompt and its one token so far, from position 0
    broken = s.on_result(plan.batches[0].mb_id, None, RuntimeError("socket closed"), now=7.1)
    assert [(r.seq_id, o.finish_reason, o.error) for r, o in broken.outputs] == [
        ("a", "error", "pipeline failure: socket closed")]
    assert s.idle


# ---- steps of several tokens: SequenceState.take's rules, without a pipeline ------------------------------------

def _decoding(max_tokens: int = 10, stop: frozenset = frozenset()) -> SequenceState:
    s = SequenceState("d", [1, 2, 3], max_tokens=max_tokens, stop_ids=stop)
    s.take(3, [(40, None, None)])  # the prompt's one chunk, and its first token
    return s


def _row(token: int) -> tuple:
    return (token, None, None)


def test_drafts_stand_while_each_equals_what_the_position_before_it_sampled():
    s = _decoding()
    s.draft = [41, 42, 99, 44]
    entry, fed = s.next_step(512)
    assert entry.step == Decode(3, 5) and fed == [40, 41, 42, 99, 44]
    # positions 4..8 sampled 41, 42, 43 (not the drafted 99: nothing after it stands), 7, 8
    taken = s.take(len(fed), [_row(41), _row(42), _row(43), _row(7), _row(8)])
    assert [t for (t, _, _), _ in taken] == [41, 42, 43] and s.output_ids == [40, 41, 42, 43]
    assert s.computed == 6  # the K/V of 40, 41, 42 (positions 3..5); 99's position is written over next
    entry, fed = s.next_step(512)
    assert entry.step == Decode(6) and fed == [43] and s.verifying == ()


def test_a_first_draft_that_misses_keeps_one_token_and_a_stop_ends_mid_draft():
    s = _decoding()
    s.draft = [5, 6]
    _, fed = s.next_step(512)
    assert [t for (t, _, _), _ in s.take(len(fed), [_row(7), _row(6), _row(1)])] == [7] and s.computed == 4
    s = _decoding(stop=frozenset({2}))
    s.draft = [41, 2, 43]
    _, fed = s.next_step(512)
    taken = s.take(len(fed), [_row(41), _row(2), _row(43), _row(44)])
    assert [(t, reason) for (t, _, _), reason in taken] == [(41, None), (2, "stop")]


def test_drafts_never_run_past_max_tokens_nor_with_logit_inputs():
    s = _decoding(max_tokens=3)
    s.draft = [41, 42, 43, 44]
    entry, fed = s.next_step(512)
    assert entry.step == Decode(3, 2) and fed == [40, 41]  # 1 output so far, 3 at most: this step may add 2
    s = _decoding()
    s.params = SamplingParams(repetition_penalty=1.3)  # a penalty's history holds for one position only
    s.draft = [41, 42]
    entry, fed = s.next_step(512)
    assert entry.step == Decode(3) and fed == [40] and s.draft == []
