"""Continuous batching over one pipeline, as a pure policy: what to run next, and what a result means.

Scheduler holds no socket, task, span or metric, and writes no timing or capture (vLLM v1's split): schedule() says
which micro-batches to send now and which KV slots to free first; on_result() turns what came back into per-request
outputs (tokens accepted, ends, errors, requeues). The rest of its methods (submit, finish, expire, pipeline_lost,
...) change its state the same way and return an Update. The engine loop (services/gateway/engine/core.py) does the I/O
around it and feeds the metrics and spans from those return values. Turning outputs into text is the output
processor's job (services/gateway/frontend/output.py), as in vLLM v1.

Each request is a SequenceState (shared/runtime/generation.py): `computed` tokens of prompt + output have KV in the
pipeline, and its next step is a prefill chunk or one decode. A request sits in at most one micro-batch in flight
(its next input is the token that micro-batch will sample). Running requests are spread across K micro-batches so
every stage has work while the others compute; decodes go first, so a long prompt delays them by at most one
chunk. Times are perf_counter seconds, passed in as `now`."""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass, field

from services.gateway.engine.chains import PREFIX_CHAIN_SLACK, ChainTable
from services.gateway.engine.prefix_cache import Hit, PrefixIndex
from services.gateway.engine.request import Request, RequestOutput
from services.gateway.engine.speculator import DRAFT_ROWS, NGRAM_MAX_RUNNING, Speculator
from shared.batch.steps import Decode, decodes_only
from shared.config import SCHEDULER_DEFAULTS, SchedulerConfig
from shared.errors import KVCacheFull, PrefixMiss, UnknownSequence
from shared.wire.pipeline_client import PipelineError
from shared.wire.protocol import BatchResult, SeqEntry

log = logging.getLogger("stagemesh.gateway.scheduler")

KV_FULL_BACKOFF_S = 1.0  # after a stage answered kv_full, admission holds at what fits for this long


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class MicroBatch:
    """One planned micro-batch: entries[i] is requests[i]'s step, `tokens` their input ids concatenated."""

    mb_id: int
    requests: list[Request]
    entries: list[SeqEntry]
    tokens: list[int]
    traced: Request | None  # the one request whose rows the stages capture (at most one per micro-batch)
    planned_at: float  # perf_counter time: in flight from then (the engine sends it at once)
    alone: bool = False  # nothing else was in flight when it was planned
    route: tuple[str, ...] | None = None  # its requests' chain (ForwardBatch.route; None: a mesh without replicas)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Update:
    """What one call into the Scheduler changed that the world outside must hear of. The engine delivers `outputs`
    to the requests' streams, does what `abandoned` / `lost` ask of the pipeline, and counts the rest."""

    outputs: list[tuple[Request, RequestOutput]] = field(default_factory=list)  # in order: tokens, then ends
    admitted: list[Request] = field(default_factory=list)  # admitted for the first time (their prompts count now)
    captures: list[tuple[Request, list]] = field(default_factory=list)  # a traced request's captures that came back
    hits: list[tuple[Request, int]] = field(default_factory=list)  # clients' requests admitted from a cached prefix
    requeued: list[Request] = field(default_factory=list)  # started ones a failed micro-batch sent back to the queue
    kv_full: bool = False  # a stage had no free slot: admission holds at kv_cap until kv_cap_until
    prefix_miss: str | None = None  # a stage no longer held a prefix a micro-batch attached: its answer
    lost: str | None = None  # the pipeline lost our sequences (unknown_sequence): why; the engine marks it lost
    abandoned: list[int] = field(default_factory=list)  # micro-batches in flight no longer waited for
    refused: str | None = None  # submit(): the queue was full, the request was not taken (why)

    def end(self, request: Request, reason: str, error: str | None = None) -> None:
        self.outputs.append((request, RequestOutput(finish_reason=reason, error=error)))


@dataclass
class StepPlan(Update):
    """schedule()'s answer for one engine step: free `release` and keep `keep` (as cached prefixes) on every stage, then send `batches`."""

    release: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    batches: list[MicroBatch] = field(default_factory=list)
    replays: int = 0  # requests whose replay starts with these batches


class Scheduler:
    """The policy of one pipeline. `kv_slots` (each stage's, the most requests running at once), `kv_rows` (each
    stage's KV rows: running requests and kept prefixes together), `prefix_positions` (the positions kept prefixes
    may hold on every stage; None: no bound), `live_positions` (the positions running requests may hold of their own
    on every stage; None: no bound) follow the pipeline's /info: the engine keeps them current.

    A running request holds positions for its prompt and all of its max_tokens (kv_positions) from admission to its
    end, so the running ones' K/V never grows past live_positions: requests wait for room in the queue instead of a
    stage being killed for memory."""

    def __init__(self, max_inflight: int, config: SchedulerConfig = SCHEDULER_DEFAULTS, kv_slots: int = 1,
                 kv_rows: int | None = None, prefix_positions: int | None = None, live_positions: int | None = None,
                 speculator: Speculator | None = None):
        self.max_inflight = max_inflight
        self.config = config
        self.max_replays = config.max_replays
        self.kv_slots = kv_slots
        self.kv_rows = kv_rows or kv_slots
        self.prefix_positions = prefix_positions
        self.live_positions = live_positions
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.inflight: dict[int, MicroBatch] = {}  # micro-batch id -> the micro-batch, oldest first
        self.max_inflight_seen = 0
        self.prefix = PrefixIndex() if config.prefix_cache else None  # services/gateway/engine/prefix_cache.py (None: off)
        # drafts for decode steps (services/gateway/engine/speculator.py), shared with the other pipelines' schedulers
        self.speculator = speculator if speculator is not None else Speculator(config.speculation)
        self.kv_cap: int | None = None  # after a kv_full: admit no more than this many running requests ...
        self.kv_cap_until = 0.0  # ... until this time (or until one of them finishes)
        self._release: list[str] = []  # sequences to free on every stage with the next plan
        self._keep: list[str] = []  # finished sequences to keep on every stage, as cached prefixes
        self._replay_pending = False  # the pipeline was lost: free what surviving stages hold before replaying
        self._mb_ids = itertools.count(1)
        # the instances of each range and the sequences each holds (services/gateway/engine/chains.py): empty, and
        # never consulted, in a mesh without replicas of a stage
        self.chains = ChainTable()

    # ---- state ------------------------------------------------------------------------------------------------

    @property
    def replaying(self) -> int:
        """Running requests still re-prefilling their history after a failover."""
        return sum(1 for r in self.running.values() if r.replays and r.prefilling)

    @property
    def idle(self) -> bool:
        """No request is running or waiting."""
        return not self.running and not self.waiting

    @staticmethod
    def kv_positions(req: Request) -> int:
        """The positions a running request may come to hold: its prompt and every token it may generate."""
        return len(req.prompt_ids) + req.max_tokens

    @property
    def held_positions(self) -> int:
        """The positions the running requests hold (kv_positions of each)."""
        return sum(self.kv_positions(r) for r in self.running.values())

    def open_requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting]

    def oldest_in_flight(self) -> MicroBatch | None:
        return next(iter(self.inflight.values()), None)  # dicts keep insertion order

    # ---- requests in and out ----------------------------------------------------------------------------------

    def submit(self, req: Request, now: float) -> Update:
        """Admit now if a slot is free, else queue; `refused` (and nothing kept of it) when the queue is at its
        bound. Requests a free slot takes at once never count against the bound."""
        self.waiting.append(req)
        update = Update()
        self._admit(now, update)
        if len(self.waiting) > self.config.max_queue:
            self.waiting.pop()  # the request itself: admission takes from the front
            update.refused = f"{len(self.waiting)} requests are already waiting; retry shortly"
        return update

    def adopt(self, req: Request, now: float) -> Update:
        """Take over an open request another replica could not keep running: it waits at the front of the queue,
        never refused (it was admitted once), and prefills its token history here."""
        self.waiting.appendleft(req)
        update = Update()
        self._admit(now, update)
        return update

    def finish(self, req: Request, reason: str, error: str | None = None) -> Update:
        """End a request outside the token flow (cancel, a stop string, deadline, failure). No-op once finished."""
        update = Update()
        if not req.done:
            self._retire(req, reason)
            update.end(req, reason, error)
        return update

    def end_all(self, reason: str, error: str) -> Update:
        """End every open request (shutdown, a pipeline unavailable for too long)."""
        update = Update()
        for req in self.open_requests():
            update.outputs += self.finish(req, reason, error).outputs
        return update

    def expire(self, now: float) -> Update:
        """End the requests past their deadline."""
        update = Update()
        for req in [*self.waiting, *self.running.values()]:
            if now > req.deadline:
                update.outputs += self.finish(req, "timeout", "the request exceeded its deadline").outputs
        return update

    def _retire(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        self.running.pop(req.seq_id, None)
        chain = self.chains.key(req.chain)  # where its K/V lives (kept there, if kept)
        self._unchain(req)
        if req.sent:  # even at computed 0 (reset for a replay): surviving stages still hold its slot
            if self._keeps(req, reason, chain):
                self._keep.append(req.seq_id)  # ordered after any micro-batch of it already sent, as a release is
            else:
                self._release.append(req.seq_id)
            req.sent = False

    def _keeps(self, req: Request, reason: str, chain: tuple[str, ...]) -> bool:
        """Index a finished request as a cached prefix on its chain (True: keep its slots), releasing the prefixes
        it contains, and the least recently used others while the kept prefixes hold more than prefix_positions. Its
        first `computed` tokens have K/V on every stage of its chain (a micro-batch still in flight writes only later
        positions). Not after a failure, nor for a traced request (its rows carry capture hooks' numbers), nor one
        that alone holds more than prefix_positions."""
        if self.prefix is None or reason not in ("stop", "length", "cancelled") or req.traced or req.attach \
                or req.audit:
            return False
        bound = self.prefix_positions
        if bound is not None and req.computed > bound:
            return False
        kept, contained = self.prefix.insert(req.seq_id, req.all_ids[:req.computed], self._pinned(),
                                             prompt_tokens=len(req.prompt_ids), tenant=req.cache_tenant, chain=chain)
        self._release.extend(contained)
        while kept and bound is not None and self.prefix.held_positions > bound:
            if not self._evict_prefix({req.seq_id}):
                break
        return kept

    def _evict_prefix(self, spare: set[str]) -> bool:
        """Release the least recently used cached prefix on every stage, sparing `spare` and the pinned ones; False
        when there is none to release."""
        victim = self.prefix.evict(self._pinned() | spare)
        if victim is not None:
            self._release.append(victim)
        return victim is not None

    def _pinned(self) -> set[str]:
        """Prefixes an admitted request will attach with its first chunk, not sent yet: not to be released."""
        return {r.attach for r in self.running.values() if r.attach is not None}

    # ---- failover ---------------------------------------------------------------------------------------------

    def pipeline_lost(self, why: str) -> Update:
        """A stage died, restarted or forgot a sequence: every request's KV may be gone. Abandon what is in flight
        and replay each running request from its token history (failing those replayed max_replays times)."""
        update = Update(abandoned=list(self.inflight))
        self.inflight.clear()
        for req in list(self.running.values()):
            if req.replays >= self.max_replays:
                update.outputs += self.finish(req, "error", f"the pipeline failed {req.replays} times during this "
                                                            f"request; the last time: {why}").outputs
            else:
                req.reset_for_replay()
        if self.prefix is not None:  # a replaced stage keeps nothing: forget every prefix, release it where it is left
            self._release.extend(self.prefix.reset(""))
            for req in self.running.values():
                req.attach = None
        self._replay_pending = True  # release what surviving stages still hold before replaying
        return update

    def hand_off_candidates(self) -> list[Request]:
        """The pipeline is not ready: every open request, ready to replay elsewhere from its token history."""
        reqs = self.open_requests()
        for req in reqs:
            if req.computed or req.in_flight:  # pipeline_lost reset the running ones; this is only a guard
                req.reset_for_replay()
        return reqs

    def handed_off(self, reqs: list[Request]) -> None:
        """Another replica took these: forget them. The stages here that survived still hold slots of the sent ones:
        those are released when the pipeline is ready again."""
        for req in reqs:
            if req in self.waiting:
                self.waiting.remove(req)
            self.running.pop(req.seq_id, None)
            self._unchain(req)
            if req.sent:
                self._release.append(req.seq_id)
                req.sent = False

    def instance_lost(self, instance_id: str, why: str) -> Update:
        """A replica of a stage died or left: only the requests whose chain names it lost K/V. Abandon the
        micro-batches in flight on it; each of its running requests replays from its token history on a chain of the
        living instances (failing those replayed max_replays times); the surviving stages of its old chain free what
        they hold of it (a release reaches every instance). Every other request runs on untouched."""
        update = Update()
        for mb_id, batch in list(self.inflight.items()):
            if batch.route is not None and instance_id in batch.route:
                del self.inflight[mb_id]
                update.abandoned.append(mb_id)
        if self.prefix is not None:  # what was kept on a chain through it is gone there: forget it, free the rest
            self._release.extend(self.prefix.forget_chains(lambda chain: instance_id in chain))
        for req in [r for r in self.running.values() if r.chain is not None and instance_id in r.chain]:
            self._unchain(req)
            if req.replays >= self.max_replays:
                update.outputs += self.finish(req, "error", f"the pipeline failed {req.replays} times during this "
                                                            f"request; the last time: {why}").outputs
                continue
            if req.sent:
                self._release.append(req.seq_id)
            req.reset_for_replay()
            self._chain(req)
        return update

    def _chain(self, req: Request) -> None:
        """Bind a running request to a chain (chains.choose) when the mesh has replicas of a stage."""
        if self.chains.replicated and req.chain is None:
            req.chain = self.chains.choose()
            self.chains.bind(req.seq_id, req.chain)

    def _unchain(self, req: Request) -> None:
        if req.chain is not None:
            self.chains.unbind(req.seq_id, req.chain)
            req.chain = None

    # ---- what to run ------------------------------------------------------------------------------------------

    def schedule(self, now: float, cache_identity: str | None = None) -> StepPlan:
        """The KV slots to free, then the micro-batches to send now (at most max_inflight in flight), admitting
        what fits first. `cache_identity`: the pipeline's (Pipeline.cache_identity); another one than the prefix
        index was built for forgets every prefix. Releases decided while admitting go out with the next plan."""
        if self._replay_pending:
            self._replay_pending = False
            self._release.extend(self.running)
        if self.prefix is not None and cache_identity is not None and self.prefix.identity != cache_identity:
            self._release.extend(self.prefix.reset(cache_identity))  # another pipeline (or the first): it keeps nothing
        plan = StepPlan(release=self._release, keep=self._keep)
        self._release, self._keep = [], []
        self._admit(now, plan)
        # up to K in flight per chain in use (a single chain: K, as ever)
        chains = len({r.chain for r in self.running.values()}) if self.chains.replicated else 1
        limit = self.max_inflight * max(1, chains)
        while len(self.inflight) < limit:
            batch = self._next_batch(now, plan)
            if batch is None:
                break
            self.inflight[batch.mb_id] = batch
            self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))
            plan.batches.append(batch)
        return plan

    def _admit(self, now: float, update: Update) -> None:
        """Move waiting requests to running while slots allow; update.admitted gets those admitted for the first
        time, update.hits the clients' requests among them that start from a cached prefix."""
        limit = self.kv_slots
        if self.kv_cap is not None:
            if now < self.kv_cap_until:
                limit = min(limit, self.kv_cap)
            else:
                self.kv_cap = None  # probe again: leased or foreign slots may have been freed
        held = self.held_positions
        while self.waiting and len(self.running) < limit:
            req, hit = self.waiting[0], None
            need = self.kv_positions(req)
            if self.live_positions is not None and self.running and held + need > self.live_positions:
                break  # waits for room (alone it always runs: a stage holds one whole row for it)
            held += need
            if self.prefix is not None:
                if req.computed == 0 and not req.traced and not req.replays and not req.no_cache:
                    hit = self._lookup(req)
                if len(self.running) + len(self.prefix) >= self.kv_rows:
                    # a cached prefix gives its rows up for the request -- never the one it is about to attach
                    if not self._evict_prefix({hit.prefix.seq_id} if hit else set()):
                        break
                self.prefix.count(hit)
                if hit is not None:
                    req.start_from(hit.prefix.seq_id, hit.tokens)
                    if req.audit is None:
                        update.hits.append((req, hit.tokens))
                req.cached_tokens = hit.tokens if hit else 0
            self.waiting.popleft()
            self.running[req.seq_id] = req
            self._chain(req)
            if not req.admitted:  # not a re-admission after a kv_full
                req.admitted = True
                update.admitted.append(req)

    def _lookup(self, req: Request) -> Hit | None:
        """A new request's cached prefix, and with replicas its chain: the chain of the longest prefix kept anywhere
        while that chain's predicted work is within PREFIX_CHAIN_SLACK of the least loaded chain's (then it is bound
        there), else the longest prefix on the least loaded chain, the one it is bound to (SGLang's cache-aware router
        draws the same line between its cache and its load)."""
        if not self.chains.replicated:  # one chain: every prefix is on it (a lost replica's went with it)
            return self.prefix.lookup(req.all_ids, req.cache_tenant)
        self._unchain(req)  # (bound by an earlier try that found no room)
        least = self.chains.choose()
        hit = self.prefix.lookup(req.all_ids, req.cache_tenant)
        if hit is not None and hit.prefix.chain != least and self.chains.work(hit.prefix.chain) <= PREFIX_CHAIN_SLACK * self.chains.work(least):
            req.chain = hit.prefix.chain
        else:
            req.chain = least
            if hit is not None and hit.prefix.chain != least:
                hit = self.prefix.lookup(req.all_ids, req.cache_tenant, on=least)
        self.chains.bind(req.seq_id, req.chain)
        return hit

    def _next_batch(self, now: float, plan: StepPlan) -> MicroBatch | None:
        """The next micro-batch: at most ceil(running / K) requests and token_budget tokens, decodes first, and at
        most one request whose trace is collecting (the stages capture one request's rows per micro-batch; a second
        waits for the next micro-batch, so each gets every step and only its own activations)."""
        ready = [r for r in self.running.values() if not r.in_flight and not r.done]
        if not ready:
            return None
        running = len(self.running)
        route = None
        if self.chains.replicated:  # one chain per micro-batch: the first ready decode's (else prefill's)
            route = next((r for r in ready if not r.prefilling), ready[0]).chain
            ready = [r for r in ready if r.chain == route]
            running = sum(1 for r in self.running.values() if r.chain == route)
        per_batch = max(1, math.ceil(running / self.max_inflight))
        decodes = [r for r in ready if not r.prefilling]
        prefills = [r for r in ready if r.prefilling]
        entries, tokens, reqs, budget = [], [], [], self.config.token_budget
        traced = None
        # draft rows: what DRAFT_ROWS leaves beside this micro-batch's decodes, and none beside a prompt chunk (a
        # decode's drafts are verified as one-token rows only in a micro-batch of decodes: exactly one-token steps)
        decoding = min(len(decodes), per_batch)
        rows = DRAFT_ROWS - decoding if decoding == per_batch or not prefills else 0
        ngrams = len(self.running) <= NGRAM_MAX_RUNNING
        for r in decodes + prefills:
            if len(reqs) >= per_batch or budget <= 0:
                break
            if r.tracing:
                if traced is not None:
                    continue
                traced = r
            if rows > 0 and not r.prefilling:
                rows -= len(self.speculator.draft(r, rows, ngrams, DRAFT_ROWS - rows))
            entry, toks = r.next_step(min(self.config.prefill_chunk, budget))
            r.feeding = len(toks)
            r.starting = entry.step.starts_sequence
            r.sent = True
            if r.replay_due:
                r.replay_due = False
                r.replays += 1
                plan.replays += 1
            budget -= len(toks)
            entries.append(entry)
            tokens.extend(toks)
            reqs.append(r)
        return MicroBatch(next(self._mb_ids), reqs, entries, tokens, traced, now, alone=not self.inflight,
                          route=route) if reqs else None

    # ---- what came back ---------------------------------------------------------------------------------------

    def on_result(self, mb_id: int, result: BatchResult | None, error: BaseException | None, now: float) -> Update:
        """A micro-batch came back: `result`, or `error` (a PipelineError carries the stage's code), or neither
        (abandoned). Each request of it advances by what it fed and takes what it sampled; a failure fails them,
        except the codes that mean "run it again" (kv_full, prefix_miss) or "the pipeline lost it"
        (unknown_sequence)."""
        batch = self.inflight.pop(mb_id, None)
        reqs = batch.requests if batch is not None else []
        code = error.code if isinstance(error, PipelineError) else None
        if code == UnknownSequence.code:
            # a stage lost our sequences: it restarted between health polls -- or a holder of the last stage's key
            # forged the answer (only the last stage's key reaches this port); either way replaying is safe
            return Update(lost=f"{error.error.stage} answered unknown_sequence for micro-batch {mb_id} (it restarted "
                               f"between health polls, or a holder of the last stage's key forged it): {error}")
        if code == KVCacheFull.code:
            return self._kv_full(reqs, now)
        if code == PrefixMiss.code:
            return self._prefix_miss(reqs, error)
        update = Update()
        if result is not None and batch is not None and batch.alone and not self.inflight \
                and decodes_only(e.step for e in batch.entries):
            # alone in the pipeline from its send to now (results come back in order): its round trip is its pass
            self.speculator.costs.observe(batch.num_tokens, now - batch.planned_at)
        sampled = result.by_sequence() if result else {}
        for r, entry in zip(reqs, batch.entries if batch is not None else ()):
            fed, r.feeding, r.starting = r.feeding, 0, False
            if r.done:
                continue
            if error is not None:
                msg = str(error) if isinstance(error, PipelineError) else f"pipeline failure: {error}"
                update.outputs += self.finish(r, "error", msg).outputs
                continue
            if r is batch.traced and result is not None:  # the captures are its rows, never another request's
                update.captures.append((r, result.captures))
            drafted, stood_before = len(r.verifying), r.drafts_accepted
            for (token, logprob, top), reason in r.take(fed, sampled.get(r.seq_id)):
                grammar_failed = reason == "error" and r.grammar is not None
                why = f"the output left its grammar: {r.grammar.error}" if grammar_failed else None
                update.outputs.append((r, RequestOutput(token, logprob, top, reason, why,
                                                        "grammar_failed" if grammar_failed else None)))
                if reason is not None:
                    self._retire(r, reason)
            self.speculator.verified(r, isinstance(entry.step, Decode), drafted, r.drafts_accepted - stood_before)
        return update

    def _prefix_miss(self, reqs: list[Request], error: PipelineError) -> Update:
        """A stage no longer keeps a prefix this micro-batch attached (it gave it up for room, or restarted): forget
        the prefixes these requests attached, release them, and run the micro-batch's requests as after a
        kv_full -- the started ones prefill again, looking the cache up anew."""
        for r in reqs:
            if r.starting and r.attach is not None and self.prefix is not None:
                self.prefix.discard(r.attach)
                self._release.append(r.attach)
        return Update(requeued=self._requeue_started(reqs), prefix_miss=str(error))

    def _requeue_started(self, reqs: list[Request]) -> list[Request]:
        """Nothing of this failed micro-batch counts: its running requests run the same step again (recomputing
        K/V at the same positions writes the same values); the ones it started go back to the front of the queue,
        released first (the stages before the failing one allocated them). Returns those."""
        started = []
        for r in reqs:
            r.feeding = 0
            if not r.done and r.starting:  # this micro-batch held its first chunk: it asked for a slot
                started.append(r)
            r.starting = False
        for r in reversed(started):
            del self.running[r.seq_id]
            self._unchain(r)
            self._release.append(r.seq_id)
            r.sent = False
            r.start_from(None, 0)
            self.waiting.appendleft(r)
        return started

    def _kv_full(self, reqs: list[Request], now: float) -> Update:
        """A stage had no free slot for a request this micro-batch started: slots the gateway does not know of are
        held there (a lease not yet expired, another gateway). Nothing of the micro-batch counts; the started ones
        wait at the front of the queue, and admission holds at the running requests (which fit) for
        KV_FULL_BACKOFF_S or until one ends."""
        started = self._requeue_started(reqs)
        self.kv_cap = len(self.running)
        self.kv_cap_until = now + KV_FULL_BACKOFF_S
        return Update(requeued=started, kv_full=True)
