"""stagemesh trace: a divergence is pinned to the layer and step where it starts."""

import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.files.layers import balanced_split, split_at
from shared.runtime.stage_runtime import LocalPipeline
from shared.runtime.trace import (
    LAYER_OUTPUT,
    STAGE_TRANSFER,
    CaptureHook,
    TraceRecorder,
    compare_captures,
    trace_local,
)
from tests.conftest import stagemesh_cmd

PROMPT = "The quick brown fox jumps over the lazy dog because"
STEPS = 3
TRACE_BUDGET = 2 << 20  # the up's --trace-budget: PROMPT's trace fits, a long prompt's prefill alone does not


@pytest.fixture(scope="module")
def reference(smollm2):
    return trace_local(LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=1),
                       smollm2.tokenizer.encode(PROMPT), STEPS)


def traced(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "trace": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def up3(up):
    # one micro-batch in flight: every running request shares it, which is where one trace could leak into another
    return up("--allow-trace", "--trace-budget", str(TRACE_BUDGET), "--max-inflight", "1", stages=3, dtype="float32")


def test_in_process_vs_running_3_stage_mesh_is_exactly_equal(up3, smollm2):
    gw = up3
    # --max-inflight 1: every micro-batch is alone in the pipeline, so each stage computes with its alone-thread count
    threads = {gw.stage_info(i).threads_alone for i in range(3)}
    assert len(threads) == 1
    proc = subprocess.run(stagemesh_cmd("trace", "--baseline", "local:float32", "--target", gw.url,
                                        "--threads", str(threads.pop()),
                                        "--prompt", PROMPT, "--steps", str(STEPS), "--json"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    rows = result["comparisons"]
    outputs = [r for r in rows if r["point"] == LAYER_OUTPUT]
    transfers = [r for r in rows if r["point"] == STAGE_TRANSFER]
    assert len(outputs) == 30 * (STEPS + 1)  # every layer at every step
    assert len(transfers) == 2 * (STEPS + 1)  # two stage boundaries, each step
    planned = balanced_split(30, 3, smollm2.config.head_cost_in_layers)
    assert {r["stage_target"] for r in outputs} == {f"stage[{r}]" for r in planned}
    assert all(r["problem"] is None and r["max_abs_diff"] == 0.0 for r in rows), [r for r in rows if r["max_abs_diff"]][:3]
    assert result["first_divergence"] is None
    assert result["tokens_baseline"] == result["tokens_target"] and len(result["tokens_target"]) == STEPS + 1


@pytest.mark.parametrize("prompts", [("Rain falls on the quiet harbour town", "Seven planets circle a dim red star, "
                                      "and on the fourth one lives"), ("Hello", "Once upon a time in a land far away")])
def test_traced_requests_sharing_the_mesh_each_get_only_their_own_activations(up3, smollm2, prompts):
    """Two traced requests (and an untraced one) at once: each trace holds every layer at every step of its own
    prompt -- the same numbers as an in-process run of that prompt alone -- and nothing of the other's (a victim's
    activations once reached whoever shared its micro-batch)."""
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(lambda: urllib.request.urlopen(urllib.request.Request(
            up3.url + "/v1/completions", json.dumps({"prompt": "An untraced bystander", "max_tokens": 6}).encode(),
            {"Content-Type": "application/json"}), timeout=300).read())
        answers = list(pool.map(lambda p: traced(up3.url, p, STEPS + 1), prompts))
        assert "trace" not in json.loads(plain.result())
    for prompt, answer in zip(prompts, answers):
        ids = smollm2.tokenizer.encode(prompt)
        trace = answer["trace"]
        assert trace["prompt_ids"] == ids and trace["truncated"] is False
        got = TraceRecorder.from_json(trace)
        assert len(got.captures) == (30 + 2) * (STEPS + 1)  # 30 layers and 2 stage boundaries per step, no more
        ref = trace_local(LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=1), ids, STEPS)
        # float32 in a shared micro-batch reduces in another order than alone, and the difference grows over 30
        # layers: up to ~10 ulps of an activation (a full run saw 0.0059 at a value of a few thousand; SmolLM2's first
        # position reaches ~4e4, where one ulp is 0.004-0.008); another request's rows would differ by far more
        result = compare_captures(ref, got, threshold=1e-3, rtol=1e-5)
        assert result.first_divergence is None, result.first_divergence
        assert all(c.problem is None for c in result.comparisons), [c for c in result.comparisons if c.problem][:3]


def test_a_prompt_repeated_on_a_split_mesh_starts_from_every_stages_cached_prefix_with_the_same_tokens(up3):
    """float32 over 3 stages: the second request finds the first one's K/V kept on every stage, computes only its
    last block's worth of prompt, and samples the same greedy tokens (a full prefill's)."""
    line = "A list of rivers, mountains, cities and the countries they lie in, one per line:\n"
    prompt = line * 3

    def complete(text: str = prompt) -> dict:
        body = json.dumps({"prompt": text, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(up3.url + "/v1/completions", body,
                                                           {"Content-Type": "application/json"}), timeout=300) as r:
            return json.loads(r.read())

    def settled(i: int, done) -> dict:
        """Stage i's /info once done(it): the release and keep that follow a request reach the stages after its
        answer, and a keep's move is briefly half made (the kept row mapping the pages beside the old one)."""
        deadline = time.monotonic() + 30
        while not done(kv := up3.stage_info(i)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return kv

    first, second = complete(), complete()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    for i in range(3):
        kv = settled(i, lambda kv: kv.kv_slots_used == 0)  # the second kept, the first it contains released
        assert kv.kv_slots_cached >= 1 and kv.prefixes_evicted == 0
        # kept in the rows beyond the live slots, under the default bound (a share of the memory free at load)
        assert kv.kv_prefix_slots == 64 and 0 < kv.kv_cached_bytes <= kv.kv_prefix_memory_bytes
        assert kv.kv_cached_bytes % kv.kv_position_bytes == 0 and kv.kv_cached_bytes >= n * kv.kv_position_bytes
        assert kv.kv_shared_bytes == 0
    # one more with its own ending after two of the lines: it maps the cached prompt's pages on every stage (float32:
    # 16 positions a page), and stays kept beside the second (whose prompt it does not hold), still mapping them
    third = complete(line * 2 + "Rivers of Norway:")
    reused = third["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused >= 32
    for i in range(3):
        kv = settled(i, lambda kv: kv.kv_slots_used == 0 and kv.kv_slots_cached == 2)
        assert kv.kv_shared_bytes == reused // 16 * 16 * kv.kv_position_bytes, (i, kv)


def test_a_traced_request_stops_capturing_at_its_budget(up3, smollm2):
    """A prompt whose first prefill chunk (128 tokens) is already over the gateway's --trace-budget: its trace holds
    that chunk and no later chunk or decode step, says it is truncated, and the request itself completes."""
    prompt = " ".join(f"word{i}" for i in range(100))
    assert len(smollm2.tokenizer.encode(prompt)) > 128
    answer = traced(up3.url, prompt, 8)
    trace = answer["trace"]
    assert trace["truncated"] is True and answer["usage"]["completion_tokens"] == 8
    got = TraceRecorder.from_json(trace)
    positions = {c.position for c in got.captures}
    assert positions == {0}, sorted(positions)  # the prefill only: every later step asked for nothing
    held = sum(len(c.data or b"") for c in got.captures)
    assert TRACE_BUDGET <= held + 256 * len(got.captures) < 3 * TRACE_BUDGET


def test_float32_vs_bfloat16_shows_the_difference_growing(smollm2, reference):
    target = trace_local(LocalPipeline.load(smollm2.loader, None, torch.bfloat16, kv_slots=1),
                         smollm2.tokenizer.encode(PROMPT), STEPS)
    result = compare_captures(reference, target, threshold=1e-3)
    prefill = [c for c in result.comparisons if c.step == 0 and c.point == LAYER_OUTPUT]
    assert len(prefill) == 30 and all(c.max_abs_diff > 0 for c in prefill)
    early = sum(c.mean_abs_diff for c in prefill[:5]) / 5
    late = sum(c.mean_abs_diff for c in prefill[-5:]) / 5
    assert late > 3 * early  # the error accumulates through the layers
    assert result.first_divergence.layer == 0 and result.first_divergence.step == 0


def test_a_fault_in_one_stage_is_pinned_to_that_layer_and_stage(smollm2, reference):
    faulty_layer = 17

    class Perturb(CaptureHook):  # test-only LayerHook: corrupts one layer's output, then records as usual
        def on_layer_output(self, layer, hidden):
            if layer == faulty_layer:
                hidden = hidden.clone()
                hidden[:, 7] += 0.5
            return super().on_layer_output(layer, hidden)

    def hooks(i, piece, position):
        cls = Perturb if faulty_layer in piece.model.layers else CaptureHook
        return cls.for_piece(piece.model.layers, piece.model.position, position)

    pipeline = LocalPipeline.load(smollm2.loader, split_at(30, [13, 25]), torch.float32, kv_slots=1)
    target = trace_local(pipeline, smollm2.tokenizer.encode(PROMPT), STEPS, hook_factory=hooks)
    result = compare_captures(reference, target, threshold=1e-3)
    first = result.first_divergence
    assert (first.step, first.layer, first.point, first.stage_target) == (0, faulty_layer, LAYER_OUTPUT, "stage[13:25]")
    before = [c for c in result.comparisons if c.step == 0 and c.layer < faulty_layer]
    assert before and all(c.max_abs_diff == 0.0 for c in before)
