"""The stage: StageIO's reader on the asyncio event loop prefetches validated inputs, one dedicated compute thread
serves them in order (torch releases the GIL) and sends each output on as soon as it is computed. The loop also serves
the stage's HTTP endpoint; it never touches torch or the outbound socket."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.stage.io import STOP, StageIO
from services.stage.membership import StageMembership
from services.stage.metrics import stage_registry
from services.stage.stats import StageStats
from shared.batch.sampling import sample
from shared.config import STAGE_DEFAULTS
from shared.cpu import cpu_limit
from shared.errors import BadBatch, StagemeshError
from shared.files.layers import LayerRange, StagePosition
from shared.kernels import plans, qdot
from shared.observe.log_throttle import throttled
from shared.observe.otlp import OtlpTracer, trace_id_of
from shared.runtime.plan import ModelFacts
from shared.runtime.resplit import ResplitRefused, StageResplit
from shared.runtime.roofline import token_bytes
from shared.runtime.stage_runtime import StageRuntime
from shared.runtime.trace import CaptureHook
from shared.wire.protocol import (
    MEMBERSHIP_PHASES,
    BatchError,
    BatchResult,
    ForwardBatch,
    KVParcel,
    Message,
    ReleaseDone,
    ReleaseSeqs,
    Resplit,
    sampling_rows,
)
from shared.wire.stage_info import StageInfo
from shared.wire.transport import hand_over

log = logging.getLogger("stagemesh.stage")


@dataclass
class StageIdentity:
    model_name: str
    fingerprint: str
    layers: LayerRange
    num_layers: int
    position: StagePosition
    dtype: str
    listen: str = ""
    incarnation: str = ""
    index: int | None = None  # the stage's index in its pipeline, when it was started with one

    def __post_init__(self):
        self.incarnation = self.incarnation or uuid.uuid4().hex[:12]

    @property
    def name(self) -> str:
        return f"stage[{self.layers}]"


LOAD_CHECK_S = 0.01  # how often the compute thread, idle, looks whether a re-split's load is done
RECENT_MB = 64  # micro-batch ids /info lists as taken in and passed on: the gateway finds where a lost one stopped


def compute_executor() -> ThreadPoolExecutor:
    """The stage's one compute thread. Loading and computing on the same thread matters: each thread that enters a
    torch parallel region gets its own OpenMP team, and two teams contending for the machine's cores made a decode
    step up to twice as slow on a small CPU (benchmarks.critical_path shows a stage's compute time per token)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


class StageWorker:
    """`slot_lease_s`: a sequence whose slot no micro-batch has used for this long is released and counted (a
    vanished gateway cannot hold slots forever; a live sequence is touched at every step). 0 disables.
    `otlp`: export a stagemesh.stage.compute span per traced micro-batch (None: distributed tracing off).
    `threads`: (shared, alone) torch threads for a micro-batch that shares the pipeline with others in flight, and
    for one alone in it (StageConfig.threads_alone); None leaves torch's thread count as it is. A batch-invariant
    stage computes every micro-batch with the shared count: torch's kernels (its attention) sum in another order on
    another thread count, so a row computed alone in the pipeline would differ from the same row computed beside
    others -- a cached prefix from its recompute, a client's answer from the same prompt's under other load."""

    def __init__(self, runtime: StageRuntime, io: StageIO, identity: StageIdentity, tracing: bool = True,
                 slot_lease_s: float = STAGE_DEFAULTS.slot_lease_s, compute_thread: ThreadPoolExecutor | None = None,
                 otlp: OtlpTracer | None = None, threads: tuple[int, int] | None = None):
        if threads is not None and runtime.model.batch_invariant and threads[1] != threads[0]:
            log.info("batch-invariant: every micro-batch computes with %d threads (not %d alone in the pipeline: "
                     "another thread count sums in another order)", threads[0], threads[1])
            threads = (threads[0], threads[0])
        self.threads = threads
        self.tracing = tracing
        self.otlp = otlp
        self.slot_lease_s = slot_lease_s
        self.lease_check_s = min(1.0, slot_lease_s / 4) if slot_lease_s else None
        self._next_lease_check = 0.0
        self.runtime = runtime
        self.io = io
        self.identity = identity
        self.stats = StageStats(transport=io.transport.stats)  # the one ledger: /info and /metrics both read it
        self.registry = stage_registry(self.stats, lambda: self.runtime.kv, lambda: io.queue_depth,
                                       self.decode_bytes, lambda: self.calibration)
        self.resplit = StageResplit(identity.num_layers)  # a live re-split's state (the gateway drives it)
        self.membership = StageMembership(self)  # a change of the mesh's members (services/stage/membership.py)
        # a re-split's new range loads on a thread of its own while this stage serves on (a second OpenMP team for
        # the length of the load): (its prepare message, the load), until the compute thread passes the message on
        # (a replacement's probe waits there too, for its hand-over: _probe)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resplit-load")
        self._loading: tuple[Resplit, Future] | None = None
        # every torch op of the stage runs on this one thread (see compute_executor)
        self.compute_thread = compute_thread or compute_executor()
        # the ids of the last RECENT_MB ForwardBatches this stage took in, and passed on (result or hidden state)
        self.recent_in: deque[int] = deque(maxlen=RECENT_MB)
        self.recent_out: deque[int] = deque(maxlen=RECENT_MB)
        self.calibration: dict | None = None  # --calibrate's measurement at start (shared.runtime.calibrate)
        self.model_facts: ModelFacts | None = None  # the file's sizes (serve() gives them): what a step reads

    def decode_bytes(self) -> int | None:
        """Bytes a one-row decode step of this stage's layers reads as the file stores them (the head's too on the
        last stage; K/V not counted: shared.runtime.roofline), None without the model's facts."""
        if self.model_facts is None:
            return None
        layers = self.runtime.model.layers
        return token_bytes(self.model_facts, range(layers.start, layers.stop), head=self.runtime.model.has_lm_head)

    async def run(self) -> None:
        """Serve until cancelled: StageIO's reader feeds the compute thread, which serves every input (_serve)."""
        await self.io.start()
        serving = self.compute_thread.submit(self._serve)
        try:
            await asyncio.wrap_future(serving)  # returns only if _serve fails: the error ends the stage
        finally:
            self.io.inputs.put(STOP)  # _serve ends after what it is computing; its sockets stay open until it has
            self.io.transport.stop_waiting()  # a send waiting on a next hop that is gone gives up
            await self.io.stop()
            if not serving.done():
                await asyncio.wrap_future(serving)
            self.compute_thread.shutdown(wait=False, cancel_futures=True)
            self._loader.shutdown(wait=False, cancel_futures=True)

    def _serve(self) -> None:
        """The compute thread's loop: every input in arrival order, each computed (or released, or passed on) and its
        output sent from this thread; expired leases are reclaimed between inputs."""
        io = self.io
        while True:
            self._reclaim_expired()
            self._finish_loading()
            t0 = time.perf_counter()
            try:
                msg = io.inputs.get(timeout=self.lease_check_s if self._loading is None else LOAD_CHECK_S)
            except queue.Empty:
                continue  # the lease check is due
            finally:
                self.stats.waiting_seconds += time.perf_counter() - t0
            if msg is STOP:
                return
            try:
                self._serve_one(msg)
            finally:
                io.finish_one()

    def _serve_one(self, msg: Message) -> None:
        if isinstance(msg, ForwardBatch):
            if msg.hop_s is not None:
                self.stats.hop.observe(max(0.0, msg.hop_s))
            self.recent_in.append(msg.mb_id)
            t0 = time.perf_counter()
            span = None if self.otlp is None else self._start_span(msg)
            refused = self._refused_route(msg)
            out = refused or self.compute(msg)
            self.stats.computed(time.perf_counter() - t0, msg.num_tokens)
            if span is not None:  # ended before the send: the gateway may have the result before send returns
                self.otlp.end(span, error=out.message if isinstance(out, BatchError) else None)
            via = None
            if isinstance(out, ForwardBatch) and msg.route:  # on to the route's next instance, with the rest of it
                via, out.route = msg.route[0], msg.route[1:]
            if self.io.send(out, via):
                self.recent_out.append(msg.mb_id)
        elif isinstance(msg, ReleaseSeqs):
            self._release(msg)
        elif isinstance(msg, BatchError):  # an earlier stage failed this micro-batch: pass it on to the client
            self.io.send(msg)
        elif isinstance(msg, Resplit):
            self._resplit(msg)
        elif isinstance(msg, KVParcel):
            self._take_parcel(msg)

    def _resplit(self, msg: Resplit) -> None:
        """Runs in the compute thread: this stage's part of one phase of a live re-split (shared/runtime/resplit.py),
        then the message passes on. A stage that cannot do its part says why in the message (the first refusal
        wins) and drops what it prepared; the gateway then aborts the re-split everywhere."""
        if msg.error is not None and msg.phase != "abort":  # an earlier stage refused: nothing to do here
            self.resplit.abort()
            self.io.send(msg)
            return
        self._finish_loading(wait=True)  # a phase after a prepare still loading (the gateway waits for it first)
        if msg.phase in MEMBERSHIP_PHASES:
            self.membership.begin(msg)
        else:  # another kind of change: the last membership change's K/V moves are over
            self.membership.forget()
        if msg.phase == "reroute":
            self._reroute(msg)
            return
        if msg.phase == "load":  # a membership change: load beside the serving, as a prepare does
            self._loading = (msg, self._loader.submit(self.membership.load, msg, self.runtime))
            return
        if msg.phase in ("accept", "route", "give"):
            getattr(self.membership, msg.phase)(msg)
            return
        if msg.phase == "probe":
            self._probe(msg)
            return
        if msg.phase == "hops":
            self._hops(msg)
            return
        if msg.phase == "prepare":  # load beside the serving: the message passes on once it is loaded
            runtime = self.runtime
            self._loading = (msg, self._loader.submit(self.resplit.prepare, msg, runtime))
            return
        report = None
        try:
            if msg.phase == "move":
                for parcel in self.resplit.parcels(msg, self.runtime):
                    self.io.send(parcel)  # ahead of the Resplit, on the same link: each arrives before the commit
            elif msg.phase == "commit":
                runtime, report = self.resplit.commit(msg, self.runtime, self.identity.index)
                self._serve_with(runtime)
            else:
                self.resplit.abort()
                self.membership.abort()
        except Exception as e:
            self.resplit.abort()
            known = isinstance(e, StagemeshError)
            log.warning("re-split %d (%s) refused on %s: %s: %s", msg.rid, msg.phase, self.identity.name,
                        type(e).__name__, e, exc_info=None if known else e)
            msg.error = f"{self.identity.name}: {e if known else f'{type(e).__name__}: {e}'}"[:1000]
        if report is not None and msg.phase == "commit":
            msg.report.append(report)
        self.io.send(msg)

    def _refused_route(self, batch: ForwardBatch) -> BatchError | None:
        """A micro-batch whose route this stage cannot follow, refused before it is computed (never sent somewhere
        else): a route naming an instance this stage was not told of (a hops phase), or any route at all at the last
        stage or at a stage with no replicas after it. None when it has no route or a route this stage follows."""
        route = batch.route
        if route is None:
            return None
        hops = self.io.transport.hops
        last = self.identity.position.has_lm_head
        if last and not route:
            return None
        if not last and route and route[0] in hops:
            return None
        why = (f"its route names {len(route)} instances after the last stage" if last else
               "its route ends before the last stage" if not route else
               f"its route names instance {route[0]!r}, which is not one this stage sends to "
               f"({', '.join(sorted(hops)) or 'it has no replicas after it'})")
        self.stats.errors += 1
        throttled(log, logging.WARNING, "route", "micro-batch %d refused on %s: %s", batch.mb_id, self.identity.name,
                  why)
        return BatchError(batch.mb_id, self.identity.name, BadBatch.code, f"micro-batch refused: {why}",
                          [s.seq_id for s in batch.seqs])

    def _hops(self, msg: Resplit) -> None:
        """Runs in the compute thread (the outbound sockets' user): the instances of the range after this stage's,
        which a route names, from now on (the gateway added or removed a replica). Passed on along the pipeline."""
        mine = self.runtime.model.layers
        hops = [(h["id"], h["address"], h["key"].encode() if h["key"] else None) for h in msg.hops
                if h["layers"][0] == mine.stop]
        self.io.transport.set_hops(hops)
        # the instances of the range before this one send here too (a replica of it joined)
        self.io.transport.also_accept(tuple(h["key"].encode() for h in msg.hops
                                            if h["key"] and h["layers"][1] == mine.start))
        msg.report.append({"stage": self.identity.index if self.identity.index is not None else -1,
                           "hops": len(hops)})
        log.info("%s sends to %d instances of the next range by route: %s", self.identity.name, len(hops),
                 ", ".join(i for i, _, _ in hops) or "none (no replicas)")
        self.io.send(msg)

    def _reroute(self, msg: Resplit) -> None:
        """Runs in the compute thread (the outbound socket's user): the stage before place msg.route[0] sends to
        that place's new stage from now on, this message first; the new stage, the first of that range to receive
        it, sends to the next place's address (when the message names one) before it passes it on. So its coming
        back to the gateway shows the whole new route works. Every other stage passes it on."""
        place, address, onward = msg.route
        old = [LayerRange(*r) for r in msg.old]
        mine = self.runtime.model.layers
        at = old.index(mine) if mine in old else None
        change = address if at == place - 1 else onward if at == place and onward else None
        if change is not None and change != self.io.transport.next_hop:
            before = self.io.transport.next_hop
            self.io.transport.reroute(change)
            msg.report.append({"stage": at, "rerouted": 1})
            log.warning("%s now sends to %s (was %s): %s", self.identity.name, change, before,
                        f"stage {place} is a new process" if at == place - 1 else f"it took stage {place}'s place")
        self.io.send(msg)

    def _probe(self, msg: Resplit) -> None:
        """Runs in the compute thread: a replacement's probe (Engine.replace_stage sends it before anything pauses).
        The stage before place msg.route[0] hands the message to that place's new process, and that process to the
        next place's address, each on a socket of its own once a CURVE handshake with the key of the place it dials
        completed there (shared.wire.transport.hand_over: proof the process there holds that place's secret key).
        The hand-over waits on the loader thread, so this stage serves on; no stage's route changes. A hand-over that
        fails is the message's error, sent on along the route this stage has. Every other stage passes it on."""
        place, address, onward = msg.route
        old = [LayerRange(*r) for r in msg.old]
        mine = self.runtime.model.layers
        at = old.index(mine) if mine in old else None
        target = address if at == place - 1 else onward if at == place else None
        if target is None:  # not an end of a hop that changes (the last place sends on to its result address)
            self.io.send(msg)
            return
        keys = self.io.transport.keys

        def dial() -> bool:
            why = hand_over(target, keys, msg)
            if why is not None:
                raise ResplitRefused(why)
            return True  # handed over: _finish_loading sends nothing more

        self._loading = (msg, self._loader.submit(dial))

    def _finish_loading(self, wait: bool = False) -> None:
        """A prepare whose load is done (or, with wait, once it is) passes on: with the stage's refusal if it
        failed. Runs in the compute thread, between inputs."""
        if self._loading is None or not (wait or self._loading[1].done()):
            return
        msg, loading = self._loading
        self._loading = None
        passed_on = False
        try:
            passed_on = loading.result() is True  # a probe's hand-over passed the message on itself
        except Exception as e:
            self.resplit.abort()
            known = isinstance(e, StagemeshError)
            log.warning("re-split %d refused on %s: %s: %s", msg.rid, self.identity.name, type(e).__name__, e,
                        exc_info=None if known else e)
            msg.error = f"{self.identity.name}: {e if known else f'{type(e).__name__}: {e}'}"[:1000]
        if not passed_on:
            self.io.send(msg)

    def _serve_with(self, runtime: StageRuntime) -> None:
        """Serve from now on with `runtime` (a committed re-split's: the same one when this stage's layers stayed)."""
        self.stats.resplits += 1
        if runtime is self.runtime:
            return
        before = self.identity.layers
        self.runtime = runtime
        self.identity.layers = runtime.model.layers  # /info's layers: the gateway checks the new split there
        self.__dict__.pop("_weights_info", None)  # the cached_property, of the old range
        log.info("re-split: %s now serves layers %s (was %s), %d sequences' K/V in place", self.identity.name,
                 runtime.model.layers, before, len(runtime.kv.holders))

    def _take_parcel(self, parcel: KVParcel) -> None:
        """Runs in the compute thread: K/V of a re-split's moved layers or a join's given ones, taken if it is this
        stage's, else passed on (one for an upstream stage travels on around the ring)."""
        try:
            taken = self.membership.take(parcel)  # None: not a membership change's parcel
            if not (self.resplit.take(parcel, self.runtime) if taken is None else taken):
                self.io.send(parcel)
        except StagemeshError as e:
            throttled(log, logging.WARNING, "parcel", "dropped K/V of %r in re-split %d: %s", parcel.seq_id,
                      parcel.rid, e)

    def _release(self, msg: ReleaseSeqs) -> None:
        """Runs in the compute thread: free the released sequences' slots, keep the kept ones as cached prefixes, and
        pass the release on (the last stage answers the gateway's wait with ReleaseDone)."""
        if msg.everything:
            kv = self.runtime.kv
            spare = {seq_id for seq_id in msg.spare if not kv.is_kept(seq_id)}  # live ones: a finished one has ended
            held = [seq_id for seq_id in kv.holders if seq_id not in spare]
            log.info("releasing %d KV slots held: a gateway started without sequences%s", len(held),
                     f" (it re-adopts {len(spare)} where they are)" if spare else "")
            for seq_id in held:
                self.runtime.release(seq_id)
        for seq_id in msg.seq_ids:
            self.runtime.release(seq_id)
        for seq_id in msg.keep:
            self.runtime.keep(seq_id)
        if self.identity.position.has_lm_head:
            self.io.send(ReleaseDone(msg.seq_ids))
            return
        # a release carries no route: every instance of the next range frees what it holds of these (each last
        # stage answers, so the gateway counts one ReleaseDone per chain)
        for via in [None, *(i for i, sock in self.io.transport.hops.items() if sock is not None)]:
            self.io.send(msg, via)

    def _reclaim_expired(self) -> None:
        """Release the slots whose lease expired. Runs on the compute thread between inputs."""
        now = time.monotonic()
        if self.lease_check_s is None or now < self._next_lease_check:
            return
        self._next_lease_check = now + self.lease_check_s
        for seq_id in self.runtime.kv.untouched_since(now - self.slot_lease_s):
            self.runtime.release(seq_id)
            self.stats.reclaimed += 1
            throttled(log, logging.WARNING, "lease", "reclaimed the KV slot of sequence %r: no micro-batch used it "
                      "for %g s (--slot-lease)", seq_id, self.slot_lease_s)

    def _start_span(self, batch: ForwardBatch):
        """The stagemesh.stage.compute span of a traced micro-batch (None when its header carries no trace
        context): a child of the gateway's micro-batch span, linked to every other request it carries."""
        seq_tps = [s.traceparent for s in batch.seqs if s.traceparent is not None]
        parent = batch.traceparent or (seq_tps[0] if seq_tps else None)
        if parent is None:
            return None
        own = trace_id_of(parent)
        links = list({trace_id_of(tp): tp for tp in seq_tps if trace_id_of(tp) != own}.values())
        ident = self.identity
        attributes = {"stagemesh.stage.layers": str(ident.layers), "stagemesh.stage.position": ident.position.value,
                      "stagemesh.microbatch.id": batch.mb_id, "stagemesh.tokens": batch.num_tokens,
                      "stagemesh.sequences": len(batch.seqs)}
        if ident.index is not None:
            attributes["stagemesh.stage.index"] = ident.index
        if batch.hop_s is not None:  # upstream sender's send to this stage's receipt
            attributes["stagemesh.hop_ms"] = round(max(0.0, batch.hop_s) * 1e3, 3)
        if batch.received is not None:  # receipt to compute start: the micro-batch waited in the prefetch queue
            attributes["stagemesh.queue_wait_ms"] = round(max(0.0, time.time() - batch.received) * 1e3, 3)
        return self.otlp.start("stagemesh.stage.compute", parent, links, attributes)

    def compute(self, batch: ForwardBatch) -> Message:
        """Runs in the compute thread. Returns the message for the next hop: hidden state, sampled tokens, or an
        error for this micro-batch only (the stage keeps serving)."""
        ident = self.identity
        if self.threads is not None:  # alone in the pipeline, the idle stages' cores are free (the compiled step
            want = self.threads[batch.in_flight == 1]  # has graphs for both counts: CompiledDecode.thread_counts)
            if want != torch.get_num_threads():
                torch.set_num_threads(want)
        try:
            if batch.tokens is not None and batch.tokens.numel():
                vocab = self.runtime.model.config.vocab_size
                lo, hi = (int(t) for t in torch.aminmax(batch.tokens))
                if lo < 0 or hi >= vocab:  # an embedding lookup would raise, or wrap a negative id around
                    raise BadBatch(f"token ids must lie in 0..{vocab - 1}; this micro-batch has {lo}..{hi}")
            capture = self._capture_hook(batch) if self.tracing else None
            runtime = self.runtime
            head_before = runtime.head_seconds
            out = runtime.run(batch.seqs, token_ids=batch.tokens, hidden=batch.hidden, hook=capture)
            captures = batch.captures + ([c.to_wire() for c in capture.captures] if capture else [])
            if not ident.position.has_lm_head:
                return ForwardBatch(batch.mb_id, batch.seqs, hidden=out, trace=batch.trace, captures=captures,
                                    traceparent=batch.traceparent, in_flight=batch.in_flight)
            t_sample = time.perf_counter()
            producing, counts, params, positions, inputs = sampling_rows(batch.seqs)
            sampled = sample(out, params, positions, inputs)
            self.stats.head_seconds += runtime.head_seconds - head_before + time.perf_counter() - t_sample
            return BatchResult(batch.mb_id, [s.seq_id for s in producing], sampled.tokens, sampled.logprobs, captures,
                               top=sampled.top, counts=counts)
        except Exception as e:  # whatever it was, it ends this micro-batch only: the stage keeps serving
            self.stats.errors += 1
            code = e.code if isinstance(e, StagemeshError) else "internal"
            throttled(log, logging.WARNING, f"failed:{code}", "micro-batch %d failed on %s: %s: %s", batch.mb_id,
                      ident.name, type(e).__name__, e, exc_info=None if isinstance(e, StagemeshError) else e)
            message = str(e) if isinstance(e, StagemeshError) else f"{type(e).__name__}: {e}"
            return BatchError(batch.mb_id, ident.name, code, message[:1000], [s.seq_id for s in batch.seqs])

    def _capture_hook(self, batch: ForwardBatch) -> CaptureHook | None:
        if batch.trace is None:
            return None
        traced = batch.trace.get("seq_id")
        ident = self.identity
        offset = 0
        for s in batch.seqs:
            if s.seq_id == traced:
                return CaptureHook.for_piece(ident.layers, ident.position, s.step.start_position,
                                             slice(offset, offset + s.step.num_tokens))
            offset += s.step.num_tokens
        return None

    @functools.cached_property
    def _weights_info(self) -> dict:
        """What each matmul of this stage runs as (GGUF tensor name -> kernel), the bytes it holds against its share
        of the file, and the memory budget's decision (shared.models.memory)."""
        model = self.runtime.model
        return {"bytes": model.weight_bytes(),
                "memory": model.memory_report(), "tensors": model.weight_summary(),
                "by_type": model.runs_as_by_type(),  # GGUF type -> {what its matrices run as: how many}
                # the integer-dot kernels (shared.kernels.qdot: Q4_*, Q5_*, Q8_0, Q2_K .. Q6_K) on, or why not
                "integer_dot": qdot.why_not() or "on",
                # their prefill-sized calls on the AMX tiles (bf16), or why not (the tensors' kinds say which run so)
                "amx": qdot.amx_why_not() or f"on from {qdot.amx_rows()} rows"}

    @functools.cached_property
    def _keys_info(self) -> dict | None:
        """The public keys of this stage's sockets (None: plaintext), for the gateway to check every hop's pair:
        a stage restarted with another key set is named before a micro-batch is lost to it."""
        keys = self.io.transport.keys
        if keys is None:
            return None
        return {"public": keys.receive.public.decode(), "accepts": keys.accept.decode(),
                "next": keys.next_server.decode() if keys.next_server else None}

    def info(self) -> StageInfo:
        ident, kv, stats, transport = self.identity, self.runtime.kv, self.stats, self.stats.transport
        model = self.runtime.model
        return StageInfo(
            model=ident.model_name, fingerprint=ident.fingerprint, layers=(ident.layers.start, ident.layers.stop),
            num_layers=ident.num_layers, position=ident.position.value, incarnation=ident.incarnation,
            listen=ident.listen, device=str(self.runtime.device), dtype=ident.dtype,
            kv_dtype=str(model.kv_dtype).removeprefix("torch."), weights_mode=model.weights,
            batch_invariant=model.batch_invariant,
            threads=self.threads[0] if self.threads else torch.get_num_threads(),
            threads_alone=self.threads[1] if self.threads else torch.get_num_threads(),
            prefetch=self.io.prefetch, weights=self._weights_info, compiled_decode=self.runtime.compiled_decode_info(),
            kernel_plans=plans.active().info(),
            keys=self._keys_info,
            kv_slots=kv.num_slots, kv_slots_used=kv.used_slots, kv_slots_cached=kv.kept_slots,
            kv_prefix_slots=kv.prefix_slots, kv_max_seq_len=kv.max_seq_len, context=self.runtime.context_info(),
            kv_slot_lease_s=self.slot_lease_s,
            kv_prefix_memory_bytes=kv.prefix_bytes, kv_live_memory_bytes=kv.live_bytes or 0,
            kv_cached_bytes=kv.kept_bytes, kv_position_bytes=kv.position_bytes,
            kv_resident_bytes=kv.resident_bytes, kv_reserved_bytes=kv.reserved_bytes, kv_shared_bytes=kv.shared_bytes,
            slots_reclaimed=stats.reclaimed, prefixes_evicted=kv.evicted,
            clock_s=round(time.monotonic(), 4), microbatches=stats.microbatches,
            busy_seconds=round(stats.busy_seconds, 4), head_seconds=round(stats.head_seconds, 4),
            cpu_seconds=round(time.process_time(), 4), cpu_limit=round(cpu_limit(), 4),
            waiting_for_input_seconds=round(stats.waiting_seconds, 4),
            sending_seconds=round(transport.sending_seconds, 4), hop_latency_seconds_sum=round(stats.hop.seconds, 6),
            hop_latency_seconds_count=stats.hop.count, dropped_messages=transport.dropped,
            rejected_messages=dict(transport.rejected), handshakes_failed=dict(transport.handshakes_failed),
            recent_mb_in=tuple(self.recent_in), recent_mb_out=tuple(self.recent_out), calibration=self.calibration)
