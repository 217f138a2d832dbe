"""Tiny random GGUF files of every architecture, written with the `gguf` writer (SmolLM2's tokenizer copied in so
llama.cpp can load them too), and a llama.cpp reference runner: the tests' model factory, and what
benchmarks/decode_step.py measures each architecture on."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model


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
    experts: int = 4  # qwen3moe: experts per layer (ffn: one expert's width), experts_used per token
    experts_used: int = 2
    rope_dim: int | None = None  # partial rotary (phi2): rotate only the first rope_dim dims of each head
    weight_scale: float = 0.08  # std of matrix entries (0.64 / sqrt(hidden) keeps activations O(1) at any width)
    quant: str | None = None  # Q4_0 / Q4_1 / Q8_0 ...: matmul weights quantized with gguf.quants (token_embd: Q8_0)
    sliding_window: int = 8  # gemma2 / gemma3: attention.sliding_window (shorter than the test prompts)
    softcaps: tuple[float, float] = (1.0, 5.0)  # gemma2: attn_logit_softcapping, final_logit_softcapping (small: they bite)
    router_ties: bool = False  # qwen3moe, 4 experts top-2: experts 1 and 2 tie exactly at the top-k boundary (_tied_router)


class _Writer(GGUFWriter):
    """gguf's GGUFWriter, packing a metadata array in one go rather than element by element (the library took over a
    second a file for the copied vocabulary; every test that builds a tiny model paid it). The same bytes
    (tests/test_tiny_models.py compares them with the library's writer)."""

    def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
        if (vtype != GGUFValueType.ARRAY or self.endianess != GGUFEndian.LITTLE or not isinstance(val, Sequence)
                or isinstance(val, (bytes, str)) or not val):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        item_type = sub_type or GGUFValueType.get_type(val[0])
        one_of_each_type = {type(v): v for v in val}.values()  # get_type depends on the value's type alone
        if sub_type is None and not all(GGUFValueType.get_type(v) is item_type for v in one_of_each_type):
            raise ValueError("All items in a GGUF array should be of the same type")
        head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", item_type, len(val))
        if item_type == GGUFValueType.STRING:
            encoded = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            return head + b"".join(len(e).to_bytes(8, "little") + e for e in encoded)
        fmt = self._simple_value_packing.get(item_type)
        if fmt is None:  # arrays of arrays
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        return head + struct.pack(f"<{len(val)}{fmt}", *val)


def _copy_tokenizer(writer: GGUFWriter, src: GgufLoader) -> None:
    writer.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
    writer.add_token_list(src.get("tokenizer.ggml.tokens"))
    writer.add_token_types(src.get("tokenizer.ggml.token_type"))
    writer.add_token_merges(src.get("tokenizer.ggml.merges"))
    writer.add_bos_token_id(src.get("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(src.get("tokenizer.ggml.eos_token_id"))
    writer.add_add_bos_token(False)


LAYER_NORM_ARCHS = ("starcoder2", "phi2")  # LayerNorm (weight + bias, layer_norm_epsilon) instead of RMSNorm


def _tied_router(rng: np.random.Generator, spec: TinySpec) -> np.ndarray:
    """Router rows [u, 0, 0, -u]: for every token experts 1 and 2 score exactly 0 (bitwise, whatever the matmul
    kernel) and sit between +-u.x, so the top-2 is expert 0 or 3 (by the sign of u.x) plus one of the tied pair:
    which one is down to the tie rule alone (their expert weights differ)."""
    assert (spec.experts, spec.experts_used) == (4, 2), "router_ties: 4 experts, top-2"
    u = rng.standard_normal(spec.hidden) * 0.5
    return np.stack([u, np.zeros_like(u), np.zeros_like(u), -u]).astype(np.float32)


def write_tiny_gguf(path: str, spec: TinySpec = TinySpec(), tensor_type_override: dict | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    extra_metadata: dict[str, str | int | float] | None = None) -> str:
    """A small random-weight model of spec.arch; tensor_type_override maps a tensor name to raw (bytes, type);
    extra_tensors are written as they are (e.g. rope_factors_long.weight); extra_metadata maps a key after the
    architecture prefix (e.g. "rope.scaling.type") to a string, an int (written uint32) or a float (float32)."""
    src = GgufLoader(resolve_model("smollm2"))
    vocab = len(src.get("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(spec.seed)
    w = _Writer(path, spec.arch)
    w.add_block_count(spec.layers)
    w.add_context_length(512)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.rope_dim or spec.head_dim)
    w.add_rope_freq_base(1e6 if spec.arch == "gemma3" else 10000.0)  # gemma3: its sliding layers keep 10000
    if spec.arch in ("gemma2", "gemma3"):
        w.add_sliding_window(spec.sliding_window)
    if spec.arch == "gemma2":
        w.add_attn_logit_softcapping(spec.softcaps[0])
        w.add_final_logit_softcapping(spec.softcaps[1])
    if spec.arch in LAYER_NORM_ARCHS:
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if spec.arch == "qwen3moe":
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.ffn)
    w.add_file_type(0 if spec.float_type == "F32" else 1)
    for key, value in (extra_metadata or {}).items():
        add = {str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)]
        add(f"{spec.arch}.{key}", value)
    _copy_tokenizer(w, src)

    mat_dtype = np.float32 if spec.float_type == "F32" else np.float16

    def mat(rows, cols, scale=spec.weight_scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(mat_dtype)

    def vec(n, base=1.0, scale=0.1):
        return (base + rng.standard_normal(n) * scale).astype(np.float32)

    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    tensors = {"token_embd.weight": mat(vocab, spec.hidden, 0.5), "output_norm.weight": vec(spec.hidden)}
    if not spec.tied:
        tensors["output.weight"] = mat(vocab, spec.hidden, 0.5)
    if spec.arch in LAYER_NORM_ARCHS:
        tensors["output_norm.bias"] = vec(spec.hidden, 0.0)
    if spec.arch == "phi2" and not spec.tied:
        tensors["output.bias"] = vec(vocab, 0.0, 0.5)
    for i in range(spec.layers):
        b = f"blk.{i}."
        if spec.arch == "starcoder2":  # LayerNorm with bias, biases on every projection, up -> gelu -> down
            tensors.update({
                b + "attn_norm.weight": vec(spec.hidden), b + "attn_norm.bias": vec(spec.hidden, 0.0),
                b + "ffn_norm.weight": vec(spec.hidden), b + "ffn_norm.bias": vec(spec.hidden, 0.0),
                b + "attn_q.weight": mat(q, spec.hidden), b + "attn_k.weight": mat(kv, spec.hidden),
                b + "attn_v.weight": mat(kv, spec.hidden), b + "attn_output.weight": mat(spec.hidden, q),
                b + "attn_q.bias": vec(q, 0.0, 0.5), b + "attn_k.bias": vec(kv, 0.0, 0.5),
                b + "attn_v.bias": vec(kv, 0.0, 0.5), b + "attn_output.bias": vec(spec.hidden, 0.0),
                b + "ffn_up.weight": mat(spec.ffn, spec.hidden), b + "ffn_up.bias": vec(spec.ffn, 0.0),
                b + "ffn_down.weight": mat(spec.hidden, spec.ffn), b + "ffn_down.bias": vec(spec.hidden, 0.0),
            })
            continue
        if spec.arch == "phi2":  # parallel block: one LayerNorm, fused q|k|v, biases everywhere, gelu MLP
            tensors.update({
                b + "attn_norm.weight": vec(spec.hidden), b + "attn_norm.bias": vec(spec.hidden, 0.0),
                b + "attn_qkv.weight": mat(q + 2 * kv, spec.hidden), b + "attn_qkv.bias": vec(q + 2 * kv, 0.0, 0.5),
                b + "attn_output.weight": mat(spec.hidden, q), b + "attn_output.bias": vec(spec.hidden, 0.0),
                b + "ffn_up.weight": mat(spec.ffn, spec.hidden), b + "ffn_up.bias": vec(spec.ffn, 0.0),
                b + "ffn_down.weight": mat(spec.hidden, spec.ffn), b + "ffn_down.bias": vec(spec.hidden, 0.0),
            })
            continue
        if spec.arch == "qwen3moe":  # qwen3 attention; router + 3-D expert tensors [E, out, in]
            e = spec.experts
            tensors.update({
                b + "attn_norm.weight": vec(spec.hidden), b + "ffn_norm.weight": vec(spec.hidden),
                b + "attn_q.weight": mat(q, spec.hidden), b + "attn_k.weight": mat(kv, spec.hidden),
                b + "attn_v.weight": mat(kv, spec.hidden), b + "attn_output.weight": mat(spec.hidden, q),
                b + "attn_q_norm.weight": vec(spec.head_dim), b + "attn_k_norm.weight": vec(spec.head_dim),
                b + "ffn_gate_inp.weight": _tied_router(rng, spec) if spec.router_ties
                else (rng.standard_normal((e, spec.hidden)) * 0.5).astype(np.float32),
                b + "ffn_gate_exps.weight": mat(e * spec.ffn, spec.hidden).reshape(e, spec.ffn, spec.hidden),
                b + "ffn_up_exps.weight": mat(e * spec.ffn, spec.hidden).reshape(e, spec.ffn, spec.hidden),
                b + "ffn_down_exps.weight": mat(e * spec.hidden, spec.ffn).reshape(e, spec.hidden, spec.ffn),
            })
            continue
        if spec.arch == "phi3":  # fused q|k|v and gate|up
            tensors.update({
                b + "attn_norm.weight": vec(spec.hidden), b + "ffn_norm.weight": vec(spec.hidden),
                b + "attn_qkv.weight": mat(q + 2 * kv, spec.hidden), b + "attn_output.weight": mat(spec.hidden, q),
                b + "ffn_up.weight": mat(2 * spec.ffn, spec.hidden), b + "ffn_down.weight": mat(spec.hidden, spec.ffn),
            })
            continue
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
        if spec.arch in ("qwen3", "gemma3"):
            tensors.update({b + "attn_q_norm.weight": vec(spec.head_dim), b + "attn_k_norm.weight": vec(spec.head_dim)})
        if spec.arch in ("gemma2", "gemma3"):  # sandwich norms on the attention's and the MLP's output
            tensors.update({b + "post_attention_norm.weight": vec(spec.hidden), b + "post_ffw_norm.weight": vec(spec.hidden)})
    tensors.update(extra_tensors or {})
    for name, arr in tensors.items():
        if tensor_type_override and name in tensor_type_override:
            raw, qtype = tensor_type_override[name]
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif spec.quant and arr.ndim == 2:
            qtype = GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else GGMLQuantizationType[spec.quant]
            w.add_tensor(name, quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_first_layers(src: str, dst: str, layers: int) -> str:
    """A copy of the GGUF file `src` with its first `layers` blocks only (blk.N for N >= layers dropped, block_count
    set), every other field and tensor as it is: a real model's weights at a fraction of its depth, which llama.cpp
    loads too. Returns dst."""
    from gguf import GGUFReader
    from gguf.constants import Keys

    reader = GGUFReader(src)
    arch = str(reader.fields[Keys.General.ARCHITECTURE].contents())
    count = f"{arch}.block_count"
    if not 0 < layers < int(reader.fields[count].contents()):
        raise ValueError(f"{src} has {int(reader.fields[count].contents())} blocks: keep 1 to one fewer, not {layers}")
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, layers if field.name == count else field.contents(), kind, sub_type=sub)
    kept = [t for t in reader.tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def q8_1_bytes(rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a Q8_1 tensor (a type the gguf package cannot dequantize)."""
    block, size = 32, 40
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


GGML_KV_TYPES = {"float32": 0, "float16": 1}  # ggml_type of a K/V cache, as -ctk / -ctv name them: f32, f16


def llama_cpp_model(path: str, n_ctx: int = 512, kv_dtype: str = "float16"):
    """llama-cpp-python over path, every position's logits kept, quiet, its K/V cache in `kv_dtype` (float16:
    llama.cpp's default; float32: -ctk f32 -ctv f32). YaRN's betas and attn factor come from the file as in llama.cpp's
    own tools (-1: from the model; llama-cpp-python's defaults would override them)."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                 n_threads=max(1, (os.cpu_count() or 2)), yarn_beta_fast=-1.0, yarn_beta_slow=-1.0,
                 yarn_attn_factor=-1.0, type_k=GGML_KV_TYPES[kv_dtype], type_v=GGML_KV_TYPES[kv_dtype])


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    """[T, V] logits llama.cpp computes for ids from an empty context."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


__all__ = ["GGMLQuantizationType", "TinySpec", "llama_cpp_logits", "llama_cpp_model", "q8_1_bytes", "write_tiny_gguf"]


# ---- tokenizer-only GGUFs (chat templates, special tokens) ------------------------------------------------------

# llama.cpp token types (llama_token_type)
CONTROL_TYPE, USER_DEFINED_TYPE, UNKNOWN_TYPE, BYTE_TYPE = 3, 4, 2, 6
_SPM_WORDS = ("what is the capital of france berlin paris repeat exactly you said before hello there sure "
              "assistant user system model answer question a an i am it").split()


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: <unk> <s> </s>, 256 byte-fallback tokens, single characters, and every
    substring of "▁word" for a few words (so whole words merge). Scores strictly decrease: no ties to break."""
    tokens, types = ["<unk>", "<s>", "</s>"], [UNKNOWN_TYPE, CONTROL_TYPE, CONTROL_TYPE]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE_TYPE] * 256
    pieces: list[str] = ["▁"] + sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!'\n"))
    for w in _SPM_WORDS:
        for word in ("▁" + w, "▁" + w.capitalize()):
            pieces += [word[i:j] for i in range(len(word)) for j in range(i + 2, len(word) + 1)]
    seen: set[str] = set(tokens)
    ordered = [p for p in sorted(dict.fromkeys(pieces), key=lambda p: (len(p), p)) if not (p in seen or seen.add(p))]
    tokens += ordered
    types += [1] * len(ordered)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(ordered))]
    return tokens, scores, types


def write_vocab_gguf(path: str, *, model: str = "gpt2", control_tokens: tuple[str, ...] = (),
                     chat_template: str | None = None, bos: str | None = None, eos: str | None = None,
                     add_bos: bool = False, add_space_prefix: bool = True) -> str:
    """A tokenizer-only GGUF (llama architecture metadata, no tensors; llama.cpp opens it with vocab_only=True).

    model "gpt2": SmolLM2's byte-level BPE vocabulary; "llama": a small SentencePiece vocabulary (_spm_vocab).
    control_tokens are appended as CONTROL tokens (a token already in the vocabulary is made CONTROL instead)."""
    if model == "gpt2":
        src = GgufLoader(resolve_model("smollm2"))
        tokens = list(src.get("tokenizer.ggml.tokens"))
        types = list(src.get("tokenizer.ggml.token_type"))
        scores = None
        merges = list(src.get("tokenizer.ggml.merges"))
    elif model == "llama":
        tokens, scores, types = _spm_vocab()
        merges = None
    else:
        raise ValueError(f"model must be 'gpt2' or 'llama', got {model!r}")
    for t in control_tokens:
        if t in tokens:
            types[tokens.index(t)] = CONTROL_TYPE
        else:
            tokens.append(t)
            types.append(CONTROL_TYPE)
            if scores is not None:
                scores.append(0.0)
    w = _Writer(path, "llama")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("smollm" if model == "gpt2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(add_space_prefix)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(tokens.index(bos))
    if eos is not None:
        w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_vocab(path: str):
    """llama-cpp-python over path's vocabulary only (tokenize/detokenize; no weights needed)."""
    from llama_cpp import Llama

    return Llama(model_path=path, vocab_only=True, verbose=False)


__all__ += ["llama_cpp_vocab", "write_vocab_gguf"]


# ---- quantizing with llama.cpp itself (types the gguf package cannot write) ---------------------------------------

# The llama_ftype whose pure (unmixed) quantization writes each type.
_FTYPE_OF = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K",
             "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_S": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "IQ2_S": "IQ2_M",
             "IQ2_XS": "IQ2_XS", "IQ2_XXS": "IQ2_XXS", "IQ1_M": "IQ1_M", "IQ1_S": "IQ1_S"}
LLAMA_QUANTIZED_TYPES = tuple(_FTYPE_OF)


def llama_quantize(src: str, dst: str, qtype: str, embedding_type: str = "Q8_0", output_type: str = "Q8_0") -> str:
    """dst = src (an F32/F16 GGUF) with every block matrix quantized to qtype by llama.cpp's own quantizer
    (llama_model_quantize, pure: no per-tensor mix); token_embd / output as the given types (vocab-sized matrices
    in IQ1/IQ2 take minutes to quantize). A uniform importance matrix (every column weighs 1) goes with it: the
    IQ1 / IQ2 / IQ3_XXS quantizers refuse to run without one. llama.cpp prints its progress on stdout."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{_FTYPE_OF[qtype]}")
    params.pure = True
    params.token_embedding_type = int(GGMLQuantizationType[embedding_type])
    params.output_tensor_type = int(GGMLQuantizationType[output_type])
    params.nthread = max(1, os.cpu_count() or 1)
    loader = GgufLoader(src)
    matrices = [(n, loader.tensor_shape(n)[-1]) for n in loader.tensor_names if len(loader.tensor_shape(n)) == 2]
    ones = [(ctypes.c_float * cols)(*([1.0] * cols)) for _, cols in matrices]
    entries = (llama_cpp.llama_model_imatrix_data * (len(matrices) + 1))()  # terminated by a NULL name
    for entry, (name, cols), data in zip(entries, matrices, ones):
        entry.name, entry.data, entry.size = name.encode(), ctypes.cast(data, ctypes.POINTER(ctypes.c_float)), cols
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {qtype} failed")
    return dst


__all__ += ["LLAMA_QUANTIZED_TYPES", "llama_quantize"]


def ggml_libraries():
    """llama.cpp's own ggml (llama-cpp-python's build) through ctypes: (libggml-base, libggml-cpu), the CPU backend
    initialised. Their C functions by name: quantize_q3_K(src, dst, nrows, n_per_row, imatrix) -> bytes written,
    quantize_row_q8_K(x, y, k), ggml_vec_dot_q3_K_q8_K(n, &s, bs, vx, bx, vy, by, nrc) (one row's dot, this CPU's SIMD
    build), and the same for the other types."""
    import ctypes

    import llama_cpp

    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = ctypes.CDLL(os.path.join(lib, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    return base, cpu


def ggml_quantize_rows(matrix: np.ndarray, qtype: str) -> np.ndarray:
    """matrix [N, K] float32 -> its rows as llama.cpp's quantizer writes them in qtype (a K-quant: Q2_K .. Q6_K, no
    importance matrix), [N, K/256 * the type's block bytes] uint8: the blocks a real file of that type holds."""
    import ctypes

    base, _ = ggml_libraries()
    n, k = matrix.shape
    block_bytes = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    rows = np.zeros((n, k // 256 * block_bytes), np.uint8)
    src = np.ascontiguousarray(matrix, dtype=np.float32)
    fn = getattr(base, f"quantize_{qtype[:2].lower()}_K")
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    if fn(src.ctypes.data, rows.ctypes.data, n, k, None) != rows.nbytes:
        raise RuntimeError(f"llama.cpp's quantize_{qtype} wrote another size than {rows.nbytes} bytes")
    return rows


__all__ += ["ggml_libraries", "ggml_quantize_rows"]


# ---- llama.cpp's quantizer presets, as model hubs ship files (mixed types per tensor) ------------------------------

# llama_ftype presets. The IQ2 / IQ3 ones go with Q8_0 embedding and output tensors: llama.cpp's own choice for those
# (IQ types of vocab-sized matrices) takes minutes on two cores; the block matrices get the preset's own mix.
PRESETS = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S",
           "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_M")
QUANT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "quantized")


class PresetRefused(Exception):
    """llama.cpp cannot produce this preset for this file (e.g. an IQ2 type that needs an importance matrix)."""


def quantize_preset(src: str, preset: str) -> str:
    """src (any GGUF) quantized by llama.cpp's llama_model_quantize to `preset` as llama-quantize does it (a per-tensor
    mix, requantizing if src is quantized; "F32": every tensor dequantized, the same numbers unquantized), cached under QUANT_CACHE by src's fingerprint: built once, reused by
    every later run. Raises PresetRefused with llama.cpp's reason when it cannot."""
    import llama_cpp

    dst = os.path.join(QUANT_CACHE, f"{GgufLoader(src).fingerprint}-{preset}.gguf")
    refused = dst + ".refused"
    if os.path.exists(refused):
        raise PresetRefused(open(refused).read())
    if os.path.exists(dst):
        return dst
    os.makedirs(QUANT_CACHE, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if preset == "F32" else f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.allow_requantize = True
    params.nthread = max(1, os.cpu_count() or 1)
    if preset.startswith(("IQ2", "IQ3")):
        params.token_embedding_type = params.output_tensor_type = int(GGMLQuantizationType.Q8_0)
    part = f"{dst}.{os.getpid()}.part"  # two suite parts may quantize the same preset at once: each its own, one wins
    if llama_cpp.llama_model_quantize(src.encode(), part.encode(), params) != 0:
        reason = f"llama.cpp's quantizer refused {preset} for {os.path.basename(src)} (see its log above)"
        with open(refused, "w") as f:
            f.write(reason)
        raise PresetRefused(reason)
    os.replace(part, dst)
    return dst


__all__ += ["PRESETS", "PresetRefused", "quantize_preset"]
