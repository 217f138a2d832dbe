"""Prometheus metrics of one stage (own registry, so several stages can live in one test process).

Counters the worker increments live here; values owned elsewhere (transport bytes and rejects, queue depth,
KV use) are read at scrape time by a collector, so there is one source of truth for each number."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
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
        yield GaugeMetricFamily("stagemesh_stage_queue_depth", "Prefetched inputs waiting for compute", value=s["queue_depth"])
        yield GaugeMetricFamily("stagemesh_stage_kv_slots_used", "KV cache slots held by live sequences", value=s["kv_used"])
        yield GaugeMetricFamily("stagemesh_stage_kv_slots", "KV cache slots in total", value=s["kv_slots"])


class StageMetrics:
    def __init__(self, read_live: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.microbatches = Counter("stagemesh_stage_microbatches", "Micro-batches computed", registry=r)
        self.tokens = Counter("stagemesh_stage_tokens", "Tokens computed", registry=r)
        self.busy = Counter("stagemesh_stage_busy_seconds", "Seconds spent computing", registry=r)
        self.waiting = Counter("stagemesh_stage_waiting_for_input_seconds",
                               "Seconds the compute loop waited for input", registry=r)
        self.errors = Counter("stagemesh_stage_microbatch_errors", "Micro-batches that failed on this stage", registry=r)
        r.register(_LiveCollector(read_live))
