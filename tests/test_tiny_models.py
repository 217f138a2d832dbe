"""Tiny random GGUF files per architecture vs llama.cpp: proves rope layout, biases and norms. Plus bad files."""

import subprocess
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.testing.tiny_gguf import (
    GGMLQuantizationType,
    TinySpec,
    llama_cpp_logits,
    llama_cpp_model,
    q8_1_bytes,
    write_tiny_gguf,
)
from shared.batch.steps import Decode, Prefill
from shared.errors import GgufError, UnsupportedArchitecture, UnsupportedTensorType
from shared.files.gguf_loader import GgufLoader
from shared.models.linear import INT4_PAIR_TYPES, INT4_TYPES, qdot_takes
from shared.runtime.generation import window_logits
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import SeqEntry
from tests.conftest import stagemesh_cmd

IDS = [504, 3458, 282, 4649, 314, 7042, 30, 378, 2358, 16, 28, 99, 1234, 77, 5, 902, 44, 12000, 3, 8]


@pytest.mark.reference
@pytest.mark.parametrize("spec,tolerance", [
    (TinySpec(arch="llama"), 1e-3),
    (TinySpec(arch="llama", tied=False, kv_heads=4), 1e-3),
    (TinySpec(arch="qwen2"), 1e-3),
    (TinySpec(arch="qwen3", head_dim=32), 1e-3),  # head_dim * heads != hidden, as in real qwen3
    (TinySpec(arch="llama", float_type="F16"), 1e-2),
    (TinySpec(arch="qwen2", float_type="F16"), 1e-2),
    (TinySpec(arch="qwen3", float_type="F16", head_dim=32), 1e-2),
    (TinySpec(arch="starcoder2", tied=False), 1e-3),  # LayerNorm + biases everywhere, gelu MLP
    (TinySpec(arch="starcoder2"), 1e-3),
    (TinySpec(arch="phi3", tied=False), 1e-3),  # fused attn_qkv and gate|up
    (TinySpec(arch="phi2", tied=False, rope_dim=8), 1e-3),  # parallel block, partial rotary, output bias
    (TinySpec(arch="qwen3moe", tied=False, experts=4, experts_used=2), 1e-3),  # router, top-2 of 4, 3-D experts
    # every token's 2nd expert is a tie (experts 1 and 2 score the same): llama.cpp takes the lower index
    (TinySpec(arch="qwen3moe", tied=False, experts=4, experts_used=2, router_ties=True), 1e-3),
    (TinySpec(arch="mistral3", tied=False), 1e-3),  # its text model is the llama block
    (TinySpec(arch="starcoder2", float_type="F16", tied=False), 1e-2),
    (TinySpec(arch="phi3", float_type="F16", tied=False), 1e-2),
    (TinySpec(arch="gemma"), 1e-3),  # embedding x sqrt(D), gelu-gated MLP, lm_head always token_embd
    # sandwich norms; sliding window 8 < the 20-token prompt on alternate layers; attention and final soft caps
    (TinySpec(arch="gemma2", layers=4), 1e-3),
    (TinySpec(arch="gemma2", layers=4, float_type="F16"), 1e-2),
    # per-head q/k norms; 5 sliding layers (rope base 10000) : 1 global (rope.freq_base 1e6)
    (TinySpec(arch="gemma3", layers=6, head_dim=32), 1e-3),
    (TinySpec(arch="gemma3", layers=6, head_dim=32, tied=False), 1e-3),
    (TinySpec(arch="gemma3", layers=6, head_dim=32, float_type="F16"), 1e-2),
], ids=lambda v: v if isinstance(v, float) else
   f"{v.arch}-{v.float_type}-{'tied' if v.tied else 'untied'}{'-router_ties' if v.router_ties else ''}")
def test_tiny_model_logits_match_llama_cpp(tmp_path, spec, tolerance):
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), spec)
    ref = llama_cpp_logits(llama_cpp_model(path, n_ctx=64), IDS)
    pipeline = LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1)
    ours = window_logits(pipeline, IDS).double().numpy()
    logit_range = ref.max() - ref.min()
    rel = np.abs(ours - ref).max() / logit_range
    print(f"\n{spec.arch} {spec.float_type}: max |diff| / range = {rel:.2e} (range {logit_range:.2f})")
    assert logit_range > 1.0  # the comparison is not vacuous
    assert rel <= tolerance


LONG_IDS = [(7919 * i + 13) % 48000 + 100 for i in range(120)]  # past a YaRN case's original context of 64
_FACTORS = np.random.default_rng(7)


@dataclass(frozen=True)
class RopeCase:
    """A tiny GGUF with rope scaling, and the per-sequence context llama.cpp and we both serve it at (llama.cpp
    chooses LongRoPE's long or short factors by it; it pads n_ctx to a multiple of 256)."""

    arch: str
    metadata: dict
    tensors: dict
    n_ctx: int = 512
    ids: tuple[int, ...] = tuple(IDS)

    def write(self, path: str, layers: int = 2) -> str:
        spec = TinySpec(arch=self.arch, layers=layers, tied=False)
        return write_tiny_gguf(path, spec, extra_tensors=self.tensors, extra_metadata=self.metadata)


_LONGROPE = dict(arch="phi3", metadata={"rope.scaling.original_context_length": 256,
                                        "rope.scaling.attn_factor": float(np.sqrt(1 + np.log(2) / np.log(256)))},
                 tensors={"rope_factors_long.weight": _FACTORS.uniform(1.0, 6.0, 8).astype(np.float32),
                          "rope_factors_short.weight": _FACTORS.uniform(0.8, 1.5, 8).astype(np.float32)})
ROPE_CASES = {
    "phi3-longrope-long": RopeCase(**_LONGROPE, n_ctx=512),  # 512 > 256: the long factors
    "phi3-longrope-short": RopeCase(**_LONGROPE, n_ctx=256),  # 256 <= 256: the short factors
    "llama-rope_freqs": RopeCase("llama", {}, {"rope_freqs.weight": _FACTORS.uniform(1.0, 8.0, 8).astype(np.float32)}),
    "llama-linear": RopeCase("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.5}, {}),
    "qwen2-yarn": RopeCase("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                     "rope.scaling.original_context_length": 64}, {}, ids=tuple(LONG_IDS)),
    "mistral3-yarn": RopeCase("mistral3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                           "rope.scaling.original_context_length": 64,
                                           "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_beta_slow": 2.0,
                                           "rope.scaling.yarn_log_multiplier": 0.5}, {}, ids=tuple(LONG_IDS)),
    # linear scaling on the global layers (odd ones, by the file's sliding_window_pattern 2) only; sliding ones unscaled
    "gemma3-linear": RopeCase("gemma3", {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
                                         "attention.sliding_window_pattern": 2}, {}),
}


@pytest.mark.reference
@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_rope_scaled_tiny_model_matches_llama_cpp(tmp_path, case):
    """LongRoPE (long and short factors), llama 3 rope_freqs, linear and YaRN against llama.cpp at the same
    per-sequence context."""
    path = case.write(str(tmp_path / "rope.gguf"))
    ids = list(case.ids)
    ref = llama_cpp_logits(llama_cpp_model(path, n_ctx=case.n_ctx), ids)
    pipeline = LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1, max_seq_len=case.n_ctx)
    ours = window_logits(pipeline, ids).double().numpy()
    logit_range = ref.max() - ref.min()
    rel = np.abs(ours - ref).max() / logit_range
    print(f"\n{case.arch}: max |diff| / range = {rel:.2e} (max |diff| {np.abs(ours - ref).max():.2e}, "
          f"range {logit_range:.2f})")
    assert logit_range > 1.0  # the comparison is not vacuous
    assert rel <= 1e-3


def _decode_logits(pipeline: LocalPipeline, ids: list[int]) -> np.ndarray:
    """[T, V]: a 1-token prefill, then one decode step per token (the decode-sized kernel at every position)."""
    rows = [pipeline.run([SeqEntry("d", Prefill(1, 0, 1, True))], torch.tensor(ids[:1]))]
    rows += [pipeline.run([SeqEntry("d", Decode(p))], torch.tensor([ids[p]])) for p in range(1, len(ids))]
    pipeline.release("d")
    return torch.cat(rows).double().numpy()


# 8 heads x 12 = 96 q rows, 1 kv head x 12 = 12 k and v rows: not a multiple of 16, so the int4 kernel cannot take
# k and v, which fall back (int8 rows in lean, the dense kernel in auto) while q and the other matrices stay int4.
_NO_INT4_QKV = dict(heads=8, kv_heads=1, head_dim=12)


@pytest.mark.reference
@pytest.mark.parametrize("spec,weights,tolerance", [
    (TinySpec(quant="Q4_0"), "auto", 1e-2),
    (TinySpec(quant="Q4_1"), "auto", 1e-2),
    (TinySpec(quant="Q4_1", tied=False), "lean", 1e-2),
    (TinySpec(quant="Q8_0"), "auto", 1e-2),
    (TinySpec(quant="Q4_1", **_NO_INT4_QKV), "auto", 1e-2),
    (TinySpec(quant="Q4_1"), "f32", 1e-2),
], ids=lambda v: v if isinstance(v, (float, str)) else f"{v.quant}-{'tied' if v.tied else 'untied'}-hd{v.head_dim}")
def test_quantized_tiny_model_matches_llama_cpp(tmp_path, spec, weights, tolerance):
    """Quantized GGUFs load on the default path (bfloat16 -> auto) and match llama.cpp through both of auto's
    kernels: a 20-token prefill (prepacked bf16) and 1-token decode steps (int4 where the shape allows)."""
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), spec)
    ref = llama_cpp_logits(llama_cpp_model(path, n_ctx=64), IDS)
    dtype = torch.float32 if weights == "f32" else torch.bfloat16
    pipeline = LocalPipeline.load(GgufLoader(path), None, dtype, kv_slots=1, weights=None if weights == "auto" else weights)
    runs_as = pipeline.pieces[0].model.weight_summary()

    def blocks_expected(ggml_type: str) -> bool:  # lean and auto: every 4- and 8-bit type (one int4 plane or two,
        return weights in ("auto", "lean") and ggml_type in INT4_TYPES + INT4_PAIR_TYPES  # or the integer-dot kernels)

    for name, kind in runs_as.items():
        if name == "token_embd.weight" and not spec.tied:  # the embedding alone: looked up from the file's bytes
            assert kind == "gguf-rows (embedding)", kind
            continue
        # fused q|k|v where q fits int4 (96 rows) and k and v do not (12 each): the kind names both kernels
        k_v_misfit = name.split(".")[-2] in ("attn_q", "attn_k", "attn_v") and spec.head_dim == 12
        ggml_type = "Q8_0" if name == "token_embd.weight" else spec.quant  # token_embd is Q8_0 in these files
        dot = blocks_expected(ggml_type) and qdot_takes(ggml_type)  # the integer-dot kernels (AVX2 CPUs): any rows
        assert ("int4" in kind or "-dot-q8" in kind) == blocks_expected(ggml_type), (name, kind)
        assert ("-dot-q8" in kind) == dot, (name, kind)
        assert ("int8" in kind) == (weights == "lean" and k_v_misfit and not dot), (name, kind)  # auto: dense
    logit_range = ref.max() - ref.min()
    assert logit_range > 1.0  # the comparison is not vacuous
    for path_name, ours in (("prefill", window_logits(pipeline, IDS).double().numpy()), ("decode", _decode_logits(pipeline, IDS))):
        rel = np.abs(ours - ref).max() / logit_range
        agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
        print(f"\n{spec.quant} {weights} {path_name}: max |diff| / range = {rel:.2e}, top-1 agreement {agree:.2f}")
        assert rel <= tolerance, path_name


def _cli_error(*args):
    proc = subprocess.run(stagemesh_cmd(*args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.processes
def test_corrupt_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(GgufError, match="not a readable GGUF"):
        GgufLoader(str(bad))
    assert "not a readable GGUF" in _cli_error("inspect", "--model", str(bad))


@pytest.mark.processes
def test_truncated_gguf_is_one_line_error(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GgufError, match="truncated"):
        GgufLoader(str(cut))
    assert "truncated" in _cli_error("generate", "--model", str(cut), "--prompt", "hi")


@pytest.mark.slow
def test_a_file_cut_anywhere_in_its_header_is_a_gguf_error(tmp_path):
    """Cut inside the metadata (the vocabulary's strings, its scores, a number array's end, a tensor's info): each
    is a GgufError, never an IndexError, a hang, or a header read from past the end."""
    from gguf import GGUFReader

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    data = open(path, "rb").read()
    header_end = GGUFReader(path).data_offset
    cut = tmp_path / "cut.gguf"
    for at in sorted({*range(8, header_end, max(1, header_end // 23)), header_end - 1}):
        cut.write_bytes(data[:at])
        with pytest.raises(GgufError, match="not a readable GGUF|truncated"):
            GgufLoader(str(cut))


@pytest.mark.processes
def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "odd.gguf"), TinySpec(arch="mamba9000"))
    with pytest.raises(UnsupportedArchitecture, match="llama, mistral, mistral3, phi2, phi3, qwen2, qwen3, qwen3moe, starcoder2"):
        LocalPipeline.load(GgufLoader(path), None, torch.float32)
    assert "mamba9000" in _cli_error("inspect", "--model", path)


@pytest.mark.processes
def test_unsupported_tensor_type_names_the_tensor_and_types(tmp_path):
    spec = TinySpec()
    override = {"blk.0.attn_q.weight": (q8_1_bytes(64, 64), GGMLQuantizationType.Q8_1)}
    path = write_tiny_gguf(str(tmp_path / "q81.gguf"), spec, override)
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.attn_q\.weight has type Q8_1.*Q4_1"):
        LocalPipeline.load(GgufLoader(path), None, torch.float32)
    assert "Q8_1" in _cli_error("generate", "--model", path, "--prompt", "hi")


@pytest.mark.processes
def test_missing_file_and_unknown_alias():
    assert "neither a known alias" in _cli_error("inspect", "--model", "no-such-model")


def _header(reader) -> tuple:
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = [(t.name, t.tensor_type, t.shape.tolist(), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    return fields, tensors


@pytest.mark.slow
def test_loader_reads_the_header_as_the_gguf_package_does(smollm2, tmp_path):
    """The loader's faster reader (a plain view of the memory map) yields the library's fields and tensors, on the
    real SmolLM2 file and on a file of many tensor types."""
    from gguf import GGUFReader

    from shared.files.gguf_loader import _PlainArrayReader

    mixed = write_tiny_gguf(str(tmp_path / "mixed.gguf"), TinySpec(),
                            {"blk.0.attn_q.weight": (q8_1_bytes(64, 64), GGMLQuantizationType.Q8_1)})
    for path in (smollm2.loader.path, mixed):
        fast, lib = _PlainArrayReader(path), GGUFReader(path)
        assert len(lib.fields) > 20 and len(lib.tensors) > 10
        assert _header(fast) == _header(lib)
        for a, b in zip(fast.tensors, lib.tensors):
            assert np.array_equal(a.data, b.data)


def test_tiny_files_are_written_as_the_gguf_package_writes_them(tmp_path, monkeypatch):
    """services.testing.tiny_gguf packs metadata arrays in one go: the file is byte for byte the library writer's."""
    import gguf

    import services.testing.tiny_gguf as tiny

    write_tiny_gguf(str(tmp_path / "fast.gguf"))
    monkeypatch.setattr(tiny, "_Writer", gguf.GGUFWriter)
    write_tiny_gguf(str(tmp_path / "lib.gguf"))
    fast, lib = (tmp_path / "fast.gguf").read_bytes(), (tmp_path / "lib.gguf").read_bytes()
    assert len(fast) > 100_000 and fast == lib


def test_loader_parses_a_rewritten_file_again(tmp_path):
    """The per-process header cache is keyed by the file's identity: a file rewritten in place reads anew."""
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, TinySpec(layers=2))
    assert GgufLoader(path).arch_get("block_count") == 2
    write_tiny_gguf(path, TinySpec(layers=3))
    assert GgufLoader(path).arch_get("block_count") == 3
