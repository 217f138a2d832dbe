"""The model-shaped stand-ins (services/testing/shaped_gguf.py): their sizes are the real models' (the parameter counts the
model cards publish), and a miniature written by the same code -- real vocabulary size with its UNUSED padding, Llama
3.1 rope factors, Qwen2 biases -- gives llama.cpp's logits and tokens, as F16 and after llama.cpp's own Q4_K_M
quantizer. The full-size files are built only by the benchmarks (minutes, gigabytes)."""

import dataclasses

import numpy as np
import pytest
import torch

from services.testing.shaped_gguf import SHAPES, llama3_rope_factors, write_shaped_f16
from services.testing.tiny_gguf import llama_cpp_logits, llama_cpp_model
from shared.files.gguf_loader import GgufLoader
from shared.runtime.generation import window_logits
from shared.runtime.stage_runtime import LocalPipeline
from shared.text.tokenizer import GgufTokenizer
from tests.test_tiny_models import IDS


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_have_the_published_parameter_counts(name):
    shape = SHAPES[name]
    assert shape.params == pytest.approx(shape.published_params, rel=0.005)
    assert shape.heads * shape.head_dim % 256 == 0 and shape.ffn % 256 == 0  # every block matrix takes K-quants


@pytest.mark.parametrize("name", [n for n in SHAPES if SHAPES[n].llama3_rope])
def test_llama3_rope_factors_run_from_1_to_the_scaling_factor(name):
    shape = SHAPES[name]
    factors = llama3_rope_factors(shape)
    assert factors.shape == (shape.head_dim // 2,)
    assert factors[0] == 1.0 and factors[-1] == shape.llama3_rope[0]
    assert np.all(np.diff(factors) >= 0)  # high frequencies kept, low ones scaled, smoothly between
    assert ((factors > 1) & (factors < shape.llama3_rope[0])).any()


MINIATURES = {  # the real vocabulary and metadata, narrow and two layers deep
    "llama3.2-1b": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512),
    "qwen2.5-1.5b": dict(layers=2, hidden=256, heads=2, kv_heads=1, head_dim=128, ffn=512),
}


@pytest.fixture(scope="module", params=sorted(MINIATURES))
def miniature(request, tmp_path_factory) -> str:
    shape = dataclasses.replace(SHAPES[request.param], **MINIATURES[request.param])
    return write_shaped_f16(str(tmp_path_factory.mktemp("shaped") / "mini.gguf"), shape, seed=3)


def _relative_gap(path: str) -> float:
    ref = llama_cpp_logits(llama_cpp_model(path, n_ctx=64), IDS)
    ours = window_logits(LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1), IDS).double().numpy()
    assert ref.shape == ours.shape and ref.max() - ref.min() > 1.0  # the comparison is not vacuous
    return float(np.abs(ours - ref).max() / (ref.max() - ref.min()))


@pytest.mark.reference
def test_a_miniature_gives_llama_cpps_logits(miniature):
    assert _relative_gap(miniature) <= 1e-2


@pytest.mark.reference
def test_a_miniature_quantized_by_llama_cpp_gives_its_logits(miniature, tmp_path):
    from services.testing.tiny_gguf import quantize_preset

    q4km = quantize_preset(miniature, "Q4_K_M")
    assert "Q4_K" in {GgufLoader(q4km).tensor_type(n) for n in GgufLoader(q4km).tensor_names}
    assert _relative_gap(q4km) <= 2e-2


@pytest.mark.reference
def test_the_padded_vocabulary_tokenizes_as_llama_cpp_does(miniature, varied_text):
    from llama_cpp import Llama

    llm = Llama(model_path=miniature, vocab_only=True, verbose=False)
    ours = GgufTokenizer.from_gguf(GgufLoader(miniature))
    text = varied_text[:2000] + " <|unused_7|> plain text that looks like a padding token"
    assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=False)
    assert ours.vocab_size == llm.n_vocab() > 128000
