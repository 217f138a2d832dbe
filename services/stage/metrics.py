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
    """Every stage metric, from `stats` (the ledger), `kv` (its slots), `queue_depth` (prefetched inputs),
    `decode_bytes` (what a one-row decode step of its layers reads, None unknown) and `calibration` (--calibrate's
    measurement at start, None without it: shared.runtime.calibrate)."""

    def __init__(self, stats: StageStats, kv: KVCache | Callable[[], KVCache], queue_depth: Callable[[], int],
                 decode_bytes: Callable[[], int | None] = lambda: None,
                 calibration: Callable[[], dict | None] = lambda: None):
        # kv: the cache, or how to find the current one (a live re-split gives the stage another)
        self.stats, self.queue_depth = stats, queue_depth
        self.kv = kv if callable(kv) else (lambda: kv)
        self.decode_bytes, self.calibration = decode_bytes, calibration

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
        yield from self._roofline()
        yield GaugeMetricFamily("stagemesh_stage_bubble_ratio",
                                "Share of the compute loop's time spent waiting for input since start "
                                "(windowed: rate(waiting) / (rate(waiting) + rate(busy)))", value=s.bubble_ratio)


    def _roofline(self):
        """One-row decode against the memory roofline (shared/runtime/roofline.py): the bytes a step reads, the host's
        bandwidth where --calibrate measured it, and with both the share of that bound the steps reach."""
        step_bytes, calibration = self.decode_bytes(), self.calibration() or {}
        if step_bytes is None:
            return
        yield GaugeMetricFamily("stagemesh_stage_decode_step_bytes", "Bytes a one-row decode step of this stage's "
                                "layers reads: their weights as the file stores them, and the head's on the last "
                                "stage (K/V not counted)", value=step_bytes)
        bandwidth = calibration.get("bandwidth")
        if not bandwidth:
            return
        yield GaugeMetricFamily("stagemesh_stage_read_bandwidth_bytes_per_second", "This host's read bandwidth: a "
                                "STREAM triad with the stage's threads, at start (--calibrate)", value=bandwidth)
        roofline_s = step_bytes / bandwidth  # the least a one-row step can take
        fraction = GaugeMetricFamily("stagemesh_stage_roofline_fraction", "A one-row decode step at the memory "
                                     "roofline (its bytes over the read bandwidth) over the time it took: basis "
                                     "calibrated, --calibrate's steps of one row at start; serving, the mean of the "
                                     "one-token micro-batches computed so far", labels=["basis"])
        rows = calibration.get("rows") or []
        if 1 in rows:
            fraction.add_metric(["calibrated"], roofline_s / (calibration["ms_per_step"][rows.index(1)] / 1e3))
        one = self.stats.compute["1"]
        if one.count:
            fraction.add_metric(["serving"], roofline_s / (one.seconds / one.count))
        yield fraction


def stage_registry(stats: StageStats, kv: KVCache | Callable[[], KVCache], queue_depth: Callable[[], int],
                   decode_bytes: Callable[[], int | None] = lambda: None,
                   calibration: Callable[[], dict | None] = lambda: None) -> CollectorRegistry:
    """The registry /metrics serves: one collector over the ledger."""
    registry = CollectorRegistry()
    registry.register(StageCollector(stats, kv, queue_depth, decode_bytes, calibration))
    return registry
