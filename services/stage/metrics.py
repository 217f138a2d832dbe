"""Prometheus metrics of one stage (own registry, so several stages can live in one test process).

Counters the worker increments live here; values owned elsewhere (transport bytes and rejects, queue depth,
KV use) are read at scrape time by a collector, so there is one source of truth for each number."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.protocol import REJECT_REASONS


class _LiveCollector:
    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self):
        s = self.read()
        yield CounterMetricFamily("stagemesh_stage_bytes_in", "Bytes received", value=s["bytes_in"])
        yield CounterMetricFamily("stagemesh_stage_bytes_out", "Bytes sent", value=s["bytes_out"])
        yield CounterMetricFamily("stagemesh_stage_sending_seconds", "Seconds spent handing messages to the next hop",
                                  value=s["send_seconds"])
        rejected = CounterMetricFamily("stagemesh_stage_rejected_messages", "Malformed messages dropped, by reason",
                                       labels=["reason"])
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], s["rejected"].get(reason, 0))
        yield rejected
        failed = CounterMetricFamily("stagemesh_stage_handshakes_failed", "Failed CURVE/ZMTP handshakes, by direction "
                                     "(in: whoever reaches the input port; out: dialling the next hop)",
                                     labels=["direction"])
        for direction in ("in", "out"):
            failed.add_metric([direction], (s.get("handshakes_failed") or {}).get(direction, 0))
        yield failed
        yield GaugeMetricFamily("stagemesh_stage_queue_depth", "Prefetched inputs waiting for compute", value=s["queue_depth"])
        yield GaugeMetricFamily("stagemesh_stage_kv_slots_used", "KV cache slots held by live sequences",
                                value=s["kv_used"])
        yield GaugeMetricFamily("stagemesh_stage_kv_slots_cached", "KV cache slots kept as cached prefixes (the "
                                "gateway's prefix cache)", value=s.get("kv_kept", 0))
        yield CounterMetricFamily("stagemesh_stage_prefixes_evicted", "Cached prefixes this stage gave up because a new "
                                  "sequence found no free slot", value=s.get("kv_evicted", 0))
        yield GaugeMetricFamily("stagemesh_stage_kv_slots", "KV cache slots in total", value=s["kv_slots"])
        yield GaugeMetricFamily("stagemesh_stage_kv_resident_bytes", "K/V memory of the positions held slots have "
                                "written (the OS commits KV memory as it is written)", value=s.get("kv_resident_bytes", 0))
        yield GaugeMetricFamily("stagemesh_stage_bubble_ratio",
                                "Share of the compute loop's time spent waiting for input since start "
                                "(windowed: rate(waiting) / (rate(waiting) + rate(busy)))", value=s["bubble_ratio"])


# Micro-batch sizes (tokens) grouped into a few classes, so compute time per size is one bounded label.
SIZE_CLASSES = ((1, "1"), (8, "2-8"), (32, "9-32"), (128, "33-128"), (512, "129-512"))
LARGEST_CLASS = "513+"
COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


def size_class(tokens: int) -> str:
    return next((name for top, name in SIZE_CLASSES if tokens <= top), LARGEST_CLASS)


class StageMetrics:
    def __init__(self, read_live: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.microbatches = Counter("stagemesh_stage_microbatches", "Micro-batches computed", registry=r)
        self.tokens = Counter("stagemesh_stage_tokens", "Tokens computed", registry=r)
        self.busy = Counter("stagemesh_stage_busy_seconds", "Seconds spent computing", registry=r)
        self.waiting = Counter("stagemesh_stage_waiting_for_input_seconds",
                               "Seconds the compute loop waited for input", registry=r)
        self.reclaimed = Counter("stagemesh_stage_slots_reclaimed",
                                 "KV slots released because their lease expired (no micro-batch used them within "
                                 "--slot-lease)", registry=r)
        self.errors = Counter("stagemesh_stage_microbatch_errors", "Micro-batches that failed on this stage", registry=r)
        self.compute = Histogram("stagemesh_stage_compute_seconds", "Compute time per micro-batch, by its size in tokens",
                                 ["tokens"], buckets=COMPUTE_BUCKETS, registry=r)
        for _, name in (*SIZE_CLASSES, (0, LARGEST_CLASS)):
            self.compute.labels(name)
        self.hop = Histogram("stagemesh_stage_hop_latency_seconds",
                             "Upstream sender's send to this stage's receipt of a micro-batch", buckets=HOP_BUCKETS,
                             registry=r)
        r.register(_LiveCollector(read_live))
