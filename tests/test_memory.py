"""A stage's memory budget: auto keeps its dense prefill copy only where it fits beside the lean weights and the KV
cache; lean holds about the file's share; what a piece holds is reported against that share."""

import os

import pytest
import torch

from shared.config import parse_bytes
from shared.files.layers import LayerRange
from shared.models import TransformerModel, memory
from shared.models.kv_cache import KVCache
from shared.models.linear import SwitchedLinear
from shared.models.memory import plan_prefill_copy

MIB = 2**20


def test_the_copy_takes_the_fastest_dtype_that_fits_else_bf16_else_none():
    lean, kv = 30 * MIB, 50 * MIB
    auto = {torch.float32: 200 * MIB, torch.bfloat16: 150 * MIB}.__getitem__  # auto's weights by prefill dtype
    assert plan_prefill_copy(250 * MIB, lean, kv, auto, torch.float32).dtype == torch.float32
    assert plan_prefill_copy(249 * MIB, lean, kv, auto, torch.float32).dtype == torch.bfloat16
    assert plan_prefill_copy(250 * MIB, lean, kv, auto, torch.bfloat16).dtype == torch.bfloat16
    none = plan_prefill_copy(199 * MIB, lean, kv, auto, torch.float32)
    assert none.dtype is None and "--memory-budget" in none.reason and "199 MiB" in none.reason


@pytest.mark.parametrize("text,expected", [("4G", 4 * 2**30), ("512M", 512 * MIB), ("1.5GiB", 3 * 2**29),
                                           ("1000", 1000), ("64mb", 64 * MIB)])
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-1G", "4X", "G"])
def test_bad_sizes_name_the_form(text):
    with pytest.raises(ValueError, match="e.g. 4G"):
        parse_bytes(text)


def test_a_containers_memory_limit_bounds_what_counts_as_available(tmp_path, monkeypatch):
    """In a pod /proc/meminfo shows the host; the cgroup's limit is what the OOM killer enforces. The default budget
    and the prefix cache's default bound are taken from available_bytes, so it must not exceed the cgroup's room."""
    def cgroup(limit: str, usage: int) -> None:
        (tmp_path / "max").write_text(limit + "\n")
        (tmp_path / "current").write_text(f"{usage}\n")

    monkeypatch.setattr(memory, "cgroup_memory_files", lambda: [("/nonexistent/memory.max", "/nonexistent/memory.current"),
                                                                (str(tmp_path / "max"), str(tmp_path / "current"))])
    host = memory.available_bytes()  # the files are not there yet: the host's figure
    cgroup("max", 10 * MIB)  # cgroup v2 without a limit
    assert memory.cgroup_room() is None and memory.available_bytes() == pytest.approx(host, rel=0.1)
    cgroup(str(2**63 - 4096), 10 * MIB)  # v1's "no limit"
    assert memory.cgroup_room() is None
    cgroup(str(64 * MIB), 40 * MIB)  # a 64 MiB pod using 40
    assert memory.cgroup_room() == 24 * MIB and memory.available_bytes() == 24 * MIB
    assert memory.default_prefix_bytes(2**40) == 6 * MIB  # a quarter of the room, not of the host
    assert memory.default_budget(2) == int(24 * MIB * memory.DEFAULT_FRACTION / 2)
    cgroup(str(4 * 2**30), 2**30)  # a 4 GiB pod using 1: up's 2 stages share 3 GiB less their own runtimes
    room = 3 * 2**30 - 2 * memory.STAGE_RUNTIME_BYTES
    assert memory.stage_shares(2) == (int(room * memory.DEFAULT_FRACTION / 2), int(room * memory.PREFIX_FRACTION / 2))
    cgroup(str(64 * MIB), 40 * MIB)  # less than the stages' runtimes: the least budget, never 0 (a valid flag)
    assert memory.stage_shares(2) == (1, 1)
    cgroup(str(64 * MIB), 80 * MIB)  # over its limit already (reclaimable cache counts in usage)
    assert memory.available_bytes() == 0 and memory.default_prefix_bytes(2**40) == 1


def _load(smollm2, **kw) -> TransformerModel:
    return TransformerModel.from_gguf(smollm2.loader, LayerRange(10, 20), torch.bfloat16, weights="auto",
                                      kv_slots=4, max_seq_len=256, **kw)


def test_a_piece_whose_budget_cannot_hold_the_copy_runs_lean_by_itself(smollm2, without_integer_dot):
    """The same middle piece of SmolLM2 (Q4_1) with a roomy budget keeps auto's dense copies; with a budget that
    holds the lean weights and the KV cache but not the copy, it loads lean without being told, says why, and
    holds at most 1.5x the file's bytes of its layers (the copy: ~5x). On int4, as on a CPU without the
    integer-dot kernels."""
    roomy = _load(smollm2, memory_budget=8 * 2**30)
    tight = _load(smollm2, memory_budget=int(1.6 * roomy.memory.file_bytes) + roomy.memory.kv_bytes)
    switched = [w for b in roomy.blocks for w in b.linears().values() if isinstance(w, SwitchedLinear)]
    assert switched and roomy.weights == "auto"
    assert tight.weights == "lean"
    assert not [w for b in tight.blocks for w in b.linears().values() if isinstance(w, SwitchedLinear)]
    report, roomy_report = tight.memory_report(), roomy.memory_report()
    assert "no dense copies" in report["prefill_copy"] and "fit" in roomy_report["prefill_copy"]
    assert report["file_bytes"] == smollm2.loader.tensor_bytes(smollm2.loader.names_for(LayerRange(10, 20),
                                                                                         tight.position))
    print(f"\nlayers 10-19: file {report['file_bytes'] / MIB:.1f} MiB, lean {report['weight_bytes'] / MIB:.1f} MiB "
          f"({report['weights_per_file_byte']}x), with the copy {roomy_report['weight_bytes'] / MIB:.1f} MiB "
          f"({roomy_report['weights_per_file_byte']}x)")
    assert report["weights_per_file_byte"] <= 1.5
    assert roomy_report["weights_per_file_byte"] > 3 * report["weights_per_file_byte"]
    for a, b in zip(roomy.blocks[0].linears().values(), tight.blocks[0].linears().values()):  # the same decode kernel
        x = torch.randn(3, a.in_features)
        assert torch.equal(a(x), b(x))


def test_where_the_integer_dot_kernels_run_auto_holds_the_files_bytes(smollm2):
    """On them auto keeps no dense copy (they outrun it at every size): SmolLM2's Q4_1 layers hold their file's bytes
    (rows padded to 8: none in SmolLM2) whatever the budget."""
    from shared.kernels import qdot

    if not qdot.usable():
        pytest.skip(f"the integer-dot kernels do not run here: {qdot.why_not()}")
    model = _load(smollm2, memory_budget=8 * 2**30)
    report = model.memory_report()
    assert model.weights == "auto" and report["weights_per_file_byte"] <= 1.05, report
    kinds = {k.kind for b in model.blocks for k in b.linears().values()}
    from shared.models.linear import qdot_kind

    assert kinds == {qdot_kind("Q4_1")}, kinds


def test_the_embedding_is_read_from_the_files_map_not_copied(smollm2):
    first = TransformerModel.from_gguf(smollm2.loader, LayerRange(0, 2), torch.bfloat16, weights="lean")
    table = first.embedding.raw.data
    again = smollm2.loader.raw("token_embd.weight", mapped=True).data
    copied = smollm2.loader.raw("token_embd.weight").data
    assert table.data_ptr() == again.data_ptr() != copied.data_ptr()  # both views of the one map; a copy is not
    assert first.memory_report()["mapped_bytes"] == table.nbytes
    assert first.weight_bytes() < table.nbytes  # two lean blocks hold less than the (uncounted) table


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def test_kv_memory_follows_the_tokens_held_not_slots_times_max_seq_len():
    """32 slots x 2048 positions of SmolLM2's 30 layers reserve ~1.5 GB; idle they take next to nothing, a 1,000-token
    sequence takes its own K/V (~22 MB), and its release gives that back (the slot reads as zeros again)."""
    before = _resident_mib()
    kv = KVCache(30, 32, 2048, 3, 64, torch.bfloat16, "cpu", scratch=True)
    reserved = kv.reserved_bytes / MIB
    assert reserved > 1400 and _resident_mib() - before < 0.01 * reserved
    slot = kv.allocate("a")
    for t in kv.k + kv.v:
        t[slot, :, :1000] = 1.0
    kv.filled[slot] = 1000
    held = 1000 * kv.position_bytes / MIB
    assert kv.resident_bytes / MIB == pytest.approx(held)
    grown = _resident_mib() - before
    assert held <= grown < held + 0.01 * reserved
    kv.release("a")
    assert _resident_mib() - before < 0.25 * held and kv.resident_bytes == 0
    assert all(float(t[slot].abs().sum()) == 0.0 for t in kv.k + kv.v)


def test_the_default_context_is_the_models_as_far_as_the_budget_holds_one_sequence_of_it(smollm2):
    from shared.errors import DoesNotFit
    from shared.runtime.stage_runtime import MIN_AUTO_CONTEXT, StageRuntime

    def load(**kw):  # float32 weights: what they take does not depend on the budget (no prefill copy to weigh)
        kw.setdefault("kv_dtype", "auto")
        return StageRuntime.load(smollm2.loader, LayerRange(0, 2), torch.float32, kv_slots=2, weights="f32", **kw)

    full = load()
    assert full.kv.max_seq_len == smollm2.config.context_length == 8192
    assert full.context_info() == {"model": 8192, "max_seq_len": 8192, "why": "the model's context", "rope": None}
    weights, per_position = full.model.weight_bytes(), full.kv.position_bytes
    # --kv-dtype auto beside float32 activations: float16, 2 layers x K and V x 3 kv heads x 64 x 2 bytes
    assert full.kv.k[0].dtype == torch.float16 and per_position == 2 * 2 * 3 * 64 * 2
    assert load(kv_dtype="float32").kv.position_bytes == load(kv_dtype=None).kv.position_bytes == 2 * per_position
    capped = load(memory_budget=weights + 1000 * per_position)  # room for 1000 positions: 768, whole 256s
    assert capped.kv.max_seq_len == 1000 // MIN_AUTO_CONTEXT * MIN_AUTO_CONTEXT == 768
    assert "the model's 8192, capped by the memory budget" in capped.context["why"]
    assert capped.kv.live_bytes >= 768 * per_position  # the one sequence it promises fits the admission bound
    asked = load(max_seq_len=100_000)
    assert asked.kv.max_seq_len == 8192 and asked.context["why"] == "--max-seq-len 100000, capped by the model's context"
    assert load(max_seq_len=300, memory_budget=weights + 1000 * per_position).kv.max_seq_len == 300
    with pytest.raises(DoesNotFit, match=r"100 positions of K/V \(1536 bytes a position\), under 256"):
        load(memory_budget=weights + 100 * per_position)
