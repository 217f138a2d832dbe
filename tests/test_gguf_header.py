"""The header reader `up` checks a model with before anything heavy loads (shared/files/gguf_header.py) reads what
the gguf package reads: the architecture and layer count of real and tiny files, a clear error for a non-GGUF file."""

from __future__ import annotations

import pytest

from services.testing.tiny_gguf import TinySpec, write_tiny_gguf
from shared.errors import GgufError
from shared.files.gguf_header import header_values, layer_count
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model


@pytest.mark.parametrize("spec", [TinySpec(arch="llama"), TinySpec(arch="qwen3", head_dim=32),
                                  TinySpec(arch="starcoder2", tied=False), TinySpec(arch="phi2")],
                         ids=lambda s: s.arch)
def test_layer_count_and_architecture_agree_with_the_gguf_package(spec, tmp_path):
    path = write_tiny_gguf(str(tmp_path / f"{spec.arch}.gguf"), spec)
    loader = GgufLoader(path)
    assert layer_count(path) == loader.arch_get("block_count")
    assert header_values(path, {"general.architecture"}) == {"general.architecture": loader.architecture}


def test_the_default_model_reads_past_its_vocabulary_to_what_is_asked():
    path = resolve_model("smollm2")
    loader = GgufLoader(path)
    wanted = {"general.architecture", "tokenizer.ggml.model", "llama.block_count", "tokenizer.ggml.eos_token_id"}
    got = header_values(path, wanted)
    assert got == {k: loader.get(k) for k in wanted} and layer_count(path) == 30


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GgufError, match="is not a GGUF file"):
        layer_count(str(bad))
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # cut inside the header
    with pytest.raises(GgufError, match="ends early"):
        layer_count(str(bad))
