"""Continuous batching over a pipeline, with up to K micro-batches in flight.

The scheduler only decides what runs and reports, per sequence, what happened: each sampled token with its
logprob, and why the sequence finished (SeqOutput). Turning that into text -- detokenizing, stop strings, the
events a client sees -- is the output processor's job (services/gateway/output.py), as in vLLM v1.

Each sequence is a SequenceState (shared/generation.py): `computed` tokens of prompt + output have KV in the
pipeline, and its next step is a prefill chunk or one decode. A sequence sits in at most one micro-batch in flight
(its next input is the token that micro-batch will sample). Running sequences are spread across K micro-batches so
every stage has work while the others compute; decodes go first, so a long prompt delays them by at most one chunk."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Pipeline
from services.gateway.prefix_cache import AUDIT_TOP, PrefixAudit, PrefixIndex
from shared.config import SERVING_DEFAULTS, ServingConfig
from shared.errors import KVCacheFull, PrefixMiss, UnknownSequence
from shared.generation import SequenceState
from shared.log_throttle import throttled
from shared.otlp import OtlpTracer
from shared.pipeline_client import PipelineError
from shared.protocol import BatchResult, ForwardBatch
from shared.sampling import SamplingParams, TopLogprobs

log = logging.getLogger("stagemesh.gateway.scheduler")

IDLE_TICK_S = 0.25  # how often deadlines and pipeline health are checked when nothing else wakes the loop
KV_FULL_BACKOFF_S = 1.0  # after a stage answered kv_full, admission holds at what fits for this long
AUDIT_DEADLINE_S = 600.0  # an audit twin still queued after this long is dropped (counted as skipped)
AUDIT_TOLERANCE_F32 = 1e-3  # logprob differences a recompute may show on float32 stages (other chunking, rounding)
AUDIT_TOLERANCE_BF16 = 0.1  # ... on bfloat16 ones


class QueueFull(Exception):
    pass


@dataclass
class SeqOutput:
    """What the scheduler reports for one sequence: a sampled token, the end, or both.
    finish_reason "stop" means the token is a stop id (EOS): it ends the sequence and is never shown."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None  # (token id, logprob) alternatives, most likely first, when asked
    finish_reason: str | None = None  # stop | length | cancelled | timeout | error
    error: str | None = None


def new_seq_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(eq=False)
class Sequence(SequenceState):
    """A request's sequence as the scheduler tracks it."""

    deadline: float = math.inf  # perf_counter time after which the request fails with "timeout"
    trace: bool = False
    outputs: asyncio.Queue[SeqOutput] = field(default_factory=asyncio.Queue)
    feeding: int = 0  # tokens in the micro-batch now in flight (0: not in flight)
    starting: bool = False  # ... and that micro-batch holds its first chunk (it allocates the slot on every stage)
    cached_tokens: int = 0  # prompt tokens a cached prefix supplied (usage.prompt_tokens_details.cached_tokens)
    audit: PrefixAudit | None = None  # set on the gateway's own twins that check a cache hit (no client reads them)
    no_cache: bool = False  # admitted without a prefix-cache lookup (the audit's recomputing twin)
    sent: bool = False  # a micro-batch of it was sent since its last release: stages may hold a slot for it
    replays: int = 0  # replays started: counted when its first replay micro-batch is sent
    replay_due: bool = False  # reset for replay, that micro-batch not sent yet
    captures: list[dict] = field(default_factory=list)  # trace captures (wire form), when traced
    trace_budget: int = 0  # activation bytes its trace may collect (GatewayConfig.trace_budget)
    trace_bytes: int = 0  # ... collected so far: once at the budget, its micro-batches ask for no more captures
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    otlp_span: Any = None  # its stagemesh.request span (distributed tracing on; shared.otlp)
    traceparent: str | None = None  # that span's W3C traceparent, carried on each of its micro-batch entries
    otlp_parented: int = 0  # stagemesh.microbatch spans this request's trace holds (the rest only link to it)
    pipeline: str = ""  # the replica running it (services/gateway/replicas.py; "" before routing)
    handoffs: int = 0  # times it moved to another replica because its own lost a stage

    @property
    def in_flight(self) -> bool:
        return self.feeding > 0

    @property
    def tracing(self) -> bool:
        """Its next micro-batch asks the stages for captures: traced, and under its capture budget."""
        return self.trace and self.trace_bytes < self.trace_budget

    def take_captures(self, captures: list[dict]) -> None:
        """Keep the captures of its own rows (the stages captured only them), counted against its budget."""
        self.captures.extend(captures)
        self.trace_bytes += sum(len(c.get("data") or b"") + 256 for c in captures)  # 256: the summary and names

    def reset_for_replay(self) -> None:
        """Prefill the history again. Every loss noticed before the replay is sent (a stage's death, then its restart
        under a new incarnation) is one replay: `replays` counts in Scheduler._build_batch."""
        super().reset_for_replay()
        self.feeding = 0
        self.replay_due = True


class Scheduler:
    def __init__(self, pipeline: Pipeline, metrics: GatewayMetrics, max_inflight: int,
                 config: ServingConfig = SERVING_DEFAULTS,
                 failover_timeout_s: float = 120.0, max_replays: int = 3, otlp: OtlpTracer | None = None,
                 prefix_cache: bool = True, prefix_audit: float = 0.0):
        self.pipeline = pipeline
        self.otlp = otlp  # distributed tracing (None: off)
        self._mb_spans: dict[int, Any] = {}  # micro-batch id -> its stagemesh.microbatch span, while in flight
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.inflight: dict[int, list[Sequence]] = {}
        self._sent_at: dict[int, float] = {}  # micro-batch in flight -> perf_counter time sent, oldest first
        self._traced: dict[int, Sequence] = {}  # micro-batch in flight -> the one sequence whose rows it captures
        self.max_inflight_seen = 0
        self._release: list[str] = []
        self._keep: list[str] = []  # finished sequences to keep on every stage, as cached prefixes
        self.prefix = PrefixIndex() if prefix_cache else None  # services/gateway/prefix_cache.py (None: off)
        self.prefix_audit = prefix_audit  # share of cache hits checked against a recompute (PrefixAudit)
        self._audit_draw = random.Random(0).random
        self._wake = asyncio.Event()
        self.failover_timeout_s = failover_timeout_s
        self.max_replays = max_replays
        self._epoch = pipeline.epoch
        self._lost_since: float | None = None
        self._replay_pending = False
        self._kv_cap: int | None = None  # after a kv_full: admit no more than this many running sequences ...
        self._kv_cap_until = 0.0  # ... until this perf_counter time (or until one of them finishes)
        # set by Replicas: while the pipeline is not ready, give these open sequences to a ready replica; returns the
        # ones it took (None, or none taken: they wait here for this pipeline, as with a single one)
        self.handoff: Callable[[list[Sequence]], list[Sequence]] | None = None
        pipeline.on_unexpected_result = metrics.unexpected_results.inc

    @property
    def max_running(self) -> int:
        return self.pipeline.kv_slots

    # ---- requests in and out ----------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Admit now if a slot is free, else queue; QueueFull when the queue is at its bound."""
        self.waiting.append(seq)
        self._admit()
        if len(self.waiting) > self.config.max_queue:
            self.waiting.pop()
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry shortly")
        if self.otlp is not None:
            seq.otlp_span = self.otlp.start("stagemesh.request", attributes={
                "stagemesh.request_id": seq.seq_id, "stagemesh.prompt_tokens": len(seq.prompt_ids),
                "stagemesh.max_tokens": seq.max_tokens, "stagemesh.pipeline": seq.pipeline})
            seq.traceparent = self.otlp.traceparent(seq.otlp_span)
        self._update_gauges()
        self._wake.set()

    def adopt(self, seq: Sequence) -> None:
        """Take over an open sequence another replica could not keep running (Replicas.take_over): it waits at the
        front of the queue, never refused (it was admitted once), and prefills its token history here."""
        self.waiting.appendleft(seq)
        self._admit()
        self._update_gauges()
        self._wake.set()

    def _hand_off(self) -> None:
        """The pipeline is not ready: hand every open sequence to another replica (self.handoff) at once, rather
        than wait for this one to recover. The stages here that survived still hold slots of the sent ones: those
        are released when the pipeline is ready again."""
        seqs = [*self.running.values(), *self.waiting]
        if not seqs or self.handoff is None:
            return
        for seq in seqs:
            if seq.computed or seq.in_flight:  # _pipeline_lost reset the running ones; this is only a guard
                seq.reset_for_replay()
        for seq in self.handoff(seqs):
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.running.pop(seq.seq_id, None)
            if seq.sent:
                self._release.append(seq.seq_id)
                seq.sent = False
        self._update_gauges()

    def cancel(self, seq: Sequence) -> None:
        """Client went away or asked to stop: free its KV slots on every stage now. No-op once finished."""
        self.finish(seq, "cancelled")

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence outside the token flow (cancel, a stop string, deadline, failure) and report it."""
        if seq.done:
            return
        self._retire(seq, reason, error)
        seq.outputs.put_nowait(SeqOutput(finish_reason=reason, error=error))

    def _retire(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason = reason
        if seq.otlp_span is not None:
            self._end_request_span(seq, reason, error)
        if reason in ("stop", "length") and seq.audit is None:
            self.metrics.e2e.observe(time.perf_counter() - seq.t_arrival)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.running.pop(seq.seq_id, None)
        if seq.sent:  # even at computed 0 (reset for a replay): surviving stages still hold its slot
            if self._keeps(seq, reason):
                self._keep.append(seq.seq_id)  # ordered after any micro-batch of it already sent, as a release is
            else:
                self._release.append(seq.seq_id)
            seq.sent = False
        if seq.audit is not None:
            self._audit_answered(seq, reason)
        else:
            self.metrics.requests.labels(reason).inc()
        self._update_gauges()
        self._wake.set()

    def _start_audit(self, seq: Sequence, prefix_tokens: int) -> None:
        """Queue the twins that check this hit (PrefixAudit): they wait behind the requests already queued."""
        audit = PrefixAudit(seq.seq_id, prefix_tokens, self._audit_tolerance())
        params = SamplingParams(logprobs=True, top_logprobs=AUDIT_TOP)
        for role in ("cached", "full"):
            twin = Sequence(seq_id=new_seq_id(), prompt_ids=list(seq.prompt_ids), params=params, max_tokens=1,
                            deadline=time.perf_counter() + AUDIT_DEADLINE_S, audit=audit, no_cache=role == "full")
            setattr(audit, f"{role}_id", twin.seq_id)
            self.waiting.append(twin)

    def _audit_tolerance(self) -> float:
        """How far a recompute may move the logprobs: not at all on batch-invariant stages, float32's rounding on
        float32 ones, bfloat16's otherwise."""
        infos = [i for i in self.pipeline.infos if isinstance(i, dict)]
        if infos and all((i.get("weights") or {}).get("batch_invariant") for i in infos):
            return 0.0
        return AUDIT_TOLERANCE_BF16 if any(i.get("dtype") in ("bfloat16", "float16") for i in infos) \
            else AUDIT_TOLERANCE_F32

    def _audit_answered(self, twin: Sequence, reason: str) -> None:
        audit = twin.audit
        top = twin.top_logprobs[0] if reason == "length" and twin.top_logprobs else None
        audit.results[twin.seq_id] = (twin.cached_tokens, top)
        if len(audit.results) < 2 or self.prefix is None:
            return
        verdict = audit.compare()
        if verdict is None:
            self.prefix.stats.audit_skipped += 1
            return
        agree, _, how = verdict
        self.prefix.stats.audits += 1
        if not agree:
            self.prefix.stats.audit_mismatches += 1
            log.warning("prefix cache audit of request %s: a cached prefix and a recompute disagree: %s",
                        audit.request_id, how)

    def _keeps(self, seq: Sequence, reason: str) -> bool:
        """Index a finished sequence as a cached prefix (True: keep its slots), releasing the prefixes it contains.
        Its first `computed` tokens have K/V on every stage (a micro-batch still in flight writes only later
        positions). Not after a failure, nor for a traced request (its rows carry capture hooks' numbers)."""
        if self.prefix is None or reason not in ("stop", "length", "cancelled") or seq.trace or seq.attach or seq.audit:
            return False
        kept, contained = self.prefix.insert(seq.seq_id, seq.all_ids[:seq.computed], self._pinned())
        self._release.extend(contained)
        return kept

    def _pinned(self) -> set[str]:
        """Prefixes an admitted sequence will attach with its first chunk, not sent yet: not to be released."""
        return {s.attach for s in self.running.values() if s.attach is not None}

    def shutdown(self, message: str = "the gateway is shutting down") -> int:
        """The gateway is stopping: end every open request so its handler returns (with `message` as its error
        event). Returns how many were ended."""
        open_ = [*self.running.values(), *self.waiting]
        for seq in open_:
            self.finish(seq, "error", message)
        return len(open_)

    @property
    def replaying(self) -> int:
        """Running sequences still re-prefilling their history after a failover."""
        return sum(1 for s in self.running.values() if s.replays and s.prefilling)

    @property
    def idle(self) -> bool:
        """No request is running or waiting."""
        return not self.running and not self.waiting

    # ---- the loop -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:  # asyncio.timeout, not wait_for: no task per wake-up on the per-token path
                async with asyncio.timeout(IDLE_TICK_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._step()
            except Exception:
                log.exception("scheduler step failed")

    def _pipeline_lost(self) -> None:
        """A stage died, restarted or forgot a sequence: every sequence's KV may be gone. Abandon what is in
        flight and replay each running sequence from its token history."""
        client = self.pipeline.client
        for mb in list(self.inflight):
            if client is not None:
                client.abandon(mb)
        self.inflight.clear()
        self._sent_at.clear()
        self._traced.clear()
        self.metrics.failovers.inc()
        for seq in list(self.running.values()):
            if seq.replays >= self.max_replays:
                self.finish(seq, "error", f"the pipeline failed {seq.replays} times during this request; the last "
                                          f"time: {self.pipeline.problem or self.pipeline.lost_reason}")
            else:
                seq.reset_for_replay()
        if self.prefix is not None:  # a replaced stage keeps nothing: forget every prefix, release it where it is left
            self._release.extend(self.prefix.reset(""))
            for seq in self.running.values():
                seq.attach = None
        self._replay_pending = True  # release what surviving stages still hold before replaying
        log.warning("%s lost (%s): %d sequences will be replayed", self.pipeline.label, self.pipeline.lost_reason,
                    len(self.running))

    def _admit(self) -> None:
        limit = self.max_running
        if self._kv_cap is not None:
            if time.perf_counter() < self._kv_cap_until:
                limit = min(limit, self._kv_cap)
            else:
                self._kv_cap = None  # probe again: leased or foreign slots may have been freed
        while self.waiting and len(self.running) < limit:
            seq, hit = self.waiting[0], None
            if self.prefix is not None:
                if seq.computed == 0 and not seq.trace and not seq.replays and not seq.no_cache:
                    hit = self.prefix.lookup(seq.all_ids)
                if len(self.running) + len(self.prefix) >= self.pipeline.kv_slots:
                    # a cached prefix gives its slots up for the request -- never the one it is about to attach
                    victim = self.prefix.evict(self._pinned() | ({hit.prefix.seq_id} if hit else set()))
                    if victim is None:
                        break
                    self._release.append(victim)
                self.prefix.count(hit)
                if hit is not None:
                    seq.start_from(hit.prefix.seq_id, hit.tokens)
                    if seq.audit is None and self.prefix_audit and self._audit_draw() < self.prefix_audit:
                        self._start_audit(seq, hit.tokens)
                seq.cached_tokens = hit.tokens if hit else 0
            self.waiting.popleft()
            self.running[seq.seq_id] = seq
            if seq.t_admitted is None:  # not a re-admission after a kv_full
                seq.t_admitted = time.perf_counter()
                if seq.audit is None:
                    self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def _prefix_miss(self, seqs: list[Sequence], error: PipelineError) -> None:
        """A stage no longer keeps a prefix this micro-batch attached (it gave it up for room, or restarted): forget
        the prefixes these sequences attached, release them, and run the micro-batch's sequences as after a
        kv_full -- the started ones prefill again, looking the cache up anew."""
        for s in seqs:
            if s.starting and s.attach is not None and self.prefix is not None:
                self.prefix.discard(s.attach)
                self._release.append(s.attach)
        throttled(log, logging.WARNING, "prefix_miss", "%s", error)
        self._requeue_started(seqs)

    def _requeue_started(self, seqs: list[Sequence]) -> list[Sequence]:
        """Nothing of this failed micro-batch counts: its running sequences run the same step again (recomputing
        K/V at the same positions writes the same values); the ones it started go back to the front of the queue,
        released first (the stages before the failing one allocated them). Returns those."""
        started = []
        for s in seqs:
            s.feeding = 0
            if not s.done and s.starting:  # this micro-batch held its first chunk: it asked for a slot
                started.append(s)
            s.starting = False
        for s in reversed(started):
            del self.running[s.seq_id]
            self._release.append(s.seq_id)
            s.sent = False
            s.start_from(None, 0)
            self.waiting.appendleft(s)
        return started

    def _kv_full(self, seqs: list[Sequence]) -> None:
        """A stage had no free slot for a sequence this micro-batch started: slots the gateway does not know of are
        held there (a lease not yet expired, another gateway). Nothing of the micro-batch counts. Its running
        sequences run the same step again (recomputing K/V at the same positions writes the same values); the ones
        it started go back to the front of the queue, released first (the stages before the full one allocated
        them), and admission holds at the running sequences (which fit) for KV_FULL_BACKOFF_S or until one ends."""
        started = self._requeue_started(seqs)
        self._kv_cap = len(self.running)
        self._kv_cap_until = time.perf_counter() + KV_FULL_BACKOFF_S
        self.metrics.kv_full_requeued.inc(len(started))
        throttled(log, logging.WARNING, "kv_full", "a stage's KV slots are full (slots held by sequences this gateway "
                  "does not own?): %d new sequences wait in the queue, admission holds at %d running for %g s",
                  len(started), self._kv_cap, KV_FULL_BACKOFF_S)

    async def _step(self) -> None:
        now = time.perf_counter()
        for seq in [*self.waiting, *self.running.values()]:
            if now > seq.deadline:
                self.finish(seq, "timeout", "the request exceeded its deadline")
        if self.pipeline.epoch != self._epoch:
            self._epoch = self.pipeline.epoch
            self._pipeline_lost()
        client = self.pipeline.client
        if not self.pipeline.ready or client is None:
            self._hand_off()
            self._lost_since = self._lost_since or now
            if now - self._lost_since > self.failover_timeout_s:
                for seq in [*self.running.values(), *self.waiting]:
                    self.finish(seq, "error", f"the pipeline is unavailable: {self.pipeline.problem}")
            return
        self._lost_since = None
        if self._sent_at:  # dicts keep insertion order: the first is the oldest in flight
            mb, sent = next(iter(self._sent_at.items()))
            if now - sent > self.pipeline.stall_s:
                self.pipeline.mark_stalled(mb, now - sent)  # not ready, naming where; the next step replays
                return
        if self._replay_pending:
            self._replay_pending = False
            self._release.extend(self.running)
        if self.prefix is not None and self.prefix.identity != (identity := self.pipeline.cache_identity):
            self._release.extend(self.prefix.reset(identity))  # another pipeline (or the first): nothing it keeps
        if self._release or self._keep:
            (ids, self._release), (keep, self._keep) = (self._release, []), (self._keep, [])
            await client.release(ids, keep)
        self._admit()
        while len(self.inflight) < self.max_inflight:
            batch = self._build_batch()
            if batch is None:
                break
            entries, tokens, seqs = batch
            mb = client.next_mb_id()
            self.inflight[mb] = seqs
            self._sent_at[mb] = time.perf_counter()
            self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))
            traced = next((s for s in seqs if s.tracing), None)  # _build_batch puts at most one in
            if traced is not None:
                self._traced[mb] = traced
            batch = ForwardBatch(mb, entries, tokens=torch.tensor(tokens, dtype=torch.int64),
                                 trace={"seq_id": traced.seq_id} if traced else None)
            if self.otlp is not None:
                self._start_microbatch_span(batch, seqs)
            fut = await client.submit(batch)
            fut.add_done_callback(lambda f, mb=mb: self._on_result(mb, f))
            self.metrics.microbatches.inc()
        self._update_gauges()

    def _build_batch(self):
        """The next micro-batch: at most ceil(running / K) sequences and token_budget tokens, decodes first, and at
        most one sequence whose trace is collecting (the stages capture one sequence's rows per micro-batch; a second
        waits for the next micro-batch, so each gets every step and only its own activations)."""
        ready = [s for s in self.running.values() if not s.in_flight and not s.done]
        if not ready:
            return None
        per_batch = max(1, math.ceil(len(self.running) / self.max_inflight))
        decodes = [s for s in ready if not s.prefilling]
        prefills = [s for s in ready if s.prefilling]
        entries, tokens, seqs, budget = [], [], [], self.config.token_budget
        tracing = False
        for s in decodes + prefills:
            if len(seqs) >= per_batch or budget <= 0:
                break
            if s.tracing:
                if tracing:
                    continue
                tracing = True
            entry, toks = s.next_step(min(self.config.prefill_chunk, budget))
            s.feeding = len(toks)
            s.starting = entry.step.starts_sequence
            s.sent = True
            if s.replay_due:
                s.replay_due = False
                s.replays += 1
                self.metrics.replayed.inc()
            budget -= len(toks)
            entries.append(entry)
            tokens.extend(toks)
            seqs.append(s)
        return (entries, tokens, seqs) if seqs else None

    def _on_result(self, mb: int, fut: asyncio.Future) -> None:
        if self.otlp is not None:
            self._end_microbatch_span(mb, fut)
        seqs = self.inflight.pop(mb, [])
        self._sent_at.pop(mb, None)
        traced = self._traced.pop(mb, None)
        self._wake.set()
        error = None if fut.cancelled() else fut.exception()
        result: BatchResult | None = None if error or fut.cancelled() else fut.result()
        if isinstance(error, PipelineError) and error.code == UnknownSequence.code:
            # a stage lost our sequences: it restarted between health polls -- or a holder of the last stage's key
            # forged the answer (only the last stage's key reaches this port); either way replaying is safe
            self.metrics.unknown_sequence_failovers.inc()
            self.pipeline.mark_lost(f"{error.error.stage} answered unknown_sequence for micro-batch {mb} (it restarted "
                                    f"between health polls, or a holder of the last stage's key forged it): {error}")
            return
        if isinstance(error, PipelineError) and error.code == KVCacheFull.code:
            self._kv_full(seqs)
            return
        if isinstance(error, PipelineError) and error.code == PrefixMiss.code:
            self._prefix_miss(seqs, error)
            return
        sampled = dict(zip(result.seq_ids, zip(result.tokens, result.logprobs, result.top))) if result else {}
        if result is not None and result.hop_s is not None:
            self.metrics.result_hop.observe(max(0.0, result.hop_s))
        now = time.perf_counter()
        for s in seqs:
            fed, s.feeding, s.starting = s.feeding, 0, False
            if s.done:
                continue
            if error is not None:
                msg = str(error) if isinstance(error, PipelineError) else f"pipeline failure: {error}"
                self.finish(s, "error", msg)
                continue
            s.advance(fed)
            if s is traced and result is not None:  # the captures are its rows, never another sequence's
                s.take_captures(result.captures)
            if s.seq_id in sampled:
                self._accept_token(s, *sampled[s.seq_id], now)
        self._update_gauges()

    def _accept_token(self, s: Sequence, token: int, logprob: float | None, top: TopLogprobs | None,
                      now: float) -> None:
        if s.audit is None:  # the audit's twins are the gateway's own: not in the clients' figures
            if s.t_first is None:
                self.metrics.ttft.observe(now - s.t_arrival)
            else:
                self.metrics.itl.observe(now - s.t_last)
            self.metrics.generated_tokens.inc()
        s.t_first = s.t_first or now
        s.t_last = now
        reason = s.append(token, logprob, top)
        error = f"the output left its grammar: {s.grammar.error}" if reason == "error" and s.grammar else None
        s.outputs.put_nowait(SeqOutput(token, logprob, top, reason, error))
        if reason is not None:
            self._retire(s, reason, error)

    # ---- distributed tracing (only with an OtlpTracer) -----------------------------------------------------------

    def _end_request_span(self, seq: Sequence, reason: str, error: str | None) -> None:
        attributes = {"stagemesh.output_tokens": len(seq.output_ids), "stagemesh.finish_reason": reason,
                      "stagemesh.replays": seq.replays, "stagemesh.pipeline": seq.pipeline,
                      "stagemesh.handoffs": seq.handoffs}
        if seq.t_admitted is not None:
            attributes["stagemesh.queued_ms"] = round((seq.t_admitted - seq.t_arrival) * 1e3, 3)
        if seq.t_first is not None:
            attributes["stagemesh.ttft_ms"] = round((seq.t_first - seq.t_arrival) * 1e3, 3)
        failed = reason in ("error", "timeout")
        self.otlp.end(seq.otlp_span, attributes, error=(error or reason) if failed else None)
        seq.otlp_span = None

    def _start_microbatch_span(self, batch: ForwardBatch, seqs: list[Sequence]) -> None:
        """Open the stagemesh.microbatch span: a child of the request that has parented fewest so far, linked to
        the others. The header carries it (every stage's compute span is its child) and each sequence's own
        request span (what the stages link to)."""
        traced = [s for s in seqs if s.otlp_span is not None]
        if not traced:
            return
        parent = min(traced, key=lambda s: s.otlp_parented)
        parent.otlp_parented += 1
        span = self.otlp.start("stagemesh.microbatch", parent.otlp_span,
                               [s.otlp_span for s in traced if s is not parent],
                               {"stagemesh.microbatch.id": batch.mb_id, "stagemesh.tokens": batch.num_tokens,
                                "stagemesh.sequences": len(seqs)})
        self._mb_spans[batch.mb_id] = span
        batch.traceparent = self.otlp.traceparent(span)
        batch.seqs = [replace(e, traceparent=s.traceparent) for e, s in zip(batch.seqs, seqs)]

    def _end_microbatch_span(self, mb: int, fut: asyncio.Future) -> None:
        span = self._mb_spans.pop(mb, None)
        if span is None:
            return
        if fut.cancelled():
            self.otlp.end(span, error="abandoned: the pipeline was lost while it was in flight")
        elif fut.exception() is not None:
            self.otlp.end(span, error=str(fut.exception()))
        else:
            hop = fut.result().hop_s
            self.otlp.end(span, None if hop is None else {"stagemesh.result_hop_ms": round(max(0.0, hop) * 1e3, 3)})

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self.waiting))
        m.running.set(len(self.running))
        m.inflight.set(len(self.inflight))
        m.inflight_max.set(self.max_inflight_seen)
