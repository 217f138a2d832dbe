"""Model-shaped GGUF files: the exact tensor names, shapes and metadata of real 1B-8B architectures with seeded random
weights, quantized by llama.cpp's own quantizer into the presets people download. Performance stand-ins: their text
is noise; their speed, memory and numerics against llama.cpp on the same file are real (docs/models.md, "Shaped
files"). No real 1B-8B GGUF can be downloaded on the build machines, so the benchmarks build these once into a
cache (SHAPED_CACHE) and reuse them; `make test` never builds one.

    python -m services.testing.shaped_gguf llama3.2-1b Q4_K_M     # prints the cached file's path (builds it once)

The tokenizer is SmolLM2's (any prompt tokenizes; the same on both sides of a comparison), its vocabulary padded to
the real one's size with UNUSED tokens (`<|unused_N|>`: never produced by tokenizing, not special to llama.cpp), so
token_embd and output have their real shapes. Weights are N(0, s^2) with s = WEIGHT_GAIN / sqrt(fan_in): every
matmul keeps O(1) activations at any width, so logits stay finite and not degenerate through every layer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from services.testing.tiny_gguf import _Writer
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model

SHAPED_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "shaped")
SHAPED_VERSION = 1  # bump when the files' content changes: the cache key includes it
UNUSED_TYPE = 5  # llama_token_type LLAMA_TOKEN_TYPE_UNUSED
WEIGHT_GAIN = 0.8  # std * sqrt(fan_in) of every matrix
EMBED_GAIN = 2.0  # std * sqrt(hidden) of token_embd / output: logits with a std of ~2 (neither flat nor one-hot)


@dataclass(frozen=True)
class Shape:
    """One real architecture's sizes, as its Hugging Face config.json gives them."""

    arch: str  # GGUF architecture: llama or qwen2
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool  # output.weight is token_embd.weight (no output tensor in the file)
    rope_base: float
    context: int
    rms_eps: float = 1e-5
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low_freq_factor, high_freq_factor, orig ctx
    published_params: float = 0.0  # the parameter count the model's card gives (a check on these sizes)

    @property
    def params(self) -> int:
        """Parameters of a file of this shape (norms and biases included; rope_freqs not)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden
                     + (q + 2 * kv if self.arch == "qwen2" else 0))
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-3.2-1B-Instruct
    "llama3.2-1b": Shape("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, 500000.0, 131072,
                         llama3_rope=(32.0, 1.0, 4.0, 8192), published_params=1.24e9),
    # meta-llama/Llama-3.2-3B-Instruct
    "llama3.2-3b": Shape("llama", 28, 3072, 24, 8, 128, 8192, 128256, True, 500000.0, 131072,
                         llama3_rope=(32.0, 1.0, 4.0, 8192), published_params=3.21e9),
    # meta-llama/Llama-3.1-8B-Instruct
    "llama3.1-8b": Shape("llama", 32, 4096, 32, 8, 128, 14336, 128256, False, 500000.0, 131072,
                         llama3_rope=(8.0, 1.0, 4.0, 8192), published_params=8.03e9),
    # Qwen/Qwen2.5-1.5B-Instruct: q/k/v biases, 6:1 grouped-query attention, a 152k vocabulary
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True, 1000000.0, 32768, rms_eps=1e-6,
                          published_params=1.54e9),
}
SHAPED_PRESETS = ("Q4_K_M", "Q6_K", "Q8_0")  # the ones the benchmarks use; any llama.cpp preset builds


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """rope_freqs.weight [head_dim / 2] for Llama 3.1's rope scaling, as llama.cpp's convert_hf_to_gguf.py writes it."""
    factor, low, high, orig = shape.llama3_rope
    freqs = 1.0 / shape.rope_base ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, numpy shape [rows, cols], std, mean) of every tensor, in file order; std 0 for rope_freqs (computed)."""
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    embed_std = EMBED_GAIN / math.sqrt(s.hidden)
    plan = [("token_embd.weight", (s.vocab, s.hidden), embed_std, 0.0)]
    if s.llama3_rope:
        plan.append(("rope_freqs.weight", (s.head_dim // 2,), 0.0, 0.0))
    for i in range(s.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (s.hidden,), 0.1, 1.0),
                 (b + "attn_q.weight", (q, s.hidden), WEIGHT_GAIN / math.sqrt(s.hidden), 0.0),
                 (b + "attn_k.weight", (kv, s.hidden), WEIGHT_GAIN / math.sqrt(s.hidden), 0.0),
                 (b + "attn_v.weight", (kv, s.hidden), WEIGHT_GAIN / math.sqrt(s.hidden), 0.0)]
        if s.arch == "qwen2":
            plan += [(b + "attn_q.bias", (q,), 0.3, 0.0), (b + "attn_k.bias", (kv,), 0.3, 0.0),
                     (b + "attn_v.bias", (kv,), 0.3, 0.0)]
        plan += [(b + "attn_output.weight", (s.hidden, q), WEIGHT_GAIN / math.sqrt(q), 0.0),
                 (b + "ffn_norm.weight", (s.hidden,), 0.1, 1.0),
                 (b + "ffn_gate.weight", (s.ffn, s.hidden), WEIGHT_GAIN / math.sqrt(s.hidden), 0.0),
                 (b + "ffn_up.weight", (s.ffn, s.hidden), WEIGHT_GAIN / math.sqrt(s.hidden), 0.0),
                 (b + "ffn_down.weight", (s.hidden, s.ffn), WEIGHT_GAIN / math.sqrt(s.ffn), 0.0)]
    plan.append(("output_norm.weight", (s.hidden,), 0.1, 1.0))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, s.hidden), embed_std, 0.0))
    return plan


def write_shaped_f16(path: str, shape: Shape, seed: int = 0) -> str:
    """An F16 GGUF of `shape` (1-D tensors in F32, as llama.cpp's converter writes them), streamed tensor by tensor:
    memory stays at one tensor whatever the model's size."""
    src = GgufLoader(resolve_model("smollm2"))
    tokens = list(src.get("tokenizer.ggml.tokens"))
    types = list(src.get("tokenizer.ggml.token_type"))
    if shape.vocab < len(tokens):
        raise ValueError(f"vocab {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
    pad = shape.vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [UNUSED_TYPE] * pad

    w = _Writer(path, shape.arch)
    w.add_name(f"stagemesh shaped stand-in ({shape.arch}, {shape.params / 1e9:.2f}B, random weights)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(1)  # MOSTLY_F16
    w.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(src.get("tokenizer.ggml.merges"))
    w.add_bos_token_id(src.get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(src.get("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    if src.chat_template:
        w.add_chat_template(src.chat_template)

    plan = _tensor_plan(shape)
    for name, dims, _, _ in plan:
        dtype = np.float16 if len(dims) == 2 else np.float32
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    with tqdm(total=shape.params, desc=f"writing {os.path.basename(path)}", unit="weight", unit_scale=True,
              disable=not sys.stderr.isatty()) as bar:
        for name, dims, std, mean in plan:
            if name == "rope_freqs.weight":
                arr = llama3_rope_factors(shape)
            else:
                arr = rng.standard_normal(dims, dtype=np.float32)
                arr *= std
                arr += mean
                if len(dims) == 2:
                    arr = arr.astype(np.float16)
                bar.update(arr.size)
            w.write_tensor_data(arr)
    w.close()
    return path


def shaped_path(name: str, preset: str, seed: int = 0) -> str:
    return os.path.join(SHAPED_CACHE, f"{name}-s{seed}-v{SHAPED_VERSION}-{preset}.gguf")


def shaped_gguf(name: str, preset: str = "Q4_K_M", seed: int = 0) -> str:
    """The path of `name` (a SHAPES key) quantized to `preset` by llama.cpp (llama_model_quantize, its per-tensor mix
    as llama-quantize applies it), built once into SHAPED_CACHE. The F16 source is removed after quantizing (16 GB
    at 8B)."""
    import llama_cpp

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    dst = shaped_path(name, preset, seed)
    if os.path.exists(dst):
        return dst
    os.makedirs(SHAPED_CACHE, exist_ok=True)
    f16 = shaped_path(name, "F16", seed)
    if not os.path.exists(f16):
        write_shaped_f16(f16 + ".part", SHAPES[name], seed)
        os.replace(f16 + ".part", f16)
    if preset == "F16":
        return f16
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread = max(1, os.cpu_count() or 1)
    if llama_cpp.llama_model_quantize(f16.encode(), (dst + ".part").encode(), params) != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {f16} -> {preset}")
    os.replace(dst + ".part", dst)
    return dst


def drop_f16(name: str, seed: int = 0) -> None:
    """Remove the F16 source once every preset wanted from it is built."""
    try:
        os.remove(shaped_path(name, "F16", seed))
    except FileNotFoundError:
        pass


def tensor_types(path: str) -> dict[str, int]:
    """GGML type name -> bytes of the tensors stored in it: what a preset's mix really is."""
    loader = GgufLoader(path)
    out: dict[str, int] = {}
    for n in loader.tensor_names:
        t = loader.tensor_type(n)
        out[t] = out.get(t, 0) + loader.tensor_bytes([n])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("presets", nargs="*", default=["Q4_K_M"], help="llama.cpp presets (default Q4_K_M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 source in the cache")
    args = p.parse_args(argv)
    for preset in args.presets:
        print(shaped_gguf(args.shape, preset, args.seed), flush=True)
    if not args.keep_f16 and "F16" not in args.presets:
        drop_f16(args.shape, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
