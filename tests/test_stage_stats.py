"""A stage's one ledger (services/stage/stats.py): its /info and its /metrics, served by the real stage HTTP app over
a real worker loop that computes micro-batches of a tiny GGUF in this process (inproc sockets), report the same
numbers -- and the ledger's histograms expose what Prometheus histograms would."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from gguf import GGUFReader
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.stage.http import WORKER, make_app
from services.stage.io import StageIO
from services.stage.metrics import stage_registry
from services.stage.stats import HOP_BUCKETS, StageStats, Timings, size_class
from services.stage.worker import StageIdentity, StageWorker
from shared.batch.steps import Decode, Prefill
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange
from shared.models.kv_cache import KVCache
from shared.runtime.calibrate import calibrate
from shared.runtime.plan import ModelFacts
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import BatchResult, ForwardBatch, ReleaseDone, SeqEntry
from shared.wire.stage_info import StageInfo
from shared.wire.transport import ZmqTransport

_ports = itertools.count()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics body: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_info_and_metrics_report_the_same_numbers_from_the_one_ledger(tiny_path):
    loader = GgufLoader(tiny_path)
    runtime = StageRuntime.load(loader, None, torch.float32, kv_slots=4, max_seq_len=64)
    n = next(_ports)
    stage_in, gateway_in = f"inproc://ledger-stage-{n}", f"inproc://ledger-gateway-{n}"
    io = StageIO(ZmqTransport(stage_in, gateway_in, accept=(ForwardBatch,), keys=None))
    identity = StageIdentity("tiny", loader.fingerprint, LayerRange(0, runtime.model.config.num_layers),
                             runtime.model.config.num_layers, runtime.model.position, "float32", listen=stage_in)
    worker = StageWorker(runtime, io, identity, slot_lease_s=0)
    worker.model_facts = ModelFacts.from_gguf(loader, 4)  # as serve() gives them, with --calibrate's measurement
    worker.calibration = calibrate(runtime, [1], min_seconds=0.2)
    gateway = ZmqTransport(gateway_in, stage_in, accept=(BatchResult, ReleaseDone), keys=None)
    app = make_app()
    app[WORKER] = worker
    loop_task = asyncio.create_task(worker.run())
    try:
        async with TestClient(TestServer(app)) as http:
            await gateway.send(ForwardBatch(1, [SeqEntry("a", Prefill(5, 0, 5, True))], tokens=torch.arange(1, 6)))
            assert isinstance(await asyncio.wait_for(gateway.receive(), 30), BatchResult)
            for k in range(3):
                await gateway.send(ForwardBatch(2 + k, [SeqEntry("a", Decode(5 + k))], tokens=torch.tensor([7])))
                assert isinstance(await asyncio.wait_for(gateway.receive(), 30), BatchResult)
            await asyncio.sleep(0.05)  # the compute thread finishes timing its last send
            info = StageInfo.from_json(await (await http.get("/info")).json())
            metrics = samples(await (await http.get("/metrics")).text())
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        gateway.close()
        io.transport.close()

    def metric(name: str, **labels) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    stats = worker.stats
    assert info.microbatches == metric("stagemesh_stage_microbatches_total") == stats.microbatches == 4
    assert info.hop_latency_seconds_count == metric("stagemesh_stage_hop_latency_seconds_count") == 4  # every header
    assert info.hop_latency_seconds_sum == pytest.approx(metric("stagemesh_stage_hop_latency_seconds_sum"), abs=1e-6)
    assert info.busy_seconds == pytest.approx(metric("stagemesh_stage_busy_seconds_total"), abs=1e-4)
    assert info.busy_seconds > 0
    by_size = {size: metric("stagemesh_stage_compute_seconds_count", tokens=size) for size in ("1", "2-8", "9-32")}
    assert by_size == {"1": 3, "2-8": 1, "9-32": 0}  # three decodes, one 5-token prefill
    assert metric("stagemesh_stage_tokens_total") == 8
    assert info.waiting_for_input_seconds == pytest.approx(
        metric("stagemesh_stage_waiting_for_input_seconds_total"), abs=1e-4)
    assert info.sending_seconds == pytest.approx(metric("stagemesh_stage_sending_seconds_total"), abs=1e-4)
    assert info.sending_seconds > 0
    assert metric("stagemesh_stage_bytes_out_total") == stats.transport.bytes_out > 0
    assert info.kv_slots_used == metric("stagemesh_stage_kv_slots_used") == 1  # "a" is still held
    assert info.kv_slots == metric("stagemesh_stage_kv_slots") == 4
    assert info.slots_reclaimed == metric("stagemesh_stage_slots_reclaimed_total") == 0
    assert metric("stagemesh_stage_rejected_messages_total", reason="kind") == info.rejected_messages.get("kind", 0) == 0
    # one name per quantity: every /info field that is also a metric carries the metric's name, and the same number
    named = 0
    for field in dataclasses.fields(info):
        for sample in (f"stagemesh_stage_{field.name}", f"stagemesh_stage_{field.name}_total"):
            if (sample, ()) in metrics:
                assert getattr(info, field.name) == pytest.approx(metric(sample), abs=1e-3), field.name
                named += 1
    assert named >= 14, named
    # one-row decode against the memory roofline: the step reads every tensor of the file once (one stage, tied
    # embeddings: token_embd is the head), as gguf's own reader sizes them
    step_bytes = sum(int(t.n_bytes) for t in GGUFReader(tiny_path).tensors)
    assert metric("stagemesh_stage_decode_step_bytes") == step_bytes
    bandwidth = metric("stagemesh_stage_read_bandwidth_bytes_per_second")
    assert bandwidth == worker.calibration["bandwidth"] > 1e8  # a triad of this host: far above 100 MB/s
    one = stats.compute["1"]
    assert metric("stagemesh_stage_roofline_fraction", basis="serving") == pytest.approx(
        step_bytes / bandwidth / (one.seconds / one.count))
    assert metric("stagemesh_stage_roofline_fraction", basis="calibrated") == pytest.approx(
        step_bytes / bandwidth / (worker.calibration["ms_per_step"][0] / 1e3))


def test_a_stage_without_calibration_states_its_step_bytes_and_no_fraction():
    kv = KVCache(num_layers=1, num_slots=2, max_seq_len=16, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    stats = StageStats()
    stats.computed(0.002, 1)
    bare = {s.name for fam in stage_registry(stats, kv, lambda: 0).collect() for s in fam.samples}
    assert not {n for n in bare if "roofline" in n or "decode_step_bytes" in n or "bandwidth" in n}
    sized = {(s.name, tuple(s.labels.items())): s.value
             for fam in stage_registry(stats, kv, lambda: 0, lambda: 10**6).collect() for s in fam.samples}
    assert sized[("stagemesh_stage_decode_step_bytes", ())] == 10**6
    assert not {n for n, _ in sized if "roofline" in n or "bandwidth" in n}  # no bandwidth measured: no fraction


def test_timings_expose_what_a_prometheus_histogram_does():
    ours, theirs = Timings(HOP_BUCKETS), Histogram("h_seconds", "reference", buckets=HOP_BUCKETS)
    for seconds in (0.0, 0.0001, 0.00011, 0.003, 0.01, 0.5, 1.0, 7.0):  # on a bound, between bounds, past the last
        ours.observe(seconds)
        theirs.observe(seconds)
    reference = {s.labels["le"]: s.value for fam in theirs.collect() for s in fam.samples if s.name.endswith("_bucket")}
    assert [n for _, n in ours.cumulative()] == list(reference.values())
    assert ours.count == 8 and ours.seconds == pytest.approx(sum((0.0001, 0.00011, 0.003, 0.01, 0.5, 1.0, 7.0)))


def test_busy_time_and_micro_batches_are_the_compute_timings_not_a_second_count():
    stats = StageStats()
    stats.computed(0.25, 1)
    stats.computed(0.5, 40)
    stats.waiting_seconds = 0.25
    assert (stats.microbatches, stats.busy_seconds, stats.tokens) == (2, 0.75, 41)
    assert stats.compute[size_class(40)].count == 1 and stats.bubble_ratio == 0.25
