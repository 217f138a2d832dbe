"""Weights mode `auto`'s kernels are measured when a stage loads, not assumed: the dense kernel of prefill-sized
micro-batches (prepacked bf16 or f32) and the crossover from int4 to it. SmolLM2's Q4_1 is loaded as on a CPU
without the integer-dot kernels (where they run, auto keeps no dense copy: nothing to switch to)."""

import json
import os

import pytest
import torch

from shared.kernels.plans import KernelPlans
from shared.models.crossover import CANDIDATES, crossover, measure_int4_crossover
from shared.models.device import cpu_has_fast_bf16
from shared.models.linear import SwitchedLinear
from shared.runtime.stage_runtime import StageRuntime


@pytest.fixture(autouse=True)
def int4_path(without_integer_dot):
    pass


def _switched(model) -> list[SwitchedLinear]:
    return [w for b in model.blocks for w in b.linears().values() if isinstance(w, SwitchedLinear)]


def test_a_stage_load_sets_one_measured_threshold_on_every_switched_linear(smollm2):
    runtime = StageRuntime.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, weights="auto")
    switched = _switched(runtime.model)
    assert len(switched) == 4 * runtime.model.config.num_layers  # qkv, wo, gate_up, down of every layer
    thresholds = {w.max_tokens for w in switched}
    assert len(thresholds) == 1
    (threshold,) = thresholds
    assert threshold in CANDIDATES or threshold == CANDIDATES[-1] + 1
    summary = runtime.model.weight_summary()
    assert all(f"< {threshold} tokens, measured" in kind for name, kind in summary.items() if name.startswith("blk."))


@pytest.mark.parametrize("dense_wins, want", [
    (lambda m: True, CANDIDATES[0]),  # dense wins from the first candidate on
    (lambda m: False, CANDIDATES[-1] + 1),  # the quantized kernel wins throughout
    (lambda m: m >= 24, 24),
    (lambda m: m in (8, 24, 32, 48), 24),  # one win at 8, lost at 12: a noisy win does not end the scan
    (lambda m: m == CANDIDATES[-1], CANDIDATES[-1]),  # at the last candidate there is no next one to confirm it
], ids=["dense-throughout", "int4-throughout", "from-24", "noisy-win", "last-alone"])
def test_the_crossover_is_the_first_of_two_dense_wins_in_a_row(dense_wins, want):
    asked = []

    def timings(m: int) -> tuple[float, float]:
        asked.append(m)
        return (2.0, 1.0) if dense_wins(m) else (1.0, 2.0)

    assert crossover(timings) == want
    assert asked == sorted(asked) and len(set(asked)) == len(asked)  # ascending, each once


def test_the_measurement_follows_its_own_timings(smollm2):
    """The crossover is a measured number, whatever this shared machine's load makes it: the one its own timings
    give (benchmarks/kernels.py prints such timings)."""
    runtime = StageRuntime.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, weights="auto")
    first_block = [w for w in runtime.model.blocks[0].linears().values() if isinstance(w, SwitchedLinear)]
    seen: dict[int, tuple[float, float]] = {}
    threshold = measure_int4_crossover(first_block, repeat=7, seen=seen)
    assert seen and all(small > 0 and large > 0 for small, large in seen.values())
    assert threshold == crossover(lambda m: seen[m])


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_modes_without_a_switch_are_left_alone(smollm2):
    for weights, invariant in (("lean", False), ("bf16", False), ("auto", True)):
        runtime = StageRuntime.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, weights=weights,
                                    batch_invariant=invariant)
        assert _switched(runtime.model) == []
        assert not any("measured" in kind for kind in runtime.model.weight_summary().values())


def test_the_prefill_kernel_is_the_measured_dtype_on_every_switched_linear(smollm2, tmp_path, monkeypatch):
    """The load's own measurement, recorded in a fresh plans file, is what its linears run (a second measurement
    here would be another timing on a shared machine, free to come out the other way)."""
    from shared.models import crossover

    plans = tmp_path / "plans.json"
    monkeypatch.setenv(crossover.PLANS_ENV, str(plans))
    runtime = StageRuntime.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, weights="auto")
    recorded = [v for v in json.loads(plans.read_text()).values() if isinstance(v, str)]  # the crossover is an int
    assert len(recorded) == 1 and recorded[0] in ("bfloat16", "float32"), recorded
    measured = getattr(torch, recorded[0])
    if not cpu_has_fast_bf16():
        assert measured == torch.float32  # bf16 GEMMs would be emulated
    assert {w.large.dtype for w in _switched(runtime.model)} == {measured}
    name = {torch.bfloat16: "bf16", torch.float32: "f32"}[measured]
    blocks = {k: v for k, v in runtime.model.weight_summary().items() if k.startswith("blk.")}
    assert blocks and all(kind.split(" | ")[1].startswith(name) for kind in blocks.values()), blocks


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_two_loads_of_a_file_pick_the_same_kernels_and_the_second_times_nothing(smollm2, tmp_path, monkeypatch):
    """The kernel plan is measured once per machine and shape, kept in the plans file, and read back: a second load
    picks the same crossover and prefill kernel without timing anything; an unusable entry is measured anew."""
    from shared.models import crossover

    plans = tmp_path / "plans.json"
    monkeypatch.setenv(crossover.PLANS_ENV, str(plans))

    def load():
        model = StageRuntime.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, weights="auto").model
        first = _switched(model)[0]
        return first.max_tokens, first.large.kind

    measured = load()
    recorded = json.loads(plans.read_text())
    assert len(recorded) == 2 and measured[0] in recorded.values()

    def no_timing(*args, **kwargs):
        raise AssertionError("a load with a plan on file timed kernels")

    with monkeypatch.context() as m:
        m.setattr(crossover, "measure_int4_crossover", no_timing)
        m.setattr(crossover, "measure_prefill_dtype", no_timing)
        assert load() == measured

    plans.write_text(json.dumps({key: "garbage" for key in recorded}))  # a hand edit: measured again, not trusted
    assert load()[0] in (*CANDIDATES, CANDIDATES[-1] + 1)
    assert set(json.loads(plans.read_text()).values()) <= {*CANDIDATES, CANDIDATES[-1] + 1, "bfloat16", "float32"}


def test_kernel_plans_read_what_they_measured_and_say_so(tmp_path):
    """A plans file: the first load measures and writes a plan, the next reads it; counted either way (a stage's
    /info shows the counts). Where the file cannot be written the plan is measured, used, and said to be unsaved."""
    plans = KernelPlans(str(tmp_path / "plans.json"))
    measured = []

    def measure() -> str:
        measured.append(1)
        return "bfloat16"

    valid = lambda v: v in ("bfloat16", "float32")  # noqa: E731
    assert plans.plan("probe 8x8", measure, valid) == ("bfloat16", False)
    assert KernelPlans(plans.path).plan("probe 8x8", measure, valid) == ("bfloat16", True)  # another process reads it
    assert plans.plan("probe 8x8", measure, valid) == ("bfloat16", True) and len(measured) == 1
    assert plans.info() == {"file": plans.path, "read": 1, "measured": 1, "written": True}
    (tmp_path / "ro").mkdir(mode=0o500)
    unsaved = KernelPlans(str(tmp_path / "ro" / "plans.json"))
    if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: a file in place of the directory instead
        unsaved = KernelPlans(str(tmp_path / "plans.json" / "inside"))
    assert unsaved.plan("probe 8x8", measure, valid) == ("bfloat16", False) and unsaved.info()["written"] is False
    assert KernelPlans.from_flag("off").path is None and KernelPlans.from_flag("f.json").path == "f.json"
