"""Several pipelines (replicas) behind one gateway, and the one place that picks which runs a request.

Each Replica is a Pipeline with its own Engine and Scheduler (and that scheduler's KV slots and PrefixIndex); they serve the
same model. Routing follows SGLang's cache_aware policy, in this order:

1. balance: when the busiest ready replica's load exceeds the idlest's by more than BALANCE_ABS and by a factor of
   more than BALANCE_REL, the request goes to the idlest (a hot prefix or session cannot pile up on one replica);
2. session: a request naming a session (OpenAI's `user`, or the X-Stagemesh-Session header) goes where that session
   went last, unless that replica is not ready;
3. prefix: the replica whose prefix index holds the longest prefix of the prompt, when that prefix covers at least
   CACHE_THRESHOLD of it (ties: the lower load);
4. load: else the least loaded (ties in turn, so an idle gateway still spreads distinct prompts).

A replica's load is its queued plus running sequences. A replica that is not ready (a stage lost, inconsistent, or
a stalled micro-batch) takes no new request until it is ready again, and hands its open sequences to a ready one
(Engine's handoff, which the gateway's composition points at Replicas.take_over), which replays them from their token history. Every decision is counted
by reason and pipeline (stagemesh_gateway_routing_decisions_total)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from services.gateway.engine.balance import SPLIT_AUTO_WAITING
from services.gateway.engine.core import Engine
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.pipeline import Pipeline
from services.gateway.engine.request import Request
from services.gateway.engine.scheduler import Scheduler

log = logging.getLogger("stagemesh.gateway.replicas")

CACHE_THRESHOLD = 0.5  # a prefix hit routes by cache when it covers at least this share of the prompt (SGLang's 0.5)
BALANCE_ABS = 4  # the load gap (sequences) above which the idlest replica is chosen, if also ...
BALANCE_REL = 1.5  # ... the busiest carries more than this factor of the idlest's load (SGLang's 32 / 1.0001: ours
#                   are small replicas of a few KV slots, so the gap is a few sequences)
MAX_SESSIONS = 10_000  # sessions remembered (least recently used forgotten first)
REASONS = ("balance", "session", "prefix", "load", "failover")
SESSION_HEADER = "X-Stagemesh-Session"


@dataclass
class Replica:
    name: str  # "p0", "p1", ...: the `pipeline` label of the metrics, the mesh view and the access log
    pipeline: Pipeline
    engine: Engine  # the loop around its scheduler: what requests are submitted to
    # its ledger, exported as stagemesh_gateway_routing_decisions and _replica_handoffs (services/gateway/engine/metrics.py):
    routed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))  # requests routed here, by reason
    handed_off: int = 0  # open requests it handed to another replica after losing a stage

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def routed_total(self) -> int:
        """Requests routed here (handed-over ones included)."""
        return sum(self.routed.values())

    @property
    def load(self) -> int:
        """Requests it holds: queued and running (what a new request waits behind)."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def kv_used_ratio(self) -> float:
        """Share of its KV slots held by running sequences (cached prefixes give theirs up to a new request, as
        vLLM counts cached blocks free)."""
        return len(self.scheduler.running) / max(1, self.pipeline.kv_slots)

    def matched(self, ids: list[int], tenant: str = "") -> int:
        """Prompt tokens its prefix index could reuse for ids (0 with the cache off)."""
        return self.scheduler.prefix.matched(ids, tenant) if self.scheduler.prefix is not None else 0


class Replicas:
    """The gateway's pipelines; what the handlers call instead of one scheduler (submit, cancel, finish)."""

    def __init__(self, replicas: list[Replica], metrics: GatewayMetrics):
        if not replicas:
            raise ValueError("at least one pipeline")
        self.all = replicas
        self.metrics = metrics
        self.by_name = {r.name: r for r in replicas}
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica name it went to last
        self._turn = 0  # round-robin among equally loaded replicas
        for r in replicas:
            if len(replicas) > 1:
                r.pipeline.name = r.name

    # ---- state across replicas ---------------------------------------------------------------------------------

    @property
    def ready(self) -> list[Replica]:
        """The replicas that serve: the pipeline ready and its split chosen (--split auto)."""
        return [r for r in self.all if r.pipeline.ready and r.engine.mesh.split_settled]

    @property
    def problem(self) -> str | None:
        """None when some replica serves; otherwise every replica's problem, named."""
        if self.ready:
            return None

        def why(r: Replica) -> str | None:
            return r.pipeline.problem or (None if r.engine.mesh.split_settled else SPLIT_AUTO_WAITING)

        if len(self.all) == 1:
            return why(self.all[0])
        return "; ".join(f"pipeline {r.name}: {why(r)}" for r in self.all)

    @property
    def max_seq_len(self) -> int:
        """The context every replica serves (the smallest of those known)."""
        return min((r.pipeline.max_seq_len for r in self.all if r.pipeline.max_seq_len), default=0)

    @property
    def live_positions(self) -> int | None:
        """The positions one request may hold on every replica's stages (the smallest bound; None: no bound)."""
        return min((p for r in self.all if (p := r.pipeline.live_positions) is not None), default=None)

    @property
    def idle(self) -> bool:
        return all(r.scheduler.idle for r in self.all)

    def owner(self, req: Request) -> Engine:
        return self.by_name[req.pipeline].engine if req.pipeline in self.by_name else self.all[0].engine

    # ---- routing -----------------------------------------------------------------------------------------------

    def route(self, ids: list[int], session: str | None = None, tenant: str = "",
              exclude: Replica | None = None) -> tuple[Replica, str]:
        """The replica for a prompt and why (one of REASONS but "failover"). Not-ready replicas are skipped while
        any is ready."""
        candidates = [r for r in self.ready if r is not exclude] or [r for r in self.all if r is not exclude]
        if len(candidates) == 1:
            return candidates[0], "load"
        loads = {r.name: r.load for r in candidates}
        low, high = min(loads.values()), max(loads.values())
        idlest = [r for r in candidates if loads[r.name] == low]
        if high - low > BALANCE_ABS and high > BALANCE_REL * low:
            return self._next(idlest), "balance"
        if session is not None and (name := self.sessions.get(session)) is not None:
            r = self.by_name[name]
            if r in candidates:
                return r, "session"
        if ids:
            matched = {r.name: r.matched(ids, tenant) for r in candidates}
            best = max(matched.values())
            if best and best >= CACHE_THRESHOLD * len(ids):
                holders = [r for r in candidates if matched[r.name] == best]
                return min(holders, key=lambda r: loads[r.name]), "prefix"
        return self._next(idlest), "load"

    def _next(self, tied: list[Replica]) -> Replica:
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _count(self, replica: Replica, reason: str, session: str | None) -> None:
        replica.routed[reason] += 1
        if session is not None:
            self.sessions[session] = replica.name
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)

    def submit(self, req: Request, session: str | None = None) -> Replica:
        """Route and queue a new request (QueueFull from the chosen replica's scheduler)."""
        replica, reason = self.route(req.all_ids, session, req.cache_tenant)
        req.pipeline = replica.name
        replica.engine.submit(req)
        self._count(replica, reason, session)
        return replica

    def take_over(self, reqs: list[Request], source: Replica) -> list[Request]:
        """`source` is not ready: give its open sequences to ready replicas, which replay them from their token
        history (running ones before queued ones). Returns those placed; none when no other replica is ready."""
        if not any(r is not source for r in self.ready):
            return []
        for req in reqs:
            target, _ = self.route(req.all_ids, tenant=req.cache_tenant, exclude=source)
            log.warning("pipeline %s is not ready (%s): request %s replays on pipeline %s", source.name,
                        source.pipeline.problem, req.seq_id, target.name)
            req.pipeline = target.name
            req.handoffs += 1
            target.engine.adopt(req)
            self._count(target, "failover", None)
        source.handed_off += len(reqs)
        return reqs

    # ---- what the handlers call --------------------------------------------------------------------------------

    def cancel(self, req: Request) -> None:
        self.owner(req).cancel(req)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        self.owner(req).finish(req, reason, error)

    def shutdown(self, message: str = "the gateway is shutting down") -> int:
        return sum(r.engine.shutdown(message) for r in self.all)

    def info(self) -> list[dict]:
        """Each replica's routing facts (the mesh view and /ready)."""
        return [{"name": r.name, "ready": r.pipeline.ready, "problem": r.pipeline.problem, "load": r.load,
                 "queue": len(r.scheduler.waiting), "running": len(r.scheduler.running),
                 "kv_used_ratio": round(r.kv_used_ratio(), 4), "routed": r.routed_total, "handed_off": r.handed_off, "stages": r.pipeline.stage_urls} for r in self.all]

    @staticmethod
    def policy() -> dict[str, float]:
        """The routing thresholds, as exported on /metrics (stagemesh_gateway_routing_threshold)."""
        return {"cache_threshold": CACHE_THRESHOLD, "balance_abs": BALANCE_ABS, "balance_rel": BALANCE_REL}
