"""Continuous batching over a pipeline, with up to K micro-batches in flight.

One invariant instead of two modes (vLLM's): every sequence has `computed` tokens whose KV lives in the pipeline
and `all_ids = prompt + output` tokens it wants computed. Each step feeds the next slice: a prefill chunk while
computed < len(prompt), else the one newest token (a decode). A sequence sits in at most one micro-batch in
flight (its next input is the token that micro-batch will sample). Sequences are spread across K micro-batches so
every stage has work while the others compute."""

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
from shared.pipeline_client import PipelineError
from shared.protocol import BatchResult, ForwardBatch, SeqEntry
from shared.sampling import SamplingParams
from shared.steps import Decode, Prefill
from shared.streaming import TextStream
from shared.trace import HookCapture

log = logging.getLogger("stagemesh.gateway.scheduler")


class QueueFull(Exception):
    pass


@dataclass(eq=False)  # a request is itself, never equal to another with the same tokens
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stream: TextStream
    stop_ids: frozenset[int]
    deadline: float
    seq_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    computed: int = 0
    feeding: int = 0  # tokens in the micro-batch now in flight (0: not in flight)
    prefill_target: int = 0  # tokens to prefill before decoding: the prompt, or prompt + output when replaying
    replays: int = 0
    finish_reason: str | None = None
    trace: bool = False
    captures: list[dict] = field(default_factory=list)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_flight(self) -> bool:
        return self.feeding > 0

    def __post_init__(self):
        self.prefill_target = self.prefill_target or len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_work(self, chunk: int) -> tuple[SeqEntry, list[int]]:
        target = self.prefill_target
        if self.computed < target:
            n = min(chunk, target - self.computed)
            step = Prefill(n, self.computed, target, self.computed + n == target)
            return SeqEntry(self.seq_id, step, self.params), self.all_ids[self.computed:self.computed + n]
        return SeqEntry(self.seq_id, Decode(self.computed), self.params), [self.output_ids[-1]]

    def reset_for_replay(self) -> None:
        """The pipeline lost this sequence's KV: prefill everything it has (prompt + output so far) again; the
        final chunk samples the next token at the same position a decode would have (same seed, same draw)."""
        self.computed, self.feeding = 0, 0
        self.prefill_target = len(self.all_ids)
        self.replays += 1

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                "total_tokens": len(self.prompt_ids) + len(self.output_ids)}

    def timings(self) -> dict:
        ms = lambda a, b: round((b - a) * 1000, 2) if a is not None and b is not None else None  # noqa: E731
        n = len(self.output_ids)
        per_token = ms(self.t_first, self.t_last) / (n - 1) if n > 1 and self.t_last else None
        return {"queued_ms": ms(self.t_arrival, self.t_admitted), "ttft_ms": ms(self.t_arrival, self.t_first),
                "per_token_ms": per_token and round(per_token, 2), "total_ms": ms(self.t_arrival, self.t_last)}


class Scheduler:
    def __init__(self, pipeline: Pipeline, metrics: GatewayMetrics, max_inflight: int, max_queue: int = 256,
                 token_budget: int = 512, prefill_chunk: int = 128, max_running: int | None = None,
                 failover_timeout_s: float = 120.0, max_replays: int = 3):
        self.pipeline = pipeline
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.token_budget = token_budget
        self.prefill_chunk = prefill_chunk
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
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry shortly")
        self.waiting.append(seq)
        self._update_gauges()
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Client went away or asked to stop: free its KV slots on every stage now."""
        if seq.done:
            return
        self._finish(seq, "cancelled")
        self._wake.set()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.done:
            return
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.running.pop(seq.seq_id, None) is not None and seq.computed + seq.feeding > 0:
            self._release.append(seq.seq_id)  # ordered after any micro-batch of it already sent
        self.metrics.requests.labels(reason).inc()
        if error is not None:
            seq.events.put_nowait({"type": "error", "code": reason, "message": error})
        else:
            tail = seq.stream.finish() if reason != "stop" else ""
            if tail:
                seq.events.put_nowait({"type": "token", "text": tail, "token_id": None, "index": len(seq.output_ids) - 1,
                                       "logprob": None})
            done = {"type": "done", "finish_reason": reason, "usage": seq.usage(), "timings": seq.timings()}
            if seq.trace:
                done["trace"] = {"prompt_ids": seq.prompt_ids, "tokens": seq.output_ids,
                                 "captures": [HookCapture.from_wire(c).to_json() for c in seq.captures]}
            seq.events.put_nowait(done)
        self._update_gauges()

    # ---- the loop -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._step()
            except Exception:
                log.exception("scheduler step failed")

    def _pipeline_lost(self) -> None:
        """A stage died or restarted: every sequence's KV may be gone. Abandon what is in flight and replay."""
        client = self.pipeline.client
        for mb in list(self.inflight):
            if client is not None:
                client.abandon(mb)
        self.inflight.clear()
        for seq in list(self.running.values()):
            if seq.replays >= self.max_replays:
                self._finish(seq, "error", f"the pipeline failed {seq.replays} times during this request")
            else:
                seq.reset_for_replay()
        self._replay_pending = True  # release what surviving stages still hold before replaying
        log.warning("pipeline lost (%s): %d sequences will be replayed", self.pipeline.problem or "a stage restarted",
                    len(self.running))

    async def _step(self) -> None:
        now = time.perf_counter()
        for seq in [*self.waiting, *self.running.values()]:
            if now > seq.deadline:
                self._finish(seq, "timeout", "the request exceeded its deadline")
        if self.pipeline.generation != self._generation:
            self._generation = self.pipeline.generation
            self._pipeline_lost()
        client = self.pipeline.client
        if not self.pipeline.ready or client is None:
            self._lost_since = self._lost_since or now
            if now - self._lost_since > self.failover_timeout_s:
                for seq in [*self.running.values(), *self.waiting]:
                    self._finish(seq, "error", f"the pipeline is unavailable: {self.pipeline.problem}")
            return
        self._lost_since = None
        if self._replay_pending:
            self._replay_pending = False
            self._release.extend(self.running)
        if self._release:
            ids, self._release = self._release, []
            await client.release(ids)
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.t_admitted = time.perf_counter()
            self.running[seq.seq_id] = seq
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
        ready = [s for s in self.running.values() if not s.in_flight and not s.done]
        if not ready:
            return None
        per_batch = max(1, math.ceil(len(self.running) / self.max_inflight))
        decodes = [s for s in ready if s.computed >= s.prefill_target]
        prefills = [s for s in ready if s.computed < s.prefill_target]
        entries, tokens, seqs, budget = [], [], [], self.token_budget
        for s in decodes + prefills:  # running decodes first: a long prompt waits at most one chunk
            if len(seqs) >= per_batch or budget <= 0:
                break
            entry, toks = s.next_work(min(self.prefill_chunk, budget))
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
        sampled = dict(zip(result.seq_ids, zip(result.tokens, result.logprobs))) if result else {}
        now = time.perf_counter()
        if isinstance(error, PipelineError) and "has no KV slot" in str(error):
            self.pipeline.generation += 1  # a stage lost our sequences (restarted between health polls): replay
            return
        for s in seqs:
            fed, s.feeding = s.feeding, 0
            if s.done:
                continue
            if error is not None:
                msg = str(error) if isinstance(error, PipelineError) else f"pipeline failure: {error}"
                self._finish(s, "error", msg)
                continue
            s.computed += fed
            if s.trace and result is not None:
                s.captures.extend(result.captures)
            if s.seq_id in sampled:
                token, logprob = sampled[s.seq_id]
                self._accept_token(s, token, logprob, now)
        self._update_gauges()

    def _accept_token(self, s: Sequence, token: int, logprob: float | None, now: float) -> None:
        s.output_ids.append(token)
        s.logprobs.append(logprob)
        if s.t_first is None:
            s.t_first = now
            self.metrics.ttft.observe(now - s.t_arrival)
        else:
            self.metrics.itl.observe(now - s.t_last)
        s.t_last = now
        self.metrics.generated_tokens.inc()
        if token in s.stop_ids:
            self._finish(s, "stop")
            return
        step = s.stream.push(token)
        s.events.put_nowait({"type": "token", "text": step.text, "token_id": token, "index": len(s.output_ids) - 1,
                             "logprob": logprob})
        if step.stopped:
            self._finish(s, "stop")
        elif len(s.output_ids) >= s.max_tokens:
            self._finish(s, "length")

    def shutdown(self) -> None:
        """The gateway is stopping: end every open request so its handler returns."""
        for seq in [*self.running.values(), *self.waiting]:
            self._finish(seq, "error", "the gateway is shutting down")

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self.waiting))
        m.running.set(len(self.running))
        m.inflight.set(len(self.inflight))
        m.inflight_max.set(self.max_inflight_seen)
