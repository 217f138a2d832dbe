"""Test utility: a StageInfo whose fields a test does not care about hold plain values (a one-stage, 30-layer
pipeline of a model with fingerprint FP), so a pure test names only the fields it is about."""

from __future__ import annotations

from shared.wire.stage_info import StageInfo

FP = "abc123"


def make_info(**over) -> StageInfo:
    fields = dict(
        model="m", fingerprint=FP, layers=(0, 30), num_layers=30, position="only", incarnation="i0",
        listen="tcp://127.0.0.1:5555", device="cpu", dtype="float32", kv_dtype="float16", weights_mode="auto", batch_invariant=False,
        threads=2, threads_alone=2, prefetch=True, weights={}, compiled_decode={"state": "off", "reason": "test"},
        kernel_plans={"file": None, "read": 0, "measured": 0, "written": True},
        keys=None, kv_slots=8, kv_slots_used=0, kv_slots_cached=0, kv_prefix_slots=0, kv_max_seq_len=2048,
        context={"model": 2048, "max_seq_len": 2048, "why": "given", "rope": None},
        kv_slot_lease_s=60.0, kv_prefix_memory_bytes=0, kv_live_memory_bytes=0,
        kv_cached_bytes=0, kv_position_bytes=0, kv_resident_bytes=0,
        kv_reserved_bytes=0, kv_shared_bytes=0, slots_reclaimed=0, prefixes_evicted=0, clock_s=0.0, microbatches=0,
        busy_seconds=0.0, head_seconds=0.0, cpu_seconds=0.0, cpu_limit=0.0, waiting_for_input_seconds=0.0, sending_seconds=0.0, hop_latency_seconds_sum=0.0,
        hop_latency_seconds_count=0, dropped_messages=0, rejected_messages={}, handshakes_failed={},
        recent_mb_in=(), recent_mb_out=())
    fields.update(over)
    return StageInfo(**fields)
