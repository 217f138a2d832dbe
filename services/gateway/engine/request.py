"""One generation request as the gateway tracks it (Request), and what the scheduler reports for it
(RequestOutput).

A Request is a SequenceState (shared/runtime/generation.py: its tokens and how many of them the pipeline holds) plus what
the gateway adds, by concern: where and how it is scheduled (deadline, replica, replays, the scheduler's
bookkeeping of its micro-batch in flight), its timings (RequestTimes), its activation captures when traced
(TraceCapture) and its distributed-tracing span (RequestSpan). The scheduler's policy writes only the first two; the
engine loop writes the telemetry, from what the policy returns. Its outputs go to the
engine's on_output, not to a field of it: what a client reads is the front end's RequestHandle and EventLog
(services/gateway/frontend/events.py), which outlive any one connection."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.engine.drafts import RequestDrafts
from services.gateway.engine.prefix_cache import PrefixAudit
from shared.batch.sampling import TopLogprobs
from shared.runtime.generation import SequenceState

CAPTURE_OVERHEAD_BYTES = 256  # what one capture costs the trace budget besides its data: its summary and names


@dataclass
class RequestOutput:
    """What the scheduler reports for one request: a sampled token, the end, or both.
    finish_reason "stop" means the token is a stop id (EOS): it ends the request and is never shown."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None  # (token id, logprob) alternatives, most likely first, when asked
    finish_reason: str | None = None  # stop | length | cancelled | timeout | error
    error: str | None = None
    code: str | None = None  # an error's own code where it is not the finish reason (grammar_failed: the request's)


def new_seq_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class RequestTimes:
    """perf_counter times of its life; None until reached."""

    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # first admitted (a re-admission after a kv_full keeps the first)
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class TraceCapture:
    """A traced request's activation captures (wire form), within its byte budget (GatewayConfig.trace_budget)."""

    budget: int
    captures: list[dict] = field(default_factory=list)
    bytes: int = 0  # collected so far: once at the budget, its micro-batches ask for no more captures

    @property
    def collecting(self) -> bool:
        return self.bytes < self.budget

    @property
    def truncated(self) -> bool:
        """The budget ran out: the captures stop at some step."""
        return self.bytes >= self.budget

    def take(self, captures: list[dict]) -> None:
        """Keep the captures of its own rows (the stages captured only them), counted against its budget."""
        self.captures.extend(captures)
        self.bytes += sum(len(c.get("data") or b"") + CAPTURE_OVERHEAD_BYTES for c in captures)


@dataclass
class RequestSpan:
    """Its stagemesh.request span (distributed tracing on; shared.observe.otlp), which travels with it between replicas."""

    span: Any
    traceparent: str  # that span's W3C traceparent, carried on each of its micro-batch entries
    parented: int = 0  # stagemesh.microbatch spans this request's trace holds (the rest only link to it)


@dataclass(eq=False)
class Request(SequenceState):
    """A client's generation request (or one of the gateway's own audit twins) on its way through a pipeline."""

    # scheduling
    deadline: float = math.inf  # perf_counter time after which the request fails with "timeout"
    pipeline: str = ""  # the replica running it (services/gateway/engine/replicas.py; "" before routing)
    # its chain in a mesh with replicas of a stage: the instance ids after the first range its micro-batches go
    # through (services/gateway/engine/chains.py), fixed from admission while it runs (None: no replicas)
    chain: tuple[str, ...] | None = None
    handoffs: int = 0  # times it moved to another replica because its own lost a stage
    replays: int = 0  # replays started: counted when its first replay micro-batch is planned
    cached_tokens: int = 0  # prompt tokens a cached prefix supplied (usage.prompt_tokens_details.cached_tokens)
    cache_tenant: str = ""  # whose cached prefixes it may use and add to ("": the shared tenant; PrefixIndex.chain)
    prediction_ids: list[int] | None = None  # the output the client expects, tokenized: drafts (speculation.py)
    speculation: bool = True  # n-gram drafts may serve it (the client's "speculation": false opts out)
    drafts: RequestDrafts = field(default_factory=RequestDrafts)  # its drafting state: budget, context index, ...
    audit: PrefixAudit | None = None  # set on the gateway's own twins that check a cache hit (no client reads them)
    admitted: bool = False  # admitted once (a re-admission after a kv_full is not a new admission)
    no_cache: bool = False  # admitted without a prefix-cache lookup (the audit's recomputing twin)
    # the scheduler's bookkeeping of its micro-batch in flight (a request sits in at most one)
    feeding: int = 0  # tokens in the micro-batch now in flight (0: not in flight)
    starting: bool = False  # ... and that micro-batch holds its first chunk (it allocates the slot on every stage)
    sent: bool = False  # a micro-batch of it was planned since its last release: stages may hold a slot for it
    replay_due: bool = False  # reset for replay, that micro-batch not planned yet
    # the telemetry around it (what the client reads is the front end's: services/gateway/frontend/events.py)
    times: RequestTimes = field(default_factory=RequestTimes)
    capture: TraceCapture | None = None  # set when traced
    span: RequestSpan | None = None  # set while its stagemesh.request span is open (the engine loop's)

    @property
    def in_flight(self) -> bool:
        return self.feeding > 0

    @property
    def traced(self) -> bool:
        return self.capture is not None

    @property
    def tracing(self) -> bool:
        """Its next micro-batch asks the stages for captures: traced, and under its capture budget."""
        return self.capture is not None and self.capture.collecting

    def reset_for_replay(self) -> None:
        """Prefill the history again. Every loss noticed before the replay is planned (a stage's death, then its
        restart under a new incarnation) is one replay: `replays` counts when its micro-batch is planned."""
        super().reset_for_replay()
        self.feeding = 0
        self.replay_due = True
