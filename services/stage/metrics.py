"""Prometheus metrics of one stage, read at scrape time from the stage's ledger (services/stage/stats.py) and from
the owners of its state (KV cache, prefetch inbox): nothing is counted here, so /metrics and /info report the same
numbers. Each stage has its own registry, so several stages can live in one test process."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from services.stage.stats import StageStats, Timings
from shared.models.kv_cache import KVCache
from shared.wire.protocol import REJECT_REASONS


def _buckets(t: Timings) -> list[tuple[str, int]]:
    return [(floatToGoString(bound), n) for bound, n in t.cumulative()]


class StageCollector:
    """Every stage metric, from `stats` (the ledger), `kv` (its slots) and `queue_depth` (prefetched inputs)."""

    def __init__(self, stats: StageStats, kv: KVCache | Callable[[], KVCache], queue_depth: Callable[[], int]):
        # kv: the cache, or how to find the current one (a live re-split gives the stage another)
        self.stats, self.queue_depth = stats, queue_depth
        self.kv = kv if callable(kv) else (lambda: kv)

    def collect(self):
        s, t, kv = self.stats, self.stats.transport, self.kv()
        yield CounterMetricFamily("stagemesh_stage_microbatches", "Micro-batches computed", value=s.microbatches)
        yield CounterMetricFamily("stagemesh_stage_tokens", "Tokens computed", value=s.tokens)
        yield CounterMetricFamily("stagemesh_stage_busy_seconds", "Seconds spent computing", value=s.busy_seconds)
        yield CounterMetricFamily("stagemesh_stage_head_seconds", "Of the seconds computing, the last stage's final norm, "
                                  "lm_head and sampling", value=s.head_seconds)
        yield CounterMetricFamily("stagemesh_stage_waiting_for_input_seconds", "Seconds the compute loop waited for "
                                  "input", value=s.waiting_seconds)
        yield CounterMetricFamily("stagemesh_stage_slots_reclaimed", "KV slots released because their lease expired "
                                  "(no micro-batch used them within --slot-lease)", value=s.reclaimed)
        yield CounterMetricFamily("stagemesh_stage_resplits", "Live re-splits this stage committed (its layers "
                                  "moved, or its neighbours')", value=s.resplits)
        yield CounterMetricFamily("stagemesh_stage_microbatch_errors", "Micro-batches that failed on this stage",
                                  value=s.errors)
        compute = HistogramMetricFamily("stagemesh_stage_compute_seconds", "Compute time per micro-batch, by its size "
                                        "in tokens", labels=["tokens"])
        for size, timings in s.compute.items():
            compute.add_metric([size], _buckets(timings), timings.seconds)
        yield compute
        yield HistogramMetricFamily("stagemesh_stage_hop_latency_seconds", "Upstream sender's send to this stage's "
                                    "receipt of a micro-batch", buckets=_buckets(s.hop), sum_value=s.hop.seconds)
        yield CounterMetricFamily("stagemesh_stage_bytes_in", "Bytes received", value=t.bytes_in)
        yield CounterMetricFamily("stagemesh_stage_bytes_out", "Bytes sent", value=t.bytes_out)
        yield CounterMetricFamily("stagemesh_stage_sending_seconds", "Seconds spent handing messages to the next hop",
                                  value=t.sending_seconds)
        yield CounterMetricFamily("stagemesh_stage_dropped_messages", "Messages dropped because the next hop took "
                                  "nothing for the send patience (it is gone; failover replays)", value=t.dropped)
        rejected = CounterMetricFamily("stagemesh_stage_rejected_messages", "Malformed messages dropped, by reason",
                                       labels=["reason"])
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], t.rejected.get(reason, 0))
        yield rejected
        failed = CounterMetricFamily("stagemesh_stage_handshakes_failed", "Failed CURVE/ZMTP handshakes, by direction "
                                     "(in: whoever reaches the input port; out: dialling the next hop)",
                                     labels=["direction"])
        for direction in ("in", "out"):
            failed.add_metric([direction], t.handshakes_failed[direction])
        yield failed
        yield GaugeMetricFamily("stagemesh_stage_queue_depth", "Prefetched inputs waiting for compute",
                                value=self.queue_depth())
        yield GaugeMetricFamily("stagemesh_stage_kv_slots_used", "KV cache slots held by live sequences",
                                value=kv.used_slots)
        yield GaugeMetricFamily("stagemesh_stage_kv_slots_cached", "KV cache slots kept as cached prefixes (the "
                                "gateway's prefix cache)", value=kv.kept_slots)
        yield CounterMetricFamily("stagemesh_stage_prefixes_evicted", "Cached prefixes this stage gave up because a new "
                                  "sequence found no free slot, or for room under --prefix-cache-memory",
                                  value=kv.evicted)
        yield GaugeMetricFamily("stagemesh_stage_kv_cached_bytes", "K/V memory of the cached prefixes (bounded by "
                                "--prefix-cache-memory)", value=kv.kept_bytes)
        yield GaugeMetricFamily("stagemesh_stage_kv_slots", "KV cache slots in total", value=kv.num_slots)
        yield GaugeMetricFamily("stagemesh_stage_kv_resident_bytes", "K/V memory of the positions held slots have "
                                "written (the OS commits KV memory as it is written)", value=kv.resident_bytes)
        yield GaugeMetricFamily("stagemesh_stage_kv_shared_bytes", "K/V that held slots read from a cached prefix's "
                                "memory pages instead of copies of their own (memory the sharing saves)",
                                value=kv.shared_bytes)
        yield GaugeMetricFamily("stagemesh_stage_bubble_ratio",
                                "Share of the compute loop's time spent waiting for input since start "
                                "(windowed: rate(waiting) / (rate(waiting) + rate(busy)))", value=s.bubble_ratio)


def stage_registry(stats: StageStats, kv: KVCache | Callable[[], KVCache], queue_depth: Callable[[], int]) -> CollectorRegistry:
    """The registry /metrics serves: one collector over the ledger."""
    registry = CollectorRegistry()
    registry.register(StageCollector(stats, kv, queue_depth))
    return registry
