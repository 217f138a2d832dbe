"""The engine loop of one pipeline: the I/O around its Scheduler (services/gateway/engine/scheduler.py).

Each step asks the policy for a plan, sends its releases and micro-batches through the pipeline client, and hands
every result back to on_result(); what the policy returns (Update, StepPlan) is all the loop needs to deliver outputs
to the requests' streams and to feed the Prometheus metrics and the distributed-tracing spans. The loop also
watches the pipeline: a new epoch of lost KV state (replay), not ready (hand-off to another replica, or fail after
failover_timeout_s), a micro-batch stalled past the pipeline's stall_s. What the handlers call (submit, cancel,
finish) comes here too, so every change of state is delivered and counted the same way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from services.gateway.engine.audit import PrefixAuditor, audit_tolerance
from services.gateway.engine.balance import Balancer, StartSplit
from services.gateway.engine.mesh_change import MeshChange
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.pipeline import Pipeline
from services.gateway.engine.request import Request, RequestOutput, RequestSpan
from services.gateway.engine.scheduler import (
    KV_FULL_BACKOFF_S,
    MicroBatch,
    QueueFull,
    Scheduler,
    Update,
)
from services.gateway.engine.speculator import Speculator
from shared.config import SCHEDULER_DEFAULTS, SchedulerConfig
from shared.observe.log_throttle import throttled
from shared.observe.otlp import OtlpTracer
from shared.wire.protocol import BatchResult, ForwardBatch

log = logging.getLogger("stagemesh.gateway.scheduler")

IDLE_TICK_S = 0.25  # how often deadlines and pipeline health are checked when nothing else wakes the loop


class Engine:
    """One pipeline's engine loop and its Scheduler (`scheduler`, the policy: read its state there). A Replica holds
    one; run() is its task."""

    def __init__(self, pipeline: Pipeline, metrics: GatewayMetrics, max_inflight: int,
                 config: SchedulerConfig = SCHEDULER_DEFAULTS, otlp: OtlpTracer | None = None,
                 speculator: Speculator | None = None, balancer: Balancer | None = None,
                 start_split: StartSplit | None = None,
                 on_output: Callable[[Request, RequestOutput], None] | None = None,
                 handoff: Callable[[list[Request]], list[Request]] | None = None):
        """on_output: where each request's outputs go, once each, in order (the gateway's front end: Gateway.deliver;
        None: nowhere). handoff: while the pipeline is not ready, give these open requests to a ready replica, returning
        the ones it took (the gateway's Replicas.take_over; None, or none taken: they wait here for this pipeline)."""
        self.pipeline = pipeline
        self.metrics = metrics
        self.otlp = otlp  # distributed tracing (None: off)
        self.scheduler = Scheduler(max_inflight, config, kv_slots=pipeline.kv_slots, kv_rows=pipeline.kv_rows,
                                   prefix_positions=pipeline.prefix_positions,
                                   live_positions=pipeline.live_positions, speculator=speculator)
        prefix = self.scheduler.prefix
        # --prefix-cache-audit: a client of this engine, submitting its twins as any caller does (None: off)
        self.auditor = PrefixAuditor(config.prefix_cache_audit, self._submit_twin, lambda: prefix.stats) \
            if prefix is not None and config.prefix_cache_audit else None
        self.failover_timeout_s = config.failover_timeout_s
        self._mb_spans: dict[int, object] = {}  # micro-batch id -> its stagemesh.microbatch span, while in flight
        self._wake = asyncio.Event()
        self._epoch = pipeline.epoch  # the pipeline's count of KV losses this loop has replayed after
        self._lost_since: float | None = None
        self.handoff = handoff
        self.on_output: Callable[[Request, RequestOutput], None] = on_output or (lambda req, out: None)
        self._unexpected_counted = 0  # of the pipeline client's dropped results, those in metrics.unexpected_results
        # live re-splits, stage replacements, --split auto and --auto-rebalance: what changes the mesh under this loop
        self.mesh = MeshChange(pipeline, self.scheduler, metrics, self._changed, start_split, balancer)

    # ---- what the handlers call -------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Admit now if a slot is free, else queue; QueueFull when the queue is at its bound."""
        self._follow_pipeline()
        update = self.scheduler.submit(req, time.perf_counter())
        self._apply(update)
        if update.refused is not None:
            raise QueueFull(update.refused)
        if self.otlp is not None and req.audit is None:
            span = self.otlp.start("stagemesh.request", attributes={
                "stagemesh.request_id": req.seq_id, "stagemesh.prompt_tokens": len(req.prompt_ids),
                "stagemesh.max_tokens": req.max_tokens, "stagemesh.pipeline": req.pipeline})
            req.span = RequestSpan(span, self.otlp.traceparent(span))
        self._changed()

    def _submit_twin(self, twin: Request) -> bool:
        """The auditor's submit: False when the queue refused it."""
        try:
            self.submit(twin)
        except QueueFull:
            return False
        return True

    def adopt(self, req: Request) -> None:
        """Take over an open request another replica could not keep running (Replicas.take_over)."""
        self._follow_pipeline()
        self._apply(self.scheduler.adopt(req, time.perf_counter()))
        self._changed()

    def cancel(self, req: Request) -> None:
        """Client went away or asked to stop: free its KV slots on every stage now. No-op once finished."""
        self.finish(req, "cancelled")

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request outside the token flow (cancel, a stop string) and report it."""
        self._apply(self.scheduler.finish(req, reason, error))
        self._changed()

    def instance_lost(self, instance_id: str, why: str) -> int:
        """A replica of a stage died or left (services/gateway/engine/membership.py): its sequences replay on living
        instances, its micro-batches in flight are not waited for, the others run on. Returns how many replay."""
        bound = sum(1 for r in self.scheduler.running.values() if r.chain and instance_id in r.chain)
        update = self.scheduler.instance_lost(instance_id, why)
        client = self.pipeline.client
        for mb_id in update.abandoned:  # (its future cancelled: _on_result ends its span, the scheduler has let it go)
            if client is not None:
                client.abandon(mb_id)
        self._apply(update)
        log.warning("%s: instance %s lost (%s): %d sequences replay, %d micro-batches abandoned", self.pipeline.label,
                    instance_id, why, bound, len(update.abandoned))
        self._changed()
        return bound

    def shutdown(self, message: str = "the gateway is shutting down") -> int:
        """The gateway is stopping: end every open request so its handler returns (with `message` as its error
        event). Returns how many were ended."""
        update = self.scheduler.end_all("error", message)
        self._apply(update)
        self._changed()
        return len(update.outputs)

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
                await self.step()
            except Exception:
                log.exception("scheduler step failed")

    async def step(self) -> None:
        now = time.perf_counter()
        self._count_unexpected()
        self._apply(self.scheduler.expire(now))
        if self.pipeline.epoch != self._epoch:
            self._epoch = self.pipeline.epoch
            self._pipeline_lost()
        client = self.pipeline.client
        if not self.pipeline.ready or client is None:
            self._hand_off()
            self._lost_since = self._lost_since or now
            if now - self._lost_since > self.failover_timeout_s:
                self._apply(self.scheduler.end_all("error", f"the pipeline is unavailable: {self.pipeline.problem}"))
            self._update_gauges()
            return
        self._lost_since = None
        oldest = self.scheduler.oldest_in_flight()
        if oldest is not None and now - oldest.planned_at > self.pipeline.stall_s:
            self.pipeline.mark_stalled(oldest.mb_id, now - oldest.planned_at)  # not ready, naming where; replays
            return
        if self.mesh.paused:  # a re-split: nothing new goes out until the stages serve the new split
            self._update_gauges()
            return
        self.mesh.between_steps()
        self._follow_pipeline()
        plan = self.scheduler.schedule(now, self.pipeline.cache_identity)
        if plan.release or plan.keep:
            await client.release(plan.release, plan.keep)
        self._apply(plan)
        self.metrics.replayed.inc(plan.replays)
        for mb in plan.batches:
            batch = self._forward_batch(mb)
            fut = await client.submit(batch)
            fut.add_done_callback(lambda f, mb_id=mb.mb_id: self._on_result(mb_id, f))
            self.metrics.microbatches.inc()
        self._update_gauges()

    def _on_result(self, mb_id: int, fut: asyncio.Future) -> None:
        if self.otlp is not None:
            self._end_microbatch_span(mb_id, fut)
        self._wake.set()
        error = None if fut.cancelled() else fut.exception()
        result: BatchResult | None = None if error or fut.cancelled() else fut.result()
        update = self.scheduler.on_result(mb_id, result, error, time.perf_counter())
        if update.lost is not None:
            self.metrics.unknown_sequence_failovers.inc()
            self.pipeline.forgot_sequences(update.lost)
            return
        if result is not None and result.hop_s is not None:
            self.metrics.result_hop.observe(max(0.0, result.hop_s))
        self._apply(update)
        self._update_gauges()

    def _count_unexpected(self) -> None:
        """The results the pipeline's client dropped (not in flight: late after a failover, or forged) since the last
        step, into the gateway's counter: pulled here, each step, rather than pushed by the client."""
        client = self.pipeline.client
        dropped = getattr(client, "unexpected", 0)  # (a test's stand-in client counts none)
        if dropped > self._unexpected_counted:
            self.metrics.unexpected_results.inc(dropped - self._unexpected_counted)
        self._unexpected_counted = dropped

    def _follow_pipeline(self) -> None:
        """Keep the policy's view of the pipeline's /info current: its KV slots and rows, the bounds on cached
        prefixes and on running requests' K/V, and the audit's tolerance."""
        self.scheduler.kv_slots = self.pipeline.kv_slots
        self.scheduler.kv_rows = self.pipeline.kv_rows
        self.scheduler.prefix_positions = self.pipeline.prefix_positions
        self.scheduler.live_positions = self.pipeline.live_positions
        if self.auditor is not None:
            self.auditor.tolerance = audit_tolerance(self.pipeline.stages)

    def _pipeline_lost(self) -> None:
        """Every request's KV may be gone: stop waiting for what is in flight; the policy replays the rest."""
        update = self.scheduler.pipeline_lost(self.pipeline.problem or self.pipeline.lost_reason)
        client = self.pipeline.client
        for mb_id in update.abandoned:
            if client is not None:
                client.abandon(mb_id)
        self.metrics.failovers.inc()
        self._apply(update)
        log.warning("%s lost (%s): %d sequences will be replayed", self.pipeline.label, self.pipeline.lost_reason,
                    len(self.scheduler.running))

    def _hand_off(self) -> None:
        """The pipeline is not ready: hand every open request to another replica (self.handoff) at once, rather
        than wait for this one to recover."""
        if self.handoff is None:
            return
        reqs = self.scheduler.hand_off_candidates()
        if reqs:
            self.scheduler.handed_off(self.handoff(reqs))

    # ---- delivery and telemetry, from what the policy returned -------------------------------------------------

    def _apply(self, update: Update) -> None:
        m = self.metrics
        now = time.perf_counter()
        for req in update.admitted:
            req.times.admitted = now
            if req.audit is None:  # the audit's twins are the gateway's own: not in the clients' figures
                m.prompt_tokens.inc(len(req.prompt_ids))
        for req, captures in update.captures:  # before the outputs: a done event carries the trace
            req.capture.take(captures)
        if self.auditor is not None:
            for req, tokens in update.hits:
                self.auditor.on_hit(req, tokens, now)
        if update.kv_full:
            m.kv_full_requeued.inc(len(update.requeued))
            throttled(log, logging.WARNING, "kv_full", "a stage's KV slots are full (slots held by sequences this "
                      "gateway does not own?): %d new sequences wait in the queue, admission holds at %d running "
                      "for %g s", len(update.requeued), self.scheduler.kv_cap, KV_FULL_BACKOFF_S)
        if update.prefix_miss is not None:
            throttled(log, logging.WARNING, "prefix_miss", "%s", update.prefix_miss)
        for req, out in update.outputs:
            self._deliver(req, out, now)

    def _deliver(self, req: Request, out: RequestOutput, now: float) -> None:
        times = req.times
        if out.token is not None:
            if req.audit is None:
                if times.first_token is None:
                    self.metrics.ttft.observe(now - times.arrival)
                else:
                    self.metrics.itl.observe(now - times.last_token)
                self.metrics.generated_tokens.inc()
            times.first_token = times.first_token or now
            times.last_token = now
        if out.finish_reason is not None:
            self._wake.set()  # its slot is free to release, another request may be admitted
            if req.span is not None:
                self._end_request_span(req, out)
            if req.audit is None:
                if out.finish_reason in ("stop", "length"):
                    self.metrics.e2e.observe(now - times.arrival)
                self.metrics.requests.labels(out.finish_reason).inc()
        if req.audit is not None:  # the auditor's own twin
            self.auditor.on_output(req, out)
        else:
            self.on_output(req, out)

    def _changed(self) -> None:
        self._update_gauges()
        self._wake.set()

    def _update_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.queue_depth.set(len(s.waiting))
        m.running.set(len(s.running))
        m.inflight.set(len(s.inflight))
        m.inflight_max.set(s.max_inflight_seen)

    # ---- distributed tracing (only with an OtlpTracer) -----------------------------------------------------------

    def _forward_batch(self, mb: MicroBatch) -> ForwardBatch:
        # in_flight: this plan's micro-batches are all in flight once sent; one alone lets co-located stages use the
        # cores the idle ones leave (StageConfig.threads_alone)
        batch = ForwardBatch(mb.mb_id, mb.entries, tokens=torch.tensor(mb.tokens, dtype=torch.int64),
                             trace={"seq_id": mb.traced.seq_id} if mb.traced else None,
                             in_flight=len(self.scheduler.inflight), route=mb.route)
        if self.otlp is not None:
            self._start_microbatch_span(batch, mb.requests)
        return batch

    def _end_request_span(self, req: Request, out: RequestOutput) -> None:
        reason, t = out.finish_reason, req.times
        attributes = {"stagemesh.output_tokens": len(req.output_ids), "stagemesh.finish_reason": reason,
                      "stagemesh.replays": req.replays, "stagemesh.pipeline": req.pipeline,
                      "stagemesh.handoffs": req.handoffs}
        if t.admitted is not None:
            attributes["stagemesh.queued_ms"] = round((t.admitted - t.arrival) * 1e3, 3)
        if t.first_token is not None:
            attributes["stagemesh.ttft_ms"] = round((t.first_token - t.arrival) * 1e3, 3)
        failed = reason in ("error", "timeout")
        self.otlp.end(req.span.span, attributes, error=(out.error or reason) if failed else None)
        req.span = None

    def _start_microbatch_span(self, batch: ForwardBatch, reqs: list[Request]) -> None:
        """Open the stagemesh.microbatch span: a child of the request that has parented fewest so far, linked to
        the others. The header carries it (every stage's compute span is its child) and each request's own span
        (what the stages link to)."""
        traced = [r for r in reqs if r.span is not None]
        if not traced:
            return
        parent = min(traced, key=lambda r: r.span.parented)
        parent.span.parented += 1
        span = self.otlp.start("stagemesh.microbatch", parent.span.span,
                               [r.span.span for r in traced if r is not parent],
                               {"stagemesh.microbatch.id": batch.mb_id, "stagemesh.tokens": batch.num_tokens,
                                "stagemesh.sequences": len(reqs)})
        self._mb_spans[batch.mb_id] = span
        batch.traceparent = self.otlp.traceparent(span)
        batch.seqs = [replace(e, traceparent=r.span.traceparent if r.span else None) for e, r in zip(batch.seqs, reqs)]

    def _end_microbatch_span(self, mb_id: int, fut: asyncio.Future) -> None:
        span = self._mb_spans.pop(mb_id, None)
        if span is None:
            return
        if fut.cancelled():
            self.otlp.end(span, error="abandoned: the pipeline was lost while it was in flight")
        elif fut.exception() is not None:
            self.otlp.end(span, error=str(fut.exception()))
        else:
            hop = fut.result().hop_s
            self.otlp.end(span, None if hop is None else {"stagemesh.result_hop_ms": round(max(0.0, hop) * 1e3, 3)})
