"""Every tensor type common hub GGUFs use, one tiny GGUF each, against llama.cpp on the default (bfloat16, auto)
path: a 20-token prefill (dense kernels) and 1-token decode steps (int4, one plane or two, for Q4_*, Q5_* and Q8_0); the
lean kernels of every type (two int4 planes, int8 rows) are held to llama.cpp in tests/test_real_files.py.

Files come from the `gguf` package's quantizers where it has them, else from llama.cpp's own quantizer
(services.testing.tiny_gguf.llama_quantize). Hidden 256 and ffn 512: every row fits the 256-element superblocks of the K and
IQ types, so none falls back to another type."""

import numpy as np
import pytest
import torch

from services.testing.tiny_gguf import (
    LLAMA_QUANTIZED_TYPES,
    TinySpec,
    llama_cpp_logits,
    llama_cpp_model,
    llama_quantize,
    write_tiny_gguf,
)
from shared.files.gguf_loader import GgufLoader
from shared.models.linear import INT4_PAIR_TYPES, INT4_TYPES, qdot_kind, qdot_takes
from shared.runtime.generation import window_logits
from shared.runtime.stage_runtime import LocalPipeline
from tests.test_tiny_models import IDS, _decode_logits

SPEC = TinySpec(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, weight_scale=0.04)
GGUF_WRITTEN = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")
TOLERANCE = 1e-2  # max |diff| / logit range, as for the quantized files of test_tiny_models


@pytest.fixture(scope="module")
def f32_source(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("quant") / "f32.gguf"), SPEC)


def _file_of_type(qtype: str, f32_source: str, tmp_path) -> str:
    if qtype in ("F32", "F16"):
        return write_tiny_gguf(str(tmp_path / "t.gguf"), TinySpec(**{**SPEC.__dict__, "float_type": qtype}))
    if qtype in GGUF_WRITTEN:
        return write_tiny_gguf(str(tmp_path / "t.gguf"), TinySpec(**{**SPEC.__dict__, "quant": qtype}))
    return llama_quantize(f32_source, str(tmp_path / "t.gguf"), qtype)


@pytest.mark.reference
@pytest.mark.parametrize("qtype", GGUF_WRITTEN + LLAMA_QUANTIZED_TYPES)
def test_every_tensor_type_matches_llama_cpp(qtype, f32_source, tmp_path):
    path = _file_of_type(qtype, f32_source, tmp_path)
    loader = GgufLoader(path)
    assert {loader.tensor_type(f"blk.{i}.{m}.weight") for i in range(SPEC.layers)
            for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")} == {qtype}
    ref = llama_cpp_logits(llama_cpp_model(path, n_ctx=64), IDS)
    pipeline = LocalPipeline.load(loader, None, torch.bfloat16, kv_slots=1)
    for name, kind in pipeline.pieces[0].model.weight_summary().items():
        if name.startswith("blk."):  # auto: the integer-dot kernels for their types on AVX2 CPUs; else int4 for
            # 4/5/8-bit types below the crossover, the dense kernel for the rest
            if qdot_takes(qtype):
                assert "-dot-q8" in kind, (name, kind)
            else:
                assert ("int4" in kind) == (qtype in INT4_TYPES + INT4_PAIR_TYPES), (name, kind)
    by_type = pipeline.pieces[0].model.runs_as_by_type()  # a stage's /info: weights.by_type
    # the blocks' matrices (a file of F32, F16 or Q8_0 also stores its embedding in the type: counted apart)
    blocks = {kind: n for kind, n in by_type[qtype].items() if "(embedding)" not in kind and "(lm_head)" not in kind}
    assert sum(blocks.values()) == SPEC.layers * 7, by_type
    if qdot_takes(qtype):
        assert list(blocks) == [qdot_kind(qtype)], by_type
    logit_range = ref.max() - ref.min()
    assert logit_range > 1.0  # the comparison is not vacuous
    lean = LocalPipeline.load(loader, None, torch.bfloat16, kv_slots=1, weights="lean")  # each type's stored kernel
    for path_name, ours in (("prefill", window_logits(pipeline, IDS).double().numpy()),
                            ("decode", _decode_logits(pipeline, IDS)), ("lean decode", _decode_logits(lean, IDS))):
        rel = np.abs(ours - ref).max() / logit_range
        print(f"\n{qtype} {path_name}: max |diff| / range = {rel:.2e}")
        assert rel <= TOLERANCE, path_name
