"""Tiny random GGUF files per architecture vs llama.cpp: proves rope layout, biases and norms. Plus bad files."""

import subprocess

import numpy as np
import pytest
import torch

from shared.errors import GgufError, UnsupportedArchitecture, UnsupportedTensorType
from shared.generation import window_logits
from shared.gguf_loader import GgufLoader
from shared.runtime import LocalPipeline
from tests.conftest import stagemesh_cmd
from tests.factories import (
    GGMLQuantizationType,
    TinySpec,
    llama_cpp_logits,
    llama_cpp_model,
    q8_1_bytes,
    write_tiny_gguf,
)

IDS = [504, 3458, 282, 4649, 314, 7042, 30, 378, 2358, 16, 28, 99, 1234, 77, 5, 902, 44, 12000, 3, 8]


@pytest.mark.parametrize("spec,tolerance", [
    (TinySpec(arch="llama"), 1e-3),
    (TinySpec(arch="llama", tied=False, kv_heads=4), 1e-3),
    (TinySpec(arch="qwen2"), 1e-3),
    (TinySpec(arch="qwen3", head_dim=32), 1e-3),  # head_dim * heads != hidden, as in real qwen3
    (TinySpec(arch="llama", float_type="F16"), 1e-2),
    (TinySpec(arch="qwen2", float_type="F16"), 1e-2),
    (TinySpec(arch="qwen3", float_type="F16", head_dim=32), 1e-2),
], ids=lambda v: v if isinstance(v, float) else f"{v.arch}-{v.float_type}-{'tied' if v.tied else 'untied'}")
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


def _cli_error(*args):
    proc = subprocess.run(stagemesh_cmd(*args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_corrupt_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(GgufError, match="not a readable GGUF"):
        GgufLoader(str(bad))
    assert "not a readable GGUF" in _cli_error("inspect", "--model", str(bad))


def test_truncated_gguf_is_one_line_error(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GgufError, match="truncated"):
        GgufLoader(str(cut))
    assert "truncated" in _cli_error("generate", "--model", str(cut), "--prompt", "hi")


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "odd.gguf"), TinySpec(arch="mamba9000"))
    with pytest.raises(UnsupportedArchitecture, match="llama, mistral, qwen2, qwen3"):
        LocalPipeline.load(GgufLoader(path), None, torch.float32)
    assert "mamba9000" in _cli_error("inspect", "--model", path)


def test_unsupported_tensor_type_names_the_tensor_and_types(tmp_path):
    spec = TinySpec()
    override = {"blk.0.attn_q.weight": (q8_1_bytes(64, 64), GGMLQuantizationType.Q8_1)}
    path = write_tiny_gguf(str(tmp_path / "q81.gguf"), spec, override)
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.attn_q\.weight has type Q8_1.*Q4_1"):
        LocalPipeline.load(GgufLoader(path), None, torch.float32)
    assert "Q8_1" in _cli_error("generate", "--model", path, "--prompt", "hi")


def test_missing_file_and_unknown_alias():
    assert "neither a known alias" in _cli_error("inspect", "--model", "no-such-model")
