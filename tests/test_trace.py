"""stagemesh trace: a divergence is pinned to the layer and step where it starts."""

import json
import subprocess

import pytest
import torch

from services.launch import start_up
from shared.layers import balanced_split, split_at
from shared.runtime import LocalPipeline
from shared.trace import LAYER_OUTPUT, STAGE_TRANSFER, CaptureHook, compare_captures, trace_local
from tests.conftest import stagemesh_cmd

PROMPT = "The quick brown fox jumps over the lazy dog because"
STEPS = 3


@pytest.fixture(scope="module")
def reference(smollm2):
    return trace_local(LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=1),
                       smollm2.tokenizer.encode(PROMPT), STEPS)


def test_in_process_vs_running_3_stage_mesh_is_exactly_equal(tmp_path, smollm2):
    gw = start_up(3, "float32", str(tmp_path))
    try:
        threads = {gw.stage_info(i)["threads"] for i in range(3)}
        assert len(threads) == 1
        proc = subprocess.run(stagemesh_cmd("trace", "--baseline", "local:float32", "--target", gw.url,
                                            "--threads", str(threads.pop()),
                                            "--prompt", PROMPT, "--steps", str(STEPS), "--json"),
                              capture_output=True, text=True, timeout=300)
    finally:
        gw.stop()
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
