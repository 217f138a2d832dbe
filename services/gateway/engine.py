"""The engine loop of one pipeline: the I/O around its Scheduler (services/gateway/scheduler.py).

Each step asks the policy for a plan, sends its releases and micro-batches through the pipeline client, and hands
every result back to on_result(); what the policy returns (Update, Plan) is all the loop needs to deliver outputs
to the requests' streams and to feed the Prometheus metrics and the distributed-tracing spans. The loop also
watches the pipeline: a new epoch of lost KV state (replay), not ready (hand-off to another replica, or fail after
failover_timeout_s), a micro-batch stalled past the pipeline's stall_s. What the handlers call (submit, cancel,
finish) comes here too, so every change of state is delivered and counted the same way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from services.gateway.audit import PrefixAuditor, audit_tolerance
from services.gateway.balance import Balancer, StartSplit, toward
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Pipeline, check_keys, check_pipeline, reachable_address
from services.gateway.request import Request, RequestOutput, RequestSpan
from services.gateway.scheduler import (
    KV_FULL_BACKOFF_S,
    MicroBatch,
    QueueFull,
    Scheduler,
    Update,
)
from services.gateway.speculation import Speculator
from shared.config import SCHEDULER_DEFAULTS, SchedulerConfig
from shared.errors import StagemeshError
from shared.files.layers import LayerRange, boundaries, check_resplit
from shared.observe.log_throttle import throttled
from shared.observe.otlp import OtlpTracer
from shared.wire.protocol import BatchResult, ForwardBatch, Resplit
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.scheduler")

IDLE_TICK_S = 0.25  # how often deadlines and pipeline health are checked when nothing else wakes the loop
RESPLIT_PHASE_S = {"prepare": 120.0, "move": 60.0, "commit": 30.0, "abort": 10.0, "reroute": 30.0}  # each phase's round trip at most
RESPLIT_HISTORY = 16  # re-splits /v1/mesh lists per pipeline
REPLACE_DRAIN_S = 5.0  # how long a replacement waits for micro-batches in flight (a dead stage's never return)
RESPLIT_WATCH_S = 0.5  # how often a re-split phase in flight checks that no stage restarted or went silent


class ResplitError(StagemeshError):
    """A re-split not done; `status` is the HTTP status that says why (400: the split asked for is not one the mesh
    can move to; 409: the pipeline is not in a state to move; 503: a stage refused or did not answer in time -- the
    mesh serves on with the split it had, or, after a commit that was not confirmed, replays from token histories)."""

    def __init__(self, message: str, status: int = 503, outcome: str = "refused"):
        super().__init__(message)
        self.status = status
        self.outcome = outcome  # a RESPLIT_OUTCOMES entry (services/gateway/metrics.py)


class Engine:
    """One pipeline's engine loop and its Scheduler (`scheduler`, the policy: read its state there). A Replica holds
    one; run() is its task."""

    def __init__(self, pipeline: Pipeline, metrics: GatewayMetrics, max_inflight: int,
                 config: SchedulerConfig = SCHEDULER_DEFAULTS, otlp: OtlpTracer | None = None,
                 speculator: Speculator | None = None, balancer: Balancer | None = None,
                 start_split: StartSplit | None = None):
        self.pipeline = pipeline
        self.start_split = start_split  # --split auto's decision at start (None: the split the stages came with)
        self._splitting: asyncio.Task | None = None  # the re-splits it runs
        self.balancer = balancer  # --auto-rebalance's policy (None: the split changes only when asked)
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
        # set by Replicas: while the pipeline is not ready, give these open requests to a ready replica; returns the
        # ones it took (None, or none taken: they wait here for this pipeline, as with a single one)
        self.handoff: Callable[[list[Request]], list[Request]] | None = None
        # where each request's outputs go, once each, in order (the gateway's front end: Gateway.deliver)
        self.on_output: Callable[[Request, RequestOutput], None] = lambda req, out: None
        pipeline.on_unexpected_result = metrics.unexpected_results.inc
        self.paused = False  # a re-split holds new micro-batches (those in flight finish) until the route flips
        self.resplitting = False  # a re-split is running (its prepare included, while the mesh serves on)
        self.resplit_phase: str | None = None  # its phase now: prepare, drain, move, commit, recommit (None: none)
        self._recommitting: asyncio.Task | None = None  # sends an unconfirmed commit again until every stage has it
        self._rebalancing: asyncio.Task | None = None  # the re-split --auto-rebalance started
        self.committed: list[LayerRange] | None = None  # the split the last re-split committed (None: none yet)
        self.resplits: list[dict] = []  # the last RESPLIT_HISTORY re-splits (done or not), oldest first
        self.replacements: list[dict] = []  # the last RESPLIT_HISTORY stage replacements (done or not), oldest first

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
        if self.paused:  # a re-split: nothing new goes out until the stages serve the new split
            self._update_gauges()
            return
        if self.start_split is not None and self.start_split.state == "pending" and not self.resplitting \
                and len(self.pipeline.stages) == len(self.pipeline.infos):
            self.start_split.state = "moving"
            self._splitting = asyncio.create_task(self._split_by_measurement(), name="split-auto")
        if self.balancer is not None and not self.resplitting and self.split_settled:
            self._maybe_rebalance()
        self._follow_pipeline()
        plan = self.scheduler.plan(now, self.pipeline.cache_identity)
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
            self.pipeline.mark_lost(update.lost)
            return
        if result is not None and result.hop_s is not None:
            self.metrics.result_hop.observe(max(0.0, result.hop_s))
        self._apply(update)
        self._update_gauges()

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

    # ---- the live re-split ----------------------------------------------------------------------------------------

    async def resplit(self, new: list[LayerRange], trigger: str = "asked") -> dict:
        """Move the pipeline's stages to the split `new` without failing a request. First, while the mesh serves on,
        each stage whose layers change loads its new range beside the one it serves (prepare). Then at a step
        boundary -- new micro-batches held, those in flight drained -- each live sequence's K/V of the moved layers
        goes to its new stage (move) and every stage serves its new range (commit), and the scheduler resumes: each
        phase one Resplit round trip through the pipeline (shared/runtime/resplit.py). Streams see one longer gap
        between tokens, the pause. Returns what was done (also kept in `resplits`, logged and counted by outcome).
        ResplitError when it was not done: the split is not one the stages can move to (400), a re-split is already
        running or the pipeline is not ready (409), a stage refused or did not answer (503: the mesh keeps its split;
        after an unconfirmed commit the pipeline's KV state counts as lost and the running requests are replayed)."""
        pipe = self.pipeline
        if self.resplitting or self._recommitting is not None:
            raise ResplitError("a re-split of this pipeline is already running (or its commit is being sent again "
                               "after a stage died in it); wait for it", status=409)
        if not pipe.ready:
            raise ResplitError(f"the pipeline is not ready ({pipe.problem}): a re-split moves the layers of a "
                               "serving mesh", status=409)
        old = [LayerRange(*i.layers) for i in pipe.stages]
        try:
            check_resplit(old, new, pipe.num_layers)
        except StagemeshError as e:
            self._record_resplit(old, new, trigger, "refused", str(e))
            raise ResplitError(str(e), status=400) from None
        record = {"split_before": boundaries(old), "split": boundaries(new), "trigger": trigger}
        if old == new:
            return {**record, "changed": False, "pause_s": 0.0}
        self.resplitting = True
        rid = pipe.client.next_rid()
        pairs = ([(r.start, r.stop) for r in old], [(r.start, r.stop) for r in new])
        t0, pause = time.perf_counter(), 0.0
        incarnations = [i.incarnation for i in pipe.stages]  # a stage that restarts during a phase fails it
        try:
            await self._phase(Resplit(rid, "prepare", *pairs), old, new, incarnations)  # the mesh serves on meanwhile
            self.paused = True
            pipe.resplitting = True  # its health poll does not take the stages' passing ranges for a broken pipeline
            t_pause = time.perf_counter()
            try:
                self.resplit_phase = "drain"
                if not await self._drain(pipe.stall_s):
                    await self._abort(rid, pairs)
                    raise ResplitError(f"{len(self.scheduler.inflight)} micro-batches still in flight after "
                                       f"{pipe.stall_s:g} s; the split stays {boundaries(old)}")
                await self._phase(Resplit(rid, "move", *pairs), old, new, incarnations)
                # the point of no return: from the commit on, the mesh ends in `new` (a stage that restarts now must
                # serve it: `up` restarts it so; a commit not confirmed is sent again until it is, _recommit)
                self.committed = new
                reports = await self._phase(Resplit(rid, "commit", *pairs), old, new, incarnations)
            finally:
                pipe.resplitting = False
                self.paused = False
                pause = time.perf_counter() - t_pause
                self._changed()
        except ResplitError as e:
            self._record_resplit(old, new, trigger, e.outcome, str(e), pause, took_s=round(time.perf_counter() - t0, 3))
            if e.outcome == "failed":
                self._recommitting = asyncio.create_task(self._recommit(rid, pairs, new, trigger),
                                                         name="resplit-recommit")
            raise
        finally:
            self.resplitting = False
            self.resplit_phase = None
        await pipe.check()  # the stages' /info now: the new layers, one consistent pipeline (the prefix index resets)
        got = [LayerRange(*i.layers) for i in pipe.stages]
        moved = sum(r.get("received_bytes", 0) for r in reports)
        released = sum(r.get("released", 0) for r in reports)
        loads = [r.get("load_s", 0.0) for r in reports]
        self.metrics.resplit_pause.observe(pause)
        self.metrics.resplit_kv_bytes.inc(moved)
        took = time.perf_counter() - t0
        self._record_resplit(old, new, trigger, "done", None, pause, took_s=round(took, 3), moved_bytes=moved,
                             released=released)
        log.warning("%s re-split %s -> %s (%s) in %.2f s: new ranges loaded in %s s while serving, then paused "
                    "%.0f ms to move %.1f MiB of K/V; %d sequences released to replay", pipe.label, boundaries(old),
                    boundaries(new), trigger, took, "/".join(f"{x:.2f}" for x in loads), pause * 1e3, moved / 2**20,
                    released)
        if got != new:  # a stage that serves something else than it committed: replay rather than trust it
            pipe.mark_lost(f"after re-split to {boundaries(new)} the stages report {', '.join(map(str, got))}")
        return {**record, "changed": True, "pause_s": round(pause, 4), "took_s": round(took, 3), "moved_bytes": moved,
                "released": released, "stages": reports}

    async def replace_stage(self, place: int, url: str) -> dict:
        """A stage process at `url` (its HTTP address; started with the same range, keys and model as the stage at
        `place`, at addresses of its own -- on another machine, say) takes `place` in the pipeline: the stage that
        leaves may be serving still (a planned leave: stop it afterwards) or dead. Micro-batches are held and those
        in flight drained (at most REPLACE_DRAIN_S: a dead stage's never come back), the stage before `place` -- or
        the gateway, for place 0 -- sends to the new process from then on (a reroute round trip through the new
        route: its return shows the route works), and the running requests are replayed from their token histories
        (the new process holds no K/V). ResplitError naming why when it was not done: 400 the process does not fit
        the place, 409 a re-split is running or another stage does not answer, 503 the new route did not carry."""
        pipe = self.pipeline
        url = url.rstrip("/")
        if self.resplitting or self._recommitting is not None:
            raise ResplitError("a re-split or replacement of this pipeline is running; wait for it", status=409)
        if pipe.client is None:
            raise ResplitError("the pipeline has never been ready: start its stages (nothing to replace)", status=409)
        if not 0 <= place < len(pipe.stage_urls):
            raise ResplitError(f"stage {place}: the pipeline has stages 0..{len(pipe.stage_urls) - 1}", status=400)
        if url in pipe.stage_urls:
            raise ResplitError(f"{url} already serves stage {pipe.stage_urls.index(url)}", status=400)
        infos = await pipe.fetch_infos()
        silent = [k for k, i in enumerate(infos) if k != place and not isinstance(i, StageInfo)]
        if silent:
            raise ResplitError(f"stage {silent[0]} does not answer either ({infos[silent[0]]}); one place is replaced "
                               "at a time, and the reroute passes through every other stage", status=409)
        new = await pipe.fetch_info(url)
        if not isinstance(new, StageInfo):
            raise ResplitError(f"the stage to take stage {place}'s place does not answer: {new}", status=400)
        leaving = infos[place]
        start = infos[place - 1].layers[1] if place > 0 else 0
        stop = infos[place + 1].layers[0] if place + 1 < len(infos) else pipe.num_layers
        trial = [new if k == place else i for k, i in enumerate(infos)]
        problem = (None if tuple(new.layers) == (start, stop) else
                   f"it serves layers {new.layers[0]}:{new.layers[1]}, stage {place}'s place is {start}:{stop}: start "
                   f"it with --layers {start}:{stop} --stage-index {place}")
        others = [i for i in trial if i is not new]  # each answered (silent ones were refused above)
        like = leaving if isinstance(leaving, StageInfo) else others[0] if others else new
        if problem is None and (new.dtype, new.batch_invariant) != (like.dtype, like.batch_invariant):
            problem = (f"it computes in {new.dtype}{' batch-invariant' if new.batch_invariant else ''}, the pipeline "
                       f"in {like.dtype}{' batch-invariant' if like.batch_invariant else ''}: start it with the "
                       "same --dtype and --batch-invariant as the stage it replaces")
        problem = problem or check_pipeline(trial, pipe.fingerprint, pipe.num_layers) or check_keys(trial, pipe.keys)
        if problem is not None:
            raise ResplitError(f"{url} cannot take stage {place}'s place: {problem}", status=400)
        address = reachable_address(new.listen, url)
        onward = reachable_address(infos[place + 1].listen, pipe.stage_urls[place + 1]) if place + 1 < len(infos) \
            else None  # the last place keeps the result address it was started with
        split = [tuple(i.layers) for i in trial]
        t0 = time.perf_counter()
        self.resplitting, self.resplit_phase, self.paused, pipe.resplitting = True, "replace", True, True
        before = pipe.client.transport.next_hop
        try:
            await self._drain(REPLACE_DRAIN_S)
            if place == 0:
                pipe.client.reroute(address)
            rid = pipe.client.next_rid()
            answer, error = await self._round_trip(
                Resplit(rid, "reroute", split, split, route=(place, address, onward)), None)
            if error is not None:  # put the route back where it was (best effort: the leaving stage may be gone)
                if place == 0:
                    pipe.client.reroute(before)
                elif isinstance(leaving, StageInfo):
                    back = reachable_address(leaving.listen, pipe.stage_urls[place])
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(pipe.client.resplit(
                            Resplit(pipe.client.next_rid(), "reroute", split, split, route=(place, back, None))), 5.0)
                why = (f"the route through {url} ({address}) did not carry: {error}; stage {place} is served as "
                       "before (if it still is)")
                self._record_replacement(place, url, "refused", why, time.perf_counter() - t0)
                raise ResplitError(why)
            was = pipe.stage_urls[place]
            pipe.replaced(place, url, address if place == 0 else None, trial)  # its K/V lost: the requests replay
            pipe.resplitting = False
            await pipe.check()  # ready again (the stage that had died is the new one), before anything is sent
        finally:
            pipe.resplitting, self.paused, self.resplitting, self.resplit_phase = False, False, False, None
            self._changed()
        took = time.perf_counter() - t0
        self._record_replacement(place, url, "done", None, took, replaced=was)
        log.warning("%s stage %d replaced: %s (%s) serves layers %d:%d in place of %s, in %.2f s; running requests "
                    "replayed", pipe.label, place, url, address, start, stop, was, took)
        return {"stage": place, "url": url, "listen": address, "replaced": was, "layers": [start, stop],
                "took_s": round(took, 3), "leaving_answered": isinstance(leaving, StageInfo)}

    @property
    def split_settled(self) -> bool:
        """The pipeline serves the split it will serve: --split auto has chosen and moved to it (or failed), or was
        not asked. The gateway reports ready only then."""
        return self.start_split is None or self.start_split.settled

    async def _split_by_measurement(self) -> None:
        """--split auto: the split the stages' calibrations balance, reached by live re-splits (neighbour-sized steps;
        nothing runs yet, so each is a load and a flip). A failure leaves the split the mesh has, logged and shown."""
        start = self.start_split
        n = self.pipeline.num_layers
        try:
            target = start.target(self.pipeline.stages)
            now = [LayerRange(*i.layers) for i in self.pipeline.stages]
            for _ in range(n):  # each step moves every boundary toward its target: at most n steps
                if (step := toward(now, target, n)) is None:
                    break
                await self.resplit(step, trigger="split-auto")
                now = step
            start.state = "done"
            log.warning("%s --split auto: split %s (measured ms per layer %s; predicted %.2fx the split the stages "
                        "started with)", self.pipeline.label, boundaries(now),
                        "/".join(str(s["ms_per_layer"]) for s in (start.proposal or {}).get("stages", [])),
                        (start.proposal or {}).get("predicted_gain", 1.0))
        except Exception as e:
            start.state = "failed"
            start.error = str(e) if isinstance(e, StagemeshError) else f"{type(e).__name__}: {e}"
            log.error("%s --split auto failed, serving the split the stages started with: %s", self.pipeline.label,
                      start.error)
        finally:
            self._changed()

    def _maybe_rebalance(self) -> None:
        """Ask --auto-rebalance's policy; start the re-split it names (in a task: the loop keeps serving)."""
        infos = self.pipeline.stages
        if len(infos) != len(self.pipeline.infos) or len(infos) < 2:
            return
        split = self.balancer.observe(infos, len(self.scheduler.running))
        if split is not None:
            self._rebalancing = asyncio.create_task(self._auto_resplit(split), name="auto-rebalance")

    async def _auto_resplit(self, split: list[LayerRange]) -> None:
        try:
            await self.resplit(split, trigger="auto")
        except ResplitError:
            pass  # logged and counted by resplit; the policy measures afresh before it proposes again
        except Exception:
            log.exception("auto-rebalance failed")
        finally:
            self.balancer.resplit_ended()

    async def _drain(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until no micro-batch of this pipeline is in flight."""
        deadline = time.perf_counter() + timeout_s
        while self.scheduler.inflight:
            if time.perf_counter() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    async def _phase(self, msg: Resplit, old: list[LayerRange], new: list[LayerRange],
                     incarnations: list[str]) -> list[dict]:
        """One phase's round trip through the pipeline; the stages' reports. A refusal, a lost message or a stage
        that restarted or stopped answering meanwhile (`incarnations`: the stages' when the re-split began) before
        the commit aborts on every stage (ResplitError, the split unchanged); at the commit it declares the
        pipeline's KV state lost (the scheduler replays every running request) and the commit is sent again until
        every stage has it (_recommit)."""
        self.resplit_phase = msg.phase
        await self._hold(msg.phase)
        answer, error = await self._round_trip(msg, incarnations)
        if error is None:
            return answer.report
        if msg.phase == "commit":
            self.pipeline.mark_lost(f"re-split {msg.rid}'s commit was not confirmed: {error}")
            raise ResplitError(f"re-split to {boundaries(new)} failed at the commit ({error}); the running requests "
                               "are replayed and the commit is sent again until every stage has it", outcome="failed")
        await self._abort(msg.rid, (msg.old, msg.new), RESPLIT_WATCH_S if answer is None else None)
        raise ResplitError(f"re-split to {boundaries(new)} refused at the {msg.phase}: {error}; the split stays "
                           f"{boundaries(old)}")

    async def _round_trip(self, msg: Resplit, incarnations: list[str] | None) -> tuple[Resplit | None, str | None]:
        """Send one phase and wait for it to come back: (the answer, None), or (None or the answer, why not) when a
        stage refused it, it did not come back within RESPLIT_PHASE_S, or (with `incarnations`) a stage restarted
        or stopped answering meanwhile -- a message it held is gone, so waiting longer would only stall streams."""
        wait = RESPLIT_PHASE_S[msg.phase]
        answer = asyncio.ensure_future(self.pipeline.client.resplit(msg))
        deadline = time.perf_counter() + wait
        try:
            while time.perf_counter() < deadline:
                done, _ = await asyncio.wait({answer}, timeout=min(RESPLIT_WATCH_S, deadline - time.perf_counter()))
                if done:
                    result = answer.result()
                    return result, result.error
                if incarnations is not None and (died := await self.pipeline.restarted_since(incarnations)):
                    return None, f"{died} during the {msg.phase}"
            return None, f"the {msg.phase} did not come back within {wait:g} s"
        finally:
            answer.cancel()

    async def _hold(self, phase: str) -> None:
        """Fault injection for the chaos benchmark and its test (STAGEMESH_RESPLIT_HOLD=PHASE:SECONDS[,...]): wait that
        long before sending that phase, with /v1/mesh showing it, so a stage or the gateway can be killed at a known point."""
        holds = dict(h.split(":", 1) for h in os.environ.get("STAGEMESH_RESPLIT_HOLD", "").split(",") if ":" in h)
        if seconds := holds.get(phase):
            try:
                wait = min(float(seconds), 60.0)
            except ValueError:  # a test hook: a malformed one holds nothing, and says so
                log.warning("STAGEMESH_RESPLIT_HOLD: %r is not seconds for the %s; not holding", seconds, phase)
                return
            self.resplit_phase = f"{phase} (held)"
            await asyncio.sleep(wait)
            self.resplit_phase = phase

    async def _recommit(self, rid: int, pairs: tuple, new: list[LayerRange], trigger: str) -> None:
        """After a commit that was not confirmed (a stage died in it), send it again whenever every stage answers
        /info until it comes back without error: stages that committed do nothing, those still on their old range
        (one restarted with it, those after the one that died) load their new one, so the mesh ends in one split --
        `new`, the one the gateway routes by and `up` restarts stages with. The pipeline stays not ready meanwhile
        (its stages do not form a split); the requests wait, then are replayed. Stages that form a consistent
        pipeline in another split (restarted on their old ranges before `up` knew the new ones, or by hand) end
        it too: that split is the one routed by from then on."""
        pipe = self.pipeline
        try:
            attempt = 0
            while True:
                await asyncio.sleep(RESPLIT_WATCH_S)
                infos = await pipe.fetch_infos()
                if not all(isinstance(i, StageInfo) for i in infos) or pipe.client is None:
                    continue
                ranges = [LayerRange(*i.layers) for i in infos]
                if ranges == new:
                    break
                if check_pipeline(infos, pipe.fingerprint, pipe.num_layers) is None:
                    log.warning("%s re-split %d: the stages serve %s, one consistent split, not %s: routed by from now "
                                "on (the commit not sent again)", pipe.label, rid, boundaries(ranges), boundaries(new))
                    self.committed = ranges
                    return
                attempt += 1
                self.resplit_phase = "recommit"
                answer, error = await self._round_trip(Resplit(rid, "commit", *pairs), None)
                if error is None:
                    break
                throttled(log, logging.WARNING, "recommit", "%s re-split %d: sending the commit again failed "
                          "(attempt %d): %s; trying again", pipe.label, rid, attempt, error)
            log.warning("%s re-split %d: every stage now serves %s (the commit sent again %d times)", pipe.label, rid,
                        boundaries(new), attempt)
            self.metrics.resplits.labels("recommitted", trigger).inc()
        except Exception:
            log.exception("sending re-split %d's commit again failed", rid)
        finally:
            self.resplit_phase = None
            self._recommitting = None
            with contextlib.suppress(Exception):
                await pipe.check()  # the stages' /info now: one consistent pipeline again
            self._changed()

    async def _abort(self, rid: int, pairs: tuple, wait_s: float | None = None) -> None:
        """Every stage drops what it prepared for re-split `rid` (best effort: a stage that misses it drops it at the
        next prepare). `wait_s`: how long to wait for it to come back (a stage that died will not pass it on)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.pipeline.client.resplit(Resplit(rid, "abort", *pairs)),
                                   wait_s or RESPLIT_PHASE_S["abort"])

    def _record_replacement(self, place: int, url: str, outcome: str, error: str | None, took_s: float,
                            **extra) -> None:
        self.metrics.replacements.labels(outcome).inc()
        self.replacements.append({"time": round(time.time(), 3), "stage": place, "url": url, "outcome": outcome,
                                  "error": error, "took_s": round(took_s, 3), **extra})
        del self.replacements[:-RESPLIT_HISTORY]

    def _record_resplit(self, old: list[LayerRange], new: list[LayerRange], trigger: str, outcome: str,
                        error: str | None, pause_s: float = 0.0, **extra) -> None:
        self.metrics.resplits.labels(outcome, trigger).inc()
        if outcome != "done":
            log.warning("%s re-split %s -> %s (%s) %s: %s", self.pipeline.label, boundaries(old), boundaries(new),
                        trigger, outcome, error)
        self.resplits.append({"time": round(time.time(), 3), "split_before": boundaries(old),
                              "split": boundaries(new), "trigger": trigger, "outcome": outcome,
                              "error": error, "pause_s": round(pause_s, 4), **extra})
        del self.resplits[:-RESPLIT_HISTORY]

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
                             in_flight=len(self.scheduler.inflight))
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
