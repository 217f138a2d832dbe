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
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Pipeline
from shared.config import SERVING_DEFAULTS, ServingConfig
from shared.errors import UnknownSequence
from shared.generation import SequenceState
from shared.pipeline_client import PipelineError
from shared.protocol import BatchResult, ForwardBatch

log = logging.getLogger("stagemesh.gateway.scheduler")

IDLE_TICK_S = 0.25  # how often deadlines and pipeline health are checked when nothing else wakes the loop


class QueueFull(Exception):
    pass


@dataclass
class SeqOutput:
    """What the scheduler reports for one sequence: a sampled token, the end, or both.
    finish_reason "stop" means the token is a stop id (EOS): it ends the sequence and is never shown."""

    token: int | None = None
    logprob: float | None = None
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
    replays: int = 0
    captures: list[dict] = field(default_factory=list)  # trace captures (wire form), when traced
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.feeding > 0

    def reset_for_replay(self) -> None:
        super().reset_for_replay()
        self.feeding = 0
        self.replays += 1


class Scheduler:
    def __init__(self, pipeline: Pipeline, metrics: GatewayMetrics, max_inflight: int,
                 config: ServingConfig = SERVING_DEFAULTS, max_running: int | None = None,
                 failover_timeout_s: float = 120.0, max_replays: int = 3):
        self.pipeline = pipeline
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.config = config
        self.max_running_override = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.inflight: dict[int, list[Sequence]] = {}
        self.max_inflight_seen = 0
        self._release: list[str] = []
        self._wake = asyncio.Event()
        self.failover_timeout_s = failover_timeout_s
        self.max_replays = max_replays
        self._generation = pipeline.generation
        self._lost_since: float | None = None
        self._replay_pending = False

    @property
    def max_running(self) -> int:
        return self.max_running_override or self.pipeline.kv_slots

    # ---- requests in and out ----------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Admit now if a slot is free, else queue; QueueFull when the queue is at its bound."""
        self.waiting.append(seq)
        self._admit()
        if len(self.waiting) > self.config.max_queue:
            self.waiting.pop()
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry shortly")
        self._update_gauges()
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Client went away or asked to stop: free its KV slots on every stage now. No-op once finished."""
        self.finish(seq, "cancelled")

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence outside the token flow (cancel, a stop string, deadline, failure) and report it."""
        if seq.done:
            return
        self._retire(seq, reason)
        seq.outputs.put_nowait(SeqOutput(finish_reason=reason, error=error))

    def _retire(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(time.perf_counter() - seq.t_arrival)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.running.pop(seq.seq_id, None) is not None and seq.computed + seq.feeding > 0:
            self._release.append(seq.seq_id)  # ordered after any micro-batch of it already sent
        self.metrics.requests.labels(reason).inc()
        self._update_gauges()
        self._wake.set()

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
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=IDLE_TICK_S)
            except asyncio.TimeoutError:
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
        self.metrics.failovers.inc()
        for seq in list(self.running.values()):
            if seq.replays >= self.max_replays:
                self.finish(seq, "error", f"the pipeline failed {seq.replays} times during this request")
            else:
                seq.reset_for_replay()
                self.metrics.replayed.inc()
        self._replay_pending = True  # release what surviving stages still hold before replaying
        log.warning("pipeline lost (%s): %d sequences will be replayed", self.pipeline.problem or "a stage restarted",
                    len(self.running))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.t_admitted = time.perf_counter()
            self.running[seq.seq_id] = seq
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    async def _step(self) -> None:
        now = time.perf_counter()
        for seq in [*self.waiting, *self.running.values()]:
            if now > seq.deadline:
                self.finish(seq, "timeout", "the request exceeded its deadline")
        if self.pipeline.generation != self._generation:
            self._generation = self.pipeline.generation
            self._pipeline_lost()
        client = self.pipeline.client
        if not self.pipeline.ready or client is None:
            self._lost_since = self._lost_since or now
            if now - self._lost_since > self.failover_timeout_s:
                for seq in [*self.running.values(), *self.waiting]:
                    self.finish(seq, "error", f"the pipeline is unavailable: {self.pipeline.problem}")
            return
        self._lost_since = None
        if self._replay_pending:
            self._replay_pending = False
            self._release.extend(self.running)
        if self._release:
            ids, self._release = self._release, []
            await client.release(ids)
        self._admit()
        while len(self.inflight) < self.max_inflight:
            batch = self._build_batch()
            if batch is None:
                break
            entries, tokens, seqs = batch
            mb = client.next_mb_id()
            self.inflight[mb] = seqs
            self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))
            traced = next((s.seq_id for s in seqs if s.trace), None)
            fut = await client.submit(ForwardBatch(mb, entries, tokens=torch.tensor(tokens, dtype=torch.int64),
                                                   trace={"seq_id": traced} if traced else None))
            fut.add_done_callback(lambda f, mb=mb: self._on_result(mb, f))
            self.metrics.microbatches.inc()
        self._update_gauges()

    def _build_batch(self):
        """The next micro-batch: at most ceil(running / K) sequences and token_budget tokens, decodes first."""
        ready = [s for s in self.running.values() if not s.in_flight and not s.done]
        if not ready:
            return None
        per_batch = max(1, math.ceil(len(self.running) / self.max_inflight))
        decodes = [s for s in ready if not s.prefilling]
        prefills = [s for s in ready if s.prefilling]
        entries, tokens, seqs, budget = [], [], [], self.config.token_budget
        for s in decodes + prefills:
            if len(seqs) >= per_batch or budget <= 0:
                break
            entry, toks = s.next_step(min(self.config.prefill_chunk, budget))
            s.feeding = len(toks)
            budget -= len(toks)
            entries.append(entry)
            tokens.extend(toks)
            seqs.append(s)
        return (entries, tokens, seqs) if seqs else None

    def _on_result(self, mb: int, fut: asyncio.Future) -> None:
        seqs = self.inflight.pop(mb, [])
        self._wake.set()
        error = None if fut.cancelled() else fut.exception()
        result: BatchResult | None = None if error or fut.cancelled() else fut.result()
        if isinstance(error, PipelineError) and error.code == UnknownSequence.code:
            # a stage lost our sequences (it restarted between health polls): replay them
            self.pipeline.mark_lost(str(error))
            return
        sampled = dict(zip(result.seq_ids, zip(result.tokens, result.logprobs))) if result else {}
        if result is not None and result.hop_s is not None:
            self.metrics.result_hop.observe(max(0.0, result.hop_s))
        now = time.perf_counter()
        for s in seqs:
            fed, s.feeding = s.feeding, 0
            if s.done:
                continue
            if error is not None:
                msg = str(error) if isinstance(error, PipelineError) else f"pipeline failure: {error}"
                self.finish(s, "error", msg)
                continue
            s.advance(fed)
            if s.trace and result is not None:
                s.captures.extend(result.captures)
            if s.seq_id in sampled:
                self._accept_token(s, *sampled[s.seq_id], now)
        self._update_gauges()

    def _accept_token(self, s: Sequence, token: int, logprob: float | None, now: float) -> None:
        if s.t_first is None:
            s.t_first = now
            self.metrics.ttft.observe(now - s.t_arrival)
        else:
            self.metrics.itl.observe(now - s.t_last)
        s.t_last = now
        self.metrics.generated_tokens.inc()
        reason = s.append(token, logprob)
        s.outputs.put_nowait(SeqOutput(token, logprob, reason))
        if reason is not None:
            self._retire(s, reason)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self.waiting))
        m.running.set(len(self.running))
        m.inflight.set(len(self.inflight))
        m.inflight_max.set(self.max_inflight_seen)
