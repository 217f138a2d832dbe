"""Prometheus metrics of the gateway (own registry per app)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OUTCOMES = ("stop", "length", "cancelled", "timeout", "error")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stagemesh_gateway_requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.rejected = Counter("stagemesh_gateway_rejected_requests", "Requests refused at the edge", ["status"], registry=r)
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
