"""--prefix-cache-audit as a client of one engine: for a drawn share of the cache hits the scheduler reports
(Update.hits), it submits two one-token twins of the request's prompt like any caller would -- `cached` may start
from a cached prefix as the request did, `full` computes everything (no_cache) -- reads their outputs, and compares
them (PrefixAudit). The policy keeps no audit state; the twins are the gateway's own, in no client's figures."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from services.gateway.engine.prefix_cache import AUDIT_TOP, AuditTolerance, PrefixAudit, PrefixStats
from services.gateway.engine.request import Request, RequestOutput, new_seq_id
from shared.batch.sampling import SamplingParams
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.scheduler")

# How far a recompute may move the top alternatives where the stages do not promise the very same numbers (another
# chunking, another batch, another thread count sum in another order); measured on SmolLM2, 600-1,400-token prompts:
AUDIT_TOLERANCE_F32 = AuditTolerance(1e-3)  # float32 activations on f32 weights, rounded only as float32 sums are:
# logprobs moved by up to 1e-5
AUDIT_TOLERANCE_ROUNDED = AuditTolerance(0.1, probabilities=True)  # kernels that round activations -- to 8 bits (the
# integer-dot kernels), to bfloat16 -- or bfloat16 / float16 stages: probabilities moved by up to 0.04 (logprobs of
# unlikely alternatives by up to 1.15)
AUDIT_DEADLINE_S = 600.0  # a twin still queued after this long ends with "timeout" (the audit counts as skipped)


def audit_tolerance(stages: list[StageInfo]) -> AuditTolerance:
    """How far a recompute may move the top alternatives, from the stages' /info: not at all on batch-invariant
    stages, float32's rounding of logprobs on float32 stages with f32 weights, rounded activations' of probabilities
    otherwise."""
    if stages and all(i.batch_invariant for i in stages):
        return AuditTolerance(0.0)
    exact = all(i.dtype == "float32" and i.weights_mode == "f32" for i in stages)
    return AUDIT_TOLERANCE_F32 if exact else AUDIT_TOLERANCE_ROUNDED


class PrefixAuditor:
    """Audits `rate` of the hits (a share, drawn from a seeded generator: a run audits the same hits again).
    submit(twin) queues a twin on the engine (False: the queue refused it); stats() is the prefix index's ledger the
    verdicts are counted in."""

    def __init__(self, rate: float, submit: Callable[[Request], bool], stats: Callable[[], PrefixStats]):
        self.rate = rate
        self.submit = submit
        self.stats = stats
        self.tolerance = AUDIT_TOLERANCE_F32  # audit_tolerance(the stages), kept current by the engine
        self._draw = random.Random(0).random

    def on_hit(self, req: Request, prefix_tokens: int, now: float) -> None:
        """A client's request attached a cached prefix: audit it when drawn."""
        if self._draw() >= self.rate:
            return
        audit = PrefixAudit(req.seq_id, prefix_tokens, self.tolerance)
        params = SamplingParams(logprobs=True, top_logprobs=AUDIT_TOP)
        for role in ("cached", "full"):
            twin = Request(seq_id=new_seq_id(), prompt_ids=list(req.prompt_ids), params=params, max_tokens=1,
                           deadline=now + AUDIT_DEADLINE_S, audit=audit, no_cache=role == "full",
                           cache_tenant=req.cache_tenant)
            setattr(audit, f"{role}_id", twin.seq_id)
            if not self.submit(twin):  # the queue is full: this hit goes unaudited
                self.stats().audit_skipped += 1
                return

    def on_output(self, twin: Request, out: RequestOutput) -> None:
        """What the engine reported for one twin; the verdict once both ended."""
        if out.finish_reason is None:
            return
        audit = twin.audit
        top = twin.top_logprobs[0] if out.finish_reason == "length" and twin.top_logprobs else None
        audit.results[twin.seq_id] = (twin.cached_tokens, top)
        if len(audit.results) < 2:
            return
        stats = self.stats()
        verdict = audit.compare()
        if verdict is None:
            stats.audit_skipped += 1
            return
        agree, _, how = verdict
        stats.audits += 1
        if not agree:
            stats.audit_mismatches += 1
            log.warning("prefix cache audit of request %s: a cached prefix and a recompute disagree: %s",
                        audit.request_id, how)
