"""What changes the mesh under an engine loop (services/gateway/engine/core.py owns one MeshChange): the live
re-split (the stages' layer ranges moved with their K/V at a step boundary), a stage replaced by a process at other
addresses, --split auto's move to the split the stages' calibrations balance, and --auto-rebalance's re-splits from
measured stage times. Each is a sequence of Resplit round trips through the pipeline client
(shared/runtime/resplit.py) while the loop holds new micro-batches (`paused`); the scheduler is read for what is in
flight, never changed here -- what a re-split releases comes back through the pipeline's epoch (replay)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from services.gateway.engine.balance import Balancer, StartSplit, toward
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.pipeline import Pipeline, check_keys, check_pipeline, reachable_address
from services.gateway.engine.scheduler import Scheduler
from shared.errors import StagemeshError
from shared.files.layers import LayerRange, boundaries, check_resplit
from shared.observe.log_throttle import throttled
from shared.wire.protocol import Resplit
from shared.wire.stage_info import StageInfo
from shared.wire.transport import PROBE_S

log = logging.getLogger("stagemesh.gateway.scheduler")

# each phase's round trip at most; a replacement's probe (two hand-overs of at most PROBE_S each, before anything
# pauses) and its reroute (streams paused, the new route already proven by the probe) are bounded to a few seconds
RESPLIT_PHASE_S = {"prepare": 120.0, "move": 60.0, "commit": 30.0, "abort": 10.0, "probe": 2 * PROBE_S + 3.0,
                   "reroute": 5.0}
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
        self.outcome = outcome  # a RESPLIT_OUTCOMES entry (services/gateway/engine/metrics.py)


class MeshChange:
    """The mesh changes of one pipeline's engine loop. `changed`: the loop's wake-up (a change of state to deliver and
    count); the loop calls between_steps() before each plan and sends nothing while `paused`."""

    def __init__(self, pipeline: Pipeline, scheduler: Scheduler, metrics: GatewayMetrics,
                 changed: Callable[[], None], start_split: StartSplit | None = None,
                 balancer: Balancer | None = None):
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.metrics = metrics
        self._changed = changed
        self.start_split = start_split  # --split auto's decision at start (None: the split the stages came with)
        self._splitting: asyncio.Task | None = None  # the re-splits it runs
        self.balancer = balancer  # --auto-rebalance's policy (None: the split changes only when asked)
        self.paused = False  # a re-split holds new micro-batches (those in flight finish) until the route flips
        self.resplitting = False  # a re-split is running (its prepare included, while the mesh serves on)
        self.resplit_phase: str | None = None  # its phase now: prepare, drain, move, commit, recommit (None: none)
        self._recommitting: asyncio.Task | None = None  # sends an unconfirmed commit again until every stage has it
        self._rebalancing: asyncio.Task | None = None  # the re-split --auto-rebalance started
        self.committed: list[LayerRange] | None = None  # the split the last re-split committed (None: none yet)
        self.resplits: list[dict] = []  # the last RESPLIT_HISTORY re-splits (done or not), oldest first
        self.replacements: list[dict] = []  # the last RESPLIT_HISTORY stage replacements (done or not), oldest first

    def between_steps(self) -> None:
        """Before each plan: start --split auto's move once every stage answered, and ask --auto-rebalance's policy
        while no re-split runs."""
        if self.start_split is not None and self.start_split.state == "pending" and not self.resplitting \
                and len(self.pipeline.stages) == len(self.pipeline.infos):
            self.start_split.state = "moving"
            self._splitting = asyncio.create_task(self._split_by_measurement(), name="split-auto")
        if self.balancer is not None and not self.resplitting and self.split_settled \
                and not self.scheduler.chains.replicated:  # (a re-split moves one process per range)
            self._maybe_rebalance()

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
        if self.scheduler.chains.replicated:
            raise ResplitError("the mesh has replicas of a stage (services/gateway/engine/chains.py): a re-split moves "
                               "the layers of one process per range; let the replicas leave first (stagemesh leave)",
                               status=409)
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
        leaves may be serving still (a planned leave: stop it afterwards) or dead. First, while the mesh serves on,
        a probe proves the new route (the process at its `listen` holds the place's CURVE secret key and reaches the
        next place: a Resplit "probe", handed over only after each handshake completed). Then micro-batches are held
        and those in flight drained (at most REPLACE_DRAIN_S: a dead stage's never come back), the stage before
        `place` -- or the gateway, for place 0 -- sends to the new process from then on (a reroute round trip
        through the new route: its return shows the route works), and the running requests are replayed from their
        token histories (the new process holds no K/V). ResplitError naming why when it was not done: 400 the
        process does not fit the place or the probe did not prove its route (nothing paused), 409 a re-split is
        running or another stage does not answer, 503 the new route did not carry."""
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
        address = reachable_address(new.listen, url)
        serving = {reachable_address(i.listen, u): k for k, (i, u) in enumerate(zip(infos, pipe.stage_urls))
                   if isinstance(i, StageInfo)}
        same = next((k for k, i in enumerate(infos) if isinstance(i, StageInfo) and i.incarnation == new.incarnation),
                    None)
        if problem is None and same is not None:  # a copy of that stage's /info (or the same process at another URL)
            problem = (f"its /info names stage {same}'s incarnation {new.incarnation}: it is not a new process; give "
                       "the URL of the stage process started to take the place")
        if problem is None and not (address.startswith(("tcp://", "ipc://")) and len(address) <= 256):
            problem = f"its listen address {address[:64]!r} is not a tcp:// or ipc:// address a stage can dial"
        if problem is None and address in serving:
            problem = (f"its listen address {address} is where stage {serving[address]} receives: give the URL of a "
                       "process that listens at addresses of its own")
        if problem is not None:
            raise ResplitError(f"{url} cannot take stage {place}'s place: {problem}", status=400)
        onward = reachable_address(infos[place + 1].listen, pipe.stage_urls[place + 1]) if place + 1 < len(infos) \
            else None  # the last place keeps the result address it was started with
        split = [tuple(i.layers) for i in trial]
        t0 = time.perf_counter()
        self.resplitting, self.resplit_phase = True, "probe"
        try:  # the new route, tried while the mesh serves on: nothing pauses for a process that cannot serve it
            _, error = await self._round_trip(Resplit(pipe.client.next_rid(), "probe", split, split,
                                                      route=(place, address, onward)),
                                              None, via=address if place == 0 else None)
        finally:
            self.resplitting, self.resplit_phase = False, None
        if error is not None:
            why = (f"{url} cannot take stage {place}'s place: the route through its listen address {address} was not "
                   f"proven ({error}); nothing was paused")
            self._record_replacement(place, url, "refused", why, time.perf_counter() - t0)
            raise ResplitError(why, status=400)
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

    async def _round_trip(self, msg: Resplit, incarnations: list[str] | None,
                          via: str | None = None) -> tuple[Resplit | None, str | None]:
        """Send one phase and wait for it to come back: (the answer, None), or (None or the answer, why not) when a
        stage refused it, it did not come back within RESPLIT_PHASE_S, or (with `incarnations`) a stage restarted
        or stopped answering meanwhile -- a message it held is gone, so waiting longer would only stall streams.
        `via`: PipelineClient.resplit's (a probe into a new first stage)."""
        wait = RESPLIT_PHASE_S[msg.phase]
        answer = asyncio.ensure_future(self.pipeline.client.resplit(msg, via))
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
