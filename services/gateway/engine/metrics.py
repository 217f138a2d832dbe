"""Prometheus metrics of the gateway (own registry per app)."""

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.gateway.engine.prefix_cache import PrefixStats
from services.gateway.engine.speculator import SOURCES, Speculator
from shared.wire.protocol import REJECT_REASONS
from shared.wire.transport import TransportStats

REJECT_STATUSES = ("400", "401", "403", "404", "408", "413", "429", "500", "503")
OUTCOMES = ("stop", "length", "cancelled", "timeout", "error")
# failed: a commit not confirmed, the pipeline's state declared lost; recommitted: that commit, sent again, reached
# every stage (the mesh is in the new split)
RESPLIT_OUTCOMES = ("done", "refused", "failed", "recommitted")
RESPLIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300)
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stagemesh_gateway_requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.rejected = Counter("stagemesh_gateway_rejected_requests", "Requests refused at the edge", ["status"], registry=r)
        for status in REJECT_STATUSES:  # exported from the start, so rate() over them works before the first reject
            self.rejected.labels(status)
        self.queue_depth = Gauge("stagemesh_gateway_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("stagemesh_gateway_running_sequences", "Sequences holding KV slots", registry=r)
        self.inflight = Gauge("stagemesh_gateway_microbatches_in_flight", "Micro-batches in the pipeline now", registry=r)
        self.inflight_max = Gauge("stagemesh_gateway_microbatches_in_flight_max",
                                  "Most micro-batches ever in the pipeline at once", registry=r)
        self.microbatches = Counter("stagemesh_gateway_microbatches", "Micro-batches sent", registry=r)
        self.ttft = Histogram("stagemesh_gateway_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("stagemesh_gateway_inter_token_latency_seconds", "Gap between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("stagemesh_gateway_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("stagemesh_gateway_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.e2e = Histogram("stagemesh_gateway_e2e_latency_seconds", "Arrival to the last token of a finished request",
                             buckets=E2E_BUCKETS, registry=r)
        self.failovers = Counter("stagemesh_gateway_pipeline_failovers",
                                 "Times the pipeline's KV state was lost (a stage died or restarted)", registry=r)
        self.replayed = Counter("stagemesh_gateway_replayed_sequences",
                                "Running sequences replayed from their token history after a failover", registry=r)
        self.kv_full_requeued = Counter("stagemesh_gateway_kv_full_requeued_sequences",
                                        "New sequences sent back to the queue because a stage's KV slots were full",
                                        registry=r)
        self.unexpected_results = Counter("stagemesh_gateway_unexpected_results",
                                          "Results and errors for micro-batches not in flight (late after a failover, "
                                          "or forged by a key holder), dropped", registry=r)
        self.result_hop = Histogram("stagemesh_gateway_result_hop_latency_seconds",
                                    "Last stage's send to the gateway's receipt of a result", buckets=HOP_BUCKETS,
                                    registry=r)
        self.unknown_sequence_failovers = Counter(
            "stagemesh_gateway_unknown_sequence_failovers",
            "Failovers because a stage answered unknown_sequence (it restarted between health polls, or a holder of "
            "the last stage's key forged the answer)", registry=r)
        self.resplits = Counter("stagemesh_gateway_resplits", "Live re-splits of a pipeline (layers moved between "
                                "stages with their K/V) by outcome", ["outcome", "trigger"], registry=r)
        for o in RESPLIT_OUTCOMES:
            for trigger in ("asked", "auto", "split-auto"):  # rebalance / --auto-rebalance / --split auto at start
                self.resplits.labels(o, trigger)
        self.replacements = Counter("stagemesh_gateway_stage_replacements", "Stage processes that took another's "
                                    "place in a pipeline (POST /v1/mesh/replace) by outcome", ["outcome"], registry=r)
        for o in ("done", "refused"):
            self.replacements.labels(o)
        self.resplit_pause = Histogram("stagemesh_gateway_resplit_pause_seconds", "How long a re-split held the "
                                       "pipeline's micro-batches (drain, load, K/V move, flip)",
                                       buckets=RESPLIT_BUCKETS, registry=r)
        self.resplit_kv_bytes = Counter("stagemesh_gateway_resplit_kv_bytes", "K/V bytes re-splits moved between "
                                        "stages", registry=r)
        self.pipeline_ready = Gauge("stagemesh_gateway_pipeline_ready", "1 when every stage is ready and consistent",
                                    registry=r)


class _ResultPortCollector:
    """What the gateway's own sockets refused, read at scrape time from its transport (one source of truth): messages
    dropped at the result port by reason, and failed handshakes per direction ("in": anyone reaching the result port;
    "out": dialling stage 0)."""

    def __init__(self, stats: Callable[[], TransportStats | None]):
        self.stats = stats

    def collect(self):
        s = self.stats() or TransportStats()  # no client yet: zeros, so the series exist from the start
        rejected = CounterMetricFamily("stagemesh_gateway_result_port_rejected_messages",
                                       "Messages the gateway's result port dropped, by reason", labels=["reason"])
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], s.rejected.get(reason, 0))
        yield rejected
        failed = CounterMetricFamily("stagemesh_gateway_handshakes_failed",
                                     "Failed CURVE/ZMTP handshakes on the gateway's sockets", labels=["direction"])
        for direction in ("in", "out"):
            failed.add_metric([direction], s.handshakes_failed[direction])
        yield failed


def watch_transport(metrics: GatewayMetrics, stats: Callable[[], TransportStats | None]) -> None:
    metrics.registry.register(_ResultPortCollector(stats))


def summed_transport(pipelines: list) -> Callable[[], TransportStats | None]:
    """The result ports of several pipelines' clients, added up (one pipeline: its own stats object)."""
    def stats() -> TransportStats | None:
        own = [p.client.transport.stats for p in pipelines if p.client is not None]
        if len(own) <= 1:
            return own[0] if own else None
        total = TransportStats()
        for s in own:
            for reason, n in s.rejected.items():
                total.rejected[reason] = total.rejected.get(reason, 0) + n
            for direction, n in s.handshakes_failed.items():
                total.handshakes_failed[direction] += n
        return total
    return stats


class _PrefixCacheCollector:
    """The prefix cache indexes' counters (services/gateway/engine/prefix_cache.py), summed over the replicas, read at
    scrape time."""

    def __init__(self, indexes: list):
        self.indexes = indexes

    def collect(self):
        s = PrefixStats(**{k: sum(getattr(i.stats, k) for i in self.indexes) for k in vars(PrefixStats())})
        yield CounterMetricFamily("stagemesh_gateway_prefix_cache_lookups", "Admitted requests looked up in the prefix "
                                  "cache", value=s.lookups)
        yield CounterMetricFamily("stagemesh_gateway_prefix_cache_hits", "Requests that started from a cached prefix",
                                  value=s.hits)
        yield CounterMetricFamily("stagemesh_gateway_prefix_cache_reused_tokens", "Prompt tokens a cached prefix "
                                  "supplied (not computed)", value=s.cached_tokens)
        yield CounterMetricFamily("stagemesh_gateway_prefix_cache_evictions", "Cached prefixes released for room",
                                  value=s.evicted)
        yield CounterMetricFamily("stagemesh_gateway_prefix_cache_misses", "Cached prefixes a stage no longer kept "
                                  "(prefix_miss: the request prefilled in full)", value=s.misses)
        audits = CounterMetricFamily("stagemesh_gateway_prefix_cache_audits", "Cache hits checked against a "
                                     "recompute (--prefix-cache-audit), by result", labels=["result"])
        for result, value in (("match", s.audits - s.audit_mismatches), ("mismatch", s.audit_mismatches),
                              ("skipped", s.audit_skipped)):
            audits.add_metric([result], value)
        yield audits
        yield GaugeMetricFamily("stagemesh_gateway_prefix_cache_prefixes", "Finished sequences every stage keeps as "
                                "cached prefixes", value=sum(len(i) for i in self.indexes))
        yield GaugeMetricFamily("stagemesh_gateway_prefix_cache_tokens", "Tokens the cached prefixes hold",
                                value=sum(i.cached_tokens for i in self.indexes))


def watch_prefix_cache(metrics: GatewayMetrics, indexes: list) -> None:
    metrics.registry.register(_PrefixCacheCollector(indexes))


class _SpeculationCollector:
    """What drafting did (services/gateway/engine/speculator.py, SpeculationStats), read at scrape time: drafted and
    accepted tokens and verifying steps by source, every decode step and the tokens they produced (tokens per pass),
    the hit rate, the time spent drafting and the n-gram pool's fill."""

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def collect(self):
        s = self.speculator.stats
        by_source = {
            "drafted": CounterMetricFamily("stagemesh_gateway_speculation_drafted_tokens", "Drafted tokens verified in "
                                           "decode steps, by source (prediction, context, pool)", labels=["source"]),
            "accepted": CounterMetricFamily("stagemesh_gateway_speculation_accepted_tokens", "Drafted tokens that "
                                            "stood (each a token a pass produced beyond its one), by source",
                                            labels=["source"]),
            "verify_steps": CounterMetricFamily("stagemesh_gateway_speculation_verify_steps", "Sequences' decode "
                                                "steps that verified a draft, by source", labels=["source"]),
        }
        for key, family in by_source.items():
            for source in SOURCES:
                family.add_metric([source], getattr(s, key)[source])
            yield family
        yield CounterMetricFamily("stagemesh_gateway_speculation_decode_steps", "Sequences' decode steps (one a "
                                  "sequence a pass), with or without a draft", value=s.decode_steps)
        yield CounterMetricFamily("stagemesh_gateway_speculation_decode_tokens", "Tokens those decode steps produced "
                                  "(one each, and the drafted ones that stood)", value=s.decode_tokens)
        yield CounterMetricFamily("stagemesh_gateway_speculation_draft_seconds", "Time the gateway spent making "
                                  "drafts", value=s.draft_seconds)
        yield GaugeMetricFamily("stagemesh_gateway_speculation_tokens_per_pass", "Tokens a sequence's decode step "
                                "produced on average since the start (1 without speculation)",
                                value=s.tokens_per_pass or 0.0)
        yield GaugeMetricFamily("stagemesh_gateway_speculation_hit_ratio", "Drafted tokens that stood, of all "
                                "drafted, since the start", value=s.hit_rate or 0.0)
        pool = self.speculator.pool
        yield GaugeMetricFamily("stagemesh_gateway_speculation_pool_used_entries", "Entries of the n-gram pool "
                                "ever written (of stagemesh_gateway_speculation_pool_entries)",
                                value=pool.used if pool is not None else 0)
        yield GaugeMetricFamily("stagemesh_gateway_speculation_pool_entries", "The n-gram pool's fixed size (0: "
                                "--speculation off)", value=len(pool) if pool is not None else 0)


def watch_speculation(metrics: GatewayMetrics, speculator: Speculator) -> None:
    metrics.registry.register(_SpeculationCollector(speculator))


class _ReplicaCollector:
    """Per-pipeline gauges and counters (label `pipeline`) and the routing policy's thresholds, read at scrape time
    from the Replicas (services/gateway/engine/replicas.py): each Replica's routing counts are its own ledger, kept once."""

    def __init__(self, replicas):
        self.replicas = replicas

    def collect(self):
        fams = {
            "ready": GaugeMetricFamily("stagemesh_gateway_replica_ready", "1 when the pipeline serves new requests",
                                       labels=["pipeline"]),
            "queue": GaugeMetricFamily("stagemesh_gateway_replica_queue_depth", "Requests waiting in the pipeline's "
                                       "scheduler", labels=["pipeline"]),
            "running": GaugeMetricFamily("stagemesh_gateway_replica_running_sequences", "Sequences running on the "
                                         "pipeline", labels=["pipeline"]),
            "kv_used": GaugeMetricFamily("stagemesh_gateway_replica_kv_used_ratio", "Share of the pipeline's KV slots "
                                         "held by running sequences (cached prefixes give theirs up)",
                                         labels=["pipeline"]),
            "hit_rate": GaugeMetricFamily("stagemesh_gateway_replica_prefix_cache_hit_ratio", "Share of the "
                                          "pipeline's admitted requests that started from a cached prefix",
                                          labels=["pipeline"]),
        }
        for r in self.replicas.all:
            s, prefix = r.scheduler, r.scheduler.prefix
            fams["ready"].add_metric([r.name], 1 if r.pipeline.ready else 0)
            fams["queue"].add_metric([r.name], len(s.waiting))
            fams["running"].add_metric([r.name], len(s.running))
            fams["kv_used"].add_metric([r.name], r.kv_used_ratio())
            if prefix is not None and prefix.stats.lookups:
                fams["hit_rate"].add_metric([r.name], prefix.stats.hits / prefix.stats.lookups)
        yield from fams.values()
        routing = CounterMetricFamily("stagemesh_gateway_routing_decisions", "Requests routed to a pipeline, by reason "
                                      "(balance, session, prefix, load; failover: handed over from a pipeline that "
                                      "lost a stage)", labels=["reason", "pipeline"])
        handoffs = CounterMetricFamily("stagemesh_gateway_replica_handoffs", "Open sequences a pipeline that lost a "
                                       "stage handed to another pipeline (replayed there)", labels=["pipeline"])
        for r in self.replicas.all:
            for reason, n in r.routed.items():
                if n:  # a series per (reason, pipeline) once it was chosen for that reason
                    routing.add_metric([reason, r.name], n)
            handoffs.add_metric([r.name], r.handed_off)
        yield routing
        yield handoffs
        thresholds = GaugeMetricFamily("stagemesh_gateway_routing_threshold", "The routing policy's thresholds "
                                       "(docs/operations.md, Routing across pipelines)", labels=["threshold"])
        for name, value in self.replicas.policy().items():
            thresholds.add_metric([name], value)
        yield thresholds


# What an InferencePool's endpoint picker (Gateway API Inference Extension, llm-d) reads from each gateway pod: its
# model server protocol's queued / running / KV-use gauges, under the vLLM names its picker reads by default
# (--total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric; the KV name
# before vLLM v1 too). k8s/components/inference-pool names them in its picker's flags.
POOL_METRICS = {
    "queued": ("vllm:num_requests_waiting", "Requests waiting in the schedulers of every pipeline"),
    "running": ("vllm:num_requests_running", "Sequences running on every pipeline"),
    "kv": ("vllm:kv_cache_usage_perc", "Share of the serving pipelines' KV slots in use (0 to 1)"),
    "kv_legacy": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its name before vLLM v1"),
}


class _PoolCollector:
    """The gateway as one model server for an endpoint picker: queue and running summed over its pipelines, KV use as
    the held share of the ready pipelines' slots (all pipelines' when none is ready)."""

    def __init__(self, replicas):
        self.replicas = replicas

    def collect(self):
        every = self.replicas.all
        serving = [r for r in every if r.pipeline.ready] or every
        held = sum(r.kv_used_ratio() * max(1, r.pipeline.kv_slots) for r in serving)
        values = {"queued": sum(len(r.scheduler.waiting) for r in every),
                  "running": sum(len(r.scheduler.running) for r in every),
                  "kv": held / sum(max(1, r.pipeline.kv_slots) for r in serving)}
        values["kv_legacy"] = values["kv"]
        for key, (name, doc) in POOL_METRICS.items():
            yield GaugeMetricFamily(name, doc, value=values[key])


BACKLOG_WINDOW_S = 60.0  # the throughput "seconds of backlog" divides by: generated tokens over about this long


class BacklogMeter:
    """Seconds of backlog (issue 68: what KEDA or an HPA scales a mesh by, the signal llm-d recommends): the tokens
    still to generate -- each running and each queued request's max_tokens less what it already generated, an upper
    bound (a request that stops early needs fewer) -- over the throughput measured from the generated-tokens counter
    over the last BACKLOG_WINDOW_S (pure arithmetic: `read` is handed the time and the counter, at scrape time).

    Until a throughput was measured (a window of two readings with tokens generated between them) the backlog counts at
    1 token/s: a large number that says "scale up" where 0 would say "idle". A window with no token generated while
    there is a backlog (a stalled mesh) keeps the last throughput measured."""

    def __init__(self, window_s: float = BACKLOG_WINDOW_S):
        self.window_s = window_s
        self._readings: list[tuple[float, float]] = []  # (time, generated tokens so far), oldest first, within window_s
        self.throughput: float | None = None  # tokens/s of the last window that generated any (None: none yet)

    def read(self, now: float, generated: float, backlog_tokens: float) -> float:
        """The seconds of backlog at `now`, the counter reading `generated` then."""
        self._readings.append((now, generated))
        while len(self._readings) > 2 and self._readings[1][0] <= now - self.window_s:
            self._readings.pop(0)  # the oldest kept is the last one at least window_s old (a whole window)
        (t0, g0), (t1, g1) = self._readings[0], self._readings[-1]
        if t1 > t0 and g1 > g0:
            self.throughput = (g1 - g0) / (t1 - t0)
        if backlog_tokens <= 0:
            return 0.0
        return backlog_tokens / (self.throughput or 1.0)


def backlog_tokens(schedulers) -> int:
    """Tokens the schedulers' running and queued requests may still generate (max_tokens less those generated)."""
    return sum(max(0, r.max_tokens - len(r.output_ids)) for s in schedulers for r in (*s.running.values(), *s.waiting))


class _BacklogCollector:
    """The backlog gauges, read at scrape time from every pipeline's scheduler and the generated-tokens counter."""

    def __init__(self, metrics: GatewayMetrics, schedulers, clock: Callable[[], float]):
        self.metrics, self.schedulers, self.clock = metrics, schedulers, clock
        self.meter = BacklogMeter()

    def collect(self):
        tokens = backlog_tokens(self.schedulers)
        generated = next(x.value for x in self.metrics.generated_tokens.collect()[0].samples if x.name.endswith("_total"))
        seconds = self.meter.read(self.clock(), generated, tokens)
        yield GaugeMetricFamily("stagemesh_gateway_backlog_tokens", "Tokens the running and queued requests may still "
                                "generate (each one's max_tokens less what it generated: an upper bound)", value=tokens)
        yield GaugeMetricFamily("stagemesh_gateway_backlog_seconds", "Seconds of backlog: backlog tokens over the "
                                f"tokens/s generated over the last {BACKLOG_WINDOW_S:g} s (1 token/s until measured); "
                                "what KEDA or an HPA scales stage pods by", value=seconds)
        yield GaugeMetricFamily("stagemesh_gateway_throughput_tokens_per_second", "Generated tokens/s the backlog is "
                                "measured against (0: not measured yet)", value=self.meter.throughput or 0.0)


def watch_replicas(metrics: GatewayMetrics, replicas) -> None:
    """Per-pipeline gauges, the endpoint picker's gauges, and the gateway-wide ones summed over the replicas (each
    scheduler sets its own)."""
    metrics.registry.register(_ReplicaCollector(replicas))
    metrics.registry.register(_PoolCollector(replicas))
    scheds = [r.scheduler for r in replicas.all]
    metrics.registry.register(_BacklogCollector(metrics, scheds, time.monotonic))
    metrics.queue_depth.set_function(lambda: sum(len(s.waiting) for s in scheds))
    metrics.running.set_function(lambda: sum(len(s.running) for s in scheds))
    metrics.inflight.set_function(lambda: sum(len(s.inflight) for s in scheds))
    metrics.inflight_max.set_function(lambda: max(s.max_inflight_seen for s in scheds))
