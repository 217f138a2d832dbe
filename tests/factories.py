"""Test factories: tiny random GGUF files written with the `gguf` writer (SmolLM2's tokenizer copied in so
llama.cpp can load them too), and a llama.cpp reference runner."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from shared.gguf_loader import GgufLoader
from shared.model_registry import resolve_model


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    tied: bool = True
    float_type: str = "F32"  # F32 or F16 for matmul weights
    seed: int = 0


def _copy_tokenizer(writer: GGUFWriter, src: GgufLoader) -> None:
    writer.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
    writer.add_token_list(src.get("tokenizer.ggml.tokens"))
    writer.add_token_types(src.get("tokenizer.ggml.token_type"))
    writer.add_token_merges(src.get("tokenizer.ggml.merges"))
    writer.add_bos_token_id(src.get("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(src.get("tokenizer.ggml.eos_token_id"))
    writer.add_add_bos_token(False)


def write_tiny_gguf(path: str, spec: TinySpec = TinySpec(), tensor_type_override: dict | None = None) -> str:
    """A small random-weight model of spec.arch; tensor_type_override maps a tensor name to raw (bytes, type)."""
    src = GgufLoader(resolve_model("smollm2"))
    vocab = len(src.get("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(path, spec.arch)
    w.add_block_count(spec.layers)
    w.add_context_length(512)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_file_type(0 if spec.float_type == "F32" else 1)
    _copy_tokenizer(w, src)

    mat_dtype = np.float32 if spec.float_type == "F32" else np.float16

    def mat(rows, cols, scale=0.08):
        return (rng.standard_normal((rows, cols)) * scale).astype(mat_dtype)

    def vec(n, base=1.0, scale=0.1):
        return (base + rng.standard_normal(n) * scale).astype(np.float32)

    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    tensors = {"token_embd.weight": mat(vocab, spec.hidden, 0.5), "output_norm.weight": vec(spec.hidden)}
    if not spec.tied:
        tensors["output.weight"] = mat(vocab, spec.hidden, 0.5)
    for i in range(spec.layers):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": vec(spec.hidden), b + "ffn_norm.weight": vec(spec.hidden),
            b + "attn_q.weight": mat(q, spec.hidden), b + "attn_k.weight": mat(kv, spec.hidden),
            b + "attn_v.weight": mat(kv, spec.hidden), b + "attn_output.weight": mat(spec.hidden, q),
            b + "ffn_gate.weight": mat(spec.ffn, spec.hidden), b + "ffn_up.weight": mat(spec.ffn, spec.hidden),
            b + "ffn_down.weight": mat(spec.hidden, spec.ffn),
        })
        if spec.arch == "qwen2":
            tensors.update({b + "attn_q.bias": vec(q, 0.0, 0.5), b + "attn_k.bias": vec(kv, 0.0, 0.5),
                            b + "attn_v.bias": vec(kv, 0.0, 0.5)})
        if spec.arch == "qwen3":
            tensors.update({b + "attn_q_norm.weight": vec(spec.head_dim), b + "attn_k_norm.weight": vec(spec.head_dim)})
    for name, arr in tensors.items():
        if tensor_type_override and name in tensor_type_override:
            raw, qtype = tensor_type_override[name]
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q8_1_bytes(rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a Q8_1 tensor (a type the gguf package cannot dequantize)."""
    block, size = 32, 40
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


def llama_cpp_model(path: str, n_ctx: int = 512):
    """llama-cpp-python over path, every position's logits kept, quiet."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                 n_threads=max(1, (os.cpu_count() or 2)))


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    """[T, V] logits llama.cpp computes for ids from an empty context."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


__all__ = ["GGMLQuantizationType", "TinySpec", "llama_cpp_logits", "llama_cpp_model", "q8_1_bytes", "write_tiny_gguf"]
