"""Stateless decoder TransformerModel over one layer range (llama, mistral, qwen2, qwen3, starcoder2, phi3, phi2,
gemma, gemma2, gemma3).

Holds weights and config only. The runtime owns the KV cache and passes it in. Shapes:
N = packed tokens of a micro-batch, D = hidden, H / KVH = query / kv heads, hd = head_dim.
The residual stream, norms and rope stay float32; every matmul is a shared.models.linear weight (int4 / prepacked
bf16 / float32 by the weights mode) whose output is added to the stream as it is (the add promotes, no extra cast).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.batch.layout import BatchLayout
from shared.errors import CapabilityMissing, GgufError
from shared.files.gguf_loader import GgufLoader, RawTensor
from shared.files.layers import LayerRange
from shared.kernels import qdot
from shared.models.attention import Attention, Scores, choose_attention
from shared.models.config import ModelConfig, RopeScaling
from shared.models.crossover import choose_prefill_dtype
from shared.models.device import resolve_kv_dtype
from shared.models.kv_cache import KVCache, position_bytes
from shared.models.linear import (
    WEIGHT_MODES,
    Int4Linear,
    Linear,
    QdotLinear,
    QuantizedRows,
    SwitchedLinear,
    auto_nbytes,
    dequantize,
    lean_nbytes,
    make_linear,
    stack_layers,
)
from shared.models.memory import (
    PieceMemory,
    PrefillCopy,
    check_fits,
    default_budget,
    plan_prefill_copy,
    return_freed_memory,
)


class LayerHook(Protocol):
    """Observe (or, in tests, perturb) each layer's input and output; used by tracing. Returns the tensor to use."""

    def on_layer_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...

    def on_layer_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...


# GGUF per-block tensor names -> our parameter names, declared once (tinygrad's convert_from_gguf style).
# Fused at load: q|k|v -> qkv, gate|up -> gate_up, so one matmul does the work of several (packed form included).
# Already fused in some files (phi3): attn_qkv, and ffn_up holding gate|up.
log = logging.getLogger("stagemesh.model")

BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm", "attn_norm.bias": "attn_norm_b",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_qkv.weight": "wqkv",
    "attn_qkv.bias": "bqkv", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo", "attn_output.bias": "bo",
    "ffn_norm.weight": "ffn_norm", "ffn_norm.bias": "ffn_norm_b",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "ffn_up.bias": "b_up", "ffn_down.bias": "b_down",
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "gate_exps", "ffn_up_exps.weight": "up_exps",
    "ffn_down_exps.weight": "down_exps",
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None,
             kernel: bool = False) -> torch.Tensor:
    """Over the last dim, computed in float32 (weight float32); the result cast once to `dtype` (the next matmul's
    input) if given. kernel (an eager step where qdot.cpp loads, float32 activations: TransformerModel.run_layers):
    in qdot.cpp's one-pass kernel, where torch's took six ops a row; a traced step keeps torch's, which inductor
    fuses with its neighbours."""
    if kernel and x.dtype == torch.float32 and x.is_contiguous():
        out = qdot.rms_norm(x, weight, eps)
    else:
        out = F.rms_norm(x.float(), weight.shape, weight, eps)
    return out if dtype is None else out.to(dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         dtype: torch.dtype | None = None, kernel: bool = False) -> torch.Tensor:
    """RMSNorm (bias None) or LayerNorm with bias (starcoder2), over the last dim, in float32; cast and `kernel` as
    rms_norm's."""
    if bias is None:
        return rms_norm(x, weight, eps, dtype, kernel)
    out = F.layer_norm(x.float(), weight.shape, weight, bias, eps)
    return out if dtype is None else out.to(dtype)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float, scaling: RopeScaling | None = None,
                 context: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [N, rope_dim/2] float32 for the given absolute positions (llama.cpp's theta_i = p * base^(-2i/d)),
    scaled as ggml_rope_ext scales them (config.RopeScaling) for sequences of at most `context` tokens."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    if scaling is not None:
        inv_freq = inv_freq * _scaled_frequencies(rope_dim, theta, scaling, context, positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [N, rope_dim/2]
    if scaling is None or scaling.mscale == 1.0:
        return torch.cos(angles).float(), torch.sin(angles).float()
    return (torch.cos(angles) * scaling.mscale).float(), (torch.sin(angles) * scaling.mscale).float()


@functools.lru_cache(maxsize=16)
def _scaled_frequencies(rope_dim: int, theta: float, scaling: RopeScaling, context: int,
                        device: torch.device) -> torch.Tensor:
    """[rope_dim/2] float64: what scaling multiplies each pair's base^(-2i/d) by (ggml's rope_yarn, per pair i).
    theta_extrap = p base^(-2i/d) / ff_i; theta_interp = theta_extrap / factor; yarn's theta =
    theta_interp (1 - ramp_i) + theta_extrap ramp_i, i.e. theta_extrap (ramp_i + (1 - ramp_i) / factor)."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    factors = scaling.factors_for(context)
    mult = torch.ones_like(i) if factors is None else 1.0 / torch.tensor(factors, dtype=torch.float64)
    freq_scale = 1.0 / scaling.factor
    if not scaling.yarn:
        return (mult * freq_scale).to(device)
    low, high = yarn_corr_dims(rope_dim, scaling.original_context, theta, scaling.beta_fast, scaling.beta_slow)
    ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # 1: extrapolate (fast dims), 0: interpolate
    return (mult * (freq_scale * (1.0 - ramp) + ramp)).to(device)


def yarn_corr_dims(rope_dim: int, original_context: int, theta: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair indices where YaRN's ramp starts and ends -- the dims that turn
    beta_fast (resp. beta_slow) times over original_context positions."""
    def dim(rotations: float) -> float:
        return rope_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    return max(0.0, math.floor(dim(beta_fast))), min(rope_dim - 1.0, math.ceil(dim(beta_slow)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x: [N, heads, hd] float32; rotates the first rope_dim dims. normal: pairs (2i, 2i+1); neox: (i, i + d/2)."""
    d = cos.shape[-1] * 2
    rot, rest = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, d/2]
    if style == "normal" and torch.compiler.is_compiling():  # real arithmetic: inductor does not fuse complex numbers
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    elif style == "normal":  # (x0 + i x1) * (cos + i sin): eagerly, one complex multiply instead of six ops and a stack
        pairs = torch.view_as_complex(rot.contiguous().view(*rot.shape[:-1], d // 2, 2))  # [N, heads, d/2]
        out = torch.view_as_real(pairs * torch.complex(c, s)).flatten(-2)
    else:
        x0, x1 = rot[..., : d // 2], rot[..., d // 2:]
        out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


@dataclass
class Block:
    """One transformer block: float32 norms/biases; matmuls as shared.models.linear weights (x [N, in] -> [N, out])."""

    attn_norm: torch.Tensor
    qkv: Linear  # [D] -> [q_size + 2 * kv_size]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: Linear  # [q_size] -> [D]
    ffn_norm: torch.Tensor | None  # None: parallel block (phi2), the MLP reads attn_norm's output
    gate_up: Linear  # [D] -> [2 * I] (gated MLP: gate|up), or [D] -> [I] (gelu MLP: up only)
    w_down: Linear  # [I] -> [D]
    attn_norm_b: torch.Tensor | None = None  # LayerNorm biases ([D])
    ffn_norm_b: torch.Tensor | None = None
    wo_bias: torch.Tensor | None = None  # [D]
    up_bias: torch.Tensor | None = None  # [I]
    down_bias: torch.Tensor | None = None  # [D]
    router: torch.Tensor | None = None  # MoE: [E, D] float32; then gate_up / w_down are None and experts hold them
    experts: list[tuple[Linear, Linear]] | None = None  # MoE: per expert (gate_up [D] -> [2 I], down [I] -> [D])
    post_attn_norm: torch.Tensor | None = None  # gemma2/3: RMSNorm ([D]) of the attention's / the MLP's output
    post_ffn_norm: torch.Tensor | None = None

    def linears(self) -> dict[str, Linear]:
        dense = {"qkv": self.qkv, "wo": self.wo, "gate_up": self.gate_up, "w_down": self.w_down}
        experts = {f"expert{e}.{n}": w for e, pair in enumerate(self.experts or []) for n, w in zip(("gate_up", "down"), pair)}
        return {k: w for k, w in {**dense, **experts}.items() if w is not None}

    def vectors(self) -> list[torch.Tensor]:
        return [t for t in (self.attn_norm, self.qkv_bias, self.q_norm, self.k_norm, self.ffn_norm, self.attn_norm_b,
                            self.ffn_norm_b, self.wo_bias, self.up_bias, self.down_bias, self.router, self.post_attn_norm,
                            self.post_ffn_norm) if t is not None]


def _own_block(b: Block, alone: bool) -> Block:
    """A copy of `b` whose stackable kernels (what TransformerModel._stack_layers restacks: Int4Linear, QdotLinear,
    a SwitchedLinear's small one) are objects of its own, unstacked, reading the same tensors: stacking them anew
    leaves `b` as it was. `alone` (a piece of one layer, which stacks nothing): their tensors are copied too, so the
    new piece does not hold the old stack's memory through a row of it."""

    def own(k):
        if isinstance(k, SwitchedLinear):
            k = copy.copy(k)
            k.small = own(k.small)
            return k
        if not isinstance(k, (Int4Linear, QdotLinear)):
            return k
        k = copy.copy(k)
        k.stack, k.index = None, 0
        if alone:
            for f in k.STACKED:
                setattr(k, f, getattr(k, f).clone())
        return k

    return dataclasses.replace(b, qkv=own(b.qkv), wo=own(b.wo), gate_up=own(b.gate_up), w_down=own(b.w_down))


def expert_rows(raw: RawTensor, e: int) -> RawTensor:
    """Expert e's matrix of a 3-D expert tensor [E, out, in] (stored as E * out rows of bytes)."""
    experts, out, cols = raw.shape
    return RawTensor(f"{raw.name}[{e}]", raw.ggml_type, (out, cols), raw.data[e * out:(e + 1) * out])


def resolve_weights(weights: str | None, dtype: torch.dtype) -> str:
    """The weights mode a load uses: float32 compute means the exact reference (f32) unless told otherwise."""
    weights = weights or ("f32" if dtype == torch.float32 else "auto")
    if weights not in WEIGHT_MODES:
        raise GgufError(f"unknown weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    return weights


class TransformerModel:
    """Weights + config of layers [range.start, range.stop), plus embedding and/or lm_head by position.

    dtype: the activation / KV-cache dtype between matmuls; `weights` (a WEIGHT_MODES entry) says which kernel
    each matmul runs as. batch_invariant: every row's numbers are independent of the other rows of its micro-batch
    (one kernel at every batch size, per-sequence attention of exact length)."""

    def __init__(self, config: ModelConfig, layers: LayerRange, blocks: list[Block], dtype: torch.dtype,
                 embedding: QuantizedRows | None, output_norm: torch.Tensor | None, output: Linear | None,
                 weights: str = "f32", batch_invariant: bool = False, sources: dict[str, list[str]] | None = None,
                 output_norm_b: torch.Tensor | None = None, output_bias: torch.Tensor | None = None):
        self.config = config
        self.layers = layers
        self.position = layers.position(config.num_layers)
        self.blocks = blocks
        self.dtype = dtype
        self.kv_dtype = dtype  # its K/V cache's (new_kv_cache); from_gguf sets --kv-dtype's
        self.embedding = embedding  # token ids -> [N, D] float32, or None
        self.output_norm = output_norm  # [D] or None
        self.output = output  # [D] -> [V], or None
        self.output_norm_b = output_norm_b  # [D]: LayerNorm architectures
        self.output_bias = output_bias  # [V] or None
        self.weights = weights
        self.batch_invariant = batch_invariant
        # an eager step's norms and K/V writes on qdot.cpp (float32 activations on a CPU where it loads; run_layers)
        self.eager_kernels = (dtype == torch.float32 and bool(blocks) and blocks[0].attn_norm.device.type == "cpu"
                              and qdot.usable())
        self._sources = sources or {}  # our weight name -> the GGUF tensors it was built from
        self.tensor_types: dict[str, str] = {}  # GGUF tensor name -> its type (from_gguf fills it)
        self.memory: PieceMemory | None = None  # set by from_gguf
        self.layer_norms: dict[str, torch.Tensor] = {}  # attn_norm / ffn_norm of every layer, [L, D] (_stack_layers)
        self._rope_by_context: dict[int, Ropes] = {}  # rope_tables' tables of every position, per context length
        self._stack_layers()

    def _stack_layers(self) -> None:
        """Each kind of per-layer weight as one [L, ...] tensor, each block reading its row (no second copy): the
        int4 and integer-dot matmuls' parts (linear.stack_layers) and attn_norm / ffn_norm (layer_norms, which run_layers reads).
        A compiled step then takes ten-odd weight tensors as inputs instead of ten per layer (each input costs the
        graph call a few µs: shared/models/compiled_decode.py)."""
        for name in ("qkv", "wo", "gate_up", "w_down"):
            kernels = [b.linears().get(name) for b in self.blocks]
            kernels = [k.small if isinstance(k, SwitchedLinear) else k for k in kernels]
            if all(isinstance(k, (Int4Linear, QdotLinear)) for k in kernels):
                stack_layers(kernels)
        for name in ("attn_norm", "ffn_norm"):
            rows = [getattr(b, name) for b in self.blocks]
            if len(rows) > 1 and all(r is not None for r in rows) and len({r.shape for r in rows}) == 1:
                self.layer_norms[name] = torch.stack(rows)
                for b, row in zip(self.blocks, self.layer_norms[name]):
                    setattr(b, name, row)

    # ---- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, loader: GgufLoader, layers: LayerRange | None = None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", *, weights: str | None = None,
                  batch_invariant: bool = False, memory_budget: int | None = None, kv_slots: int = 0,
                  max_seq_len: int | None = 0, kv_dtype: torch.dtype | None = None) -> TransformerModel:
        """Load only the tensors of `layers` (default: all), plus embedding / head by stage position.
        weights: a WEIGHT_MODES entry; None means f32 for float32 dtype, else auto. memory_budget (bytes; None:
        shared.models.memory.default_budget()) and the KV cache the piece will hold (kv_slots x max_seq_len) decide
        whether auto keeps its dense prefill copy or runs lean (shared.models.memory); kv_dtype: the K/V cache's
        (None: the activations' dtype, shared.models.device.resolve_kv_dtype)."""
        weights = resolve_weights(weights, dtype)
        config = ModelConfig.from_gguf(loader)
        layers = layers or LayerRange(0, config.num_layers)
        position = layers.position(config.num_layers)
        names = loader.names_for(layers, position)
        # the embedding table stays in the file's map (only looked-up rows are read); every other tensor is copied out
        # when its weight is built, then dropped (PieceTensors: the peak while loading is the weights, not twice them)
        raw = loader.tensors_on_demand(
            [n for n in names if n != "token_embd.weight" or (position.has_lm_head and config.tied_embeddings)])
        embedding = QuantizedRows(loader.raw("token_embd.weight", mapped=True)) if position.has_embedding else None

        budget = memory_budget if memory_budget is not None else default_budget()
        # the K/V the weights leave room for: KVCache's slots and scratch row of the context asked; with none asked
        # (0: the model's, as far as the budget holds it, StageRuntime's fit_context), one row of the model's context
        rows, context = (kv_slots + 1, min(max_seq_len, config.context_length)) if max_seq_len \
            else (1, config.context_length)
        kv_dtype = kv_dtype or resolve_kv_dtype(None, dtype)
        kv_bytes = rows * context * position_bytes(len(layers), config.num_kv_heads, config.head_dim, kv_dtype)
        matrices = [t for n in raw if len((t := raw.type_and_shape(n))[1]) >= 2 and not n.endswith("ffn_gate_inp.weight")
                    and (n != "token_embd.weight" or position.has_lm_head)]  # (ggml type, shape) of each
        lean_bytes = sum(lean_nbytes(*t) for t in matrices)
        check_fits(f"layers {layers}", lean_bytes)  # before anything is built
        prefill = None
        if weights == "auto" and not batch_invariant and torch.device(device).type == "cpu":
            copy = plan_prefill_copy(budget, lean_bytes, kv_bytes,
                                     lambda dt: sum(auto_nbytes(*t, dt) for t in matrices),
                                     choose_prefill_dtype(config))
            log.info("layers %s: %s", layers, copy.reason)
            prefill, weights = copy.dtype, ("auto" if copy.dtype is not None else "lean")
        else:
            copy = PrefillCopy(None, f"weights mode {weights}" + (", batch-invariant" if batch_invariant else ""))

        def linear(*parts: str | RawTensor) -> Linear:  # GGUF tensor names, or tensors already cut (an expert's rows)
            return make_linear([raw[n] if isinstance(n, str) else n for n in parts], weights, device, batch_invariant,
                               prefill)

        def vector(name: str) -> torch.Tensor:
            return dequantize(raw[name]).reshape(-1).to(device)

        sources: dict[str, list[str]] = {}
        blocks = [cls._block(config, raw, i, linear, vector, sources, loader.path)
                  for i in tqdm(layers, desc=f"layers {layers}", unit="layer", disable=not sys.stderr.isatty(),
                                leave=False)]
        output_norm = output = output_norm_b = output_bias = None
        if position.has_lm_head:
            output_norm = vector("output_norm.weight")
            output_norm_b = vector("output_norm.bias") if config.traits.norm == "layer" else None
            output_bias = vector("output.bias") if "output.bias" in raw else None
            head = "output.weight" if not config.tied_embeddings else "token_embd.weight"
            # read from the file's map as it is converted, not copied first: a 128k-row head is the largest tensor,
            # and its copy would sit beside the weights built from it (every kernel builds its own copy)
            output, sources["output"] = linear(loader.raw(head, mapped=True)), [head]
        raw.release()  # every weight is built: the last copies go before the layers are stacked (another copy)
        model = cls(config, layers, blocks, dtype, embedding, output_norm, output, weights, batch_invariant, sources,
                    output_norm_b, output_bias)
        model.tensor_types = {n: loader.tensor_type(n) for ns in sources.values() for n in ns}
        model.kv_dtype = kv_dtype
        model.memory = PieceMemory(budget=budget, kv_bytes=kv_bytes, file_bytes=loader.tensor_bytes(names),
                                   prefill_copy=copy.reason)
        loader.release_pages()
        return_freed_memory()
        return model

    def rebuilt(self, layers: LayerRange, loader: GgufLoader,
                load: Callable[[LayerRange], TransformerModel] | None) -> TransformerModel:
        """This piece moved to `layers`, which overlaps its own (a stage in a re-split, a join's giver, a leave's
        taker): the layers it keeps are the blocks it holds, only the gained ones are loaded -- load(range), the
        range below its own and the one above, each as from_gguf loads a piece -- and the kernels of the whole are
        stacked afresh (a copy of their bytes), nothing of the kept layers read from the file or converted again.
        This piece serves on unchanged meanwhile: the new one's blocks and kernels are objects of its own (their
        tensors shared until restacked). The embedding and head come from whichever side holds them in `layers`.
        `loader`: the file it was loaded from (the tensors' sizes). load may be None where nothing is gained (a
        sub-range of its own: nothing read from the file or converted)."""
        mine = self.layers
        kept = LayerRange(max(mine.start, layers.start), min(mine.stop, layers.stop))
        if kept.start >= kept.stop:
            raise ValueError(f"layers {layers} do not overlap this piece's {mine}")
        below = LayerRange(layers.start, kept.start) if layers.start < kept.start else None
        above = LayerRange(kept.stop, layers.stop) if kept.stop < layers.stop else None
        if (below or above) and load is None:
            raise ValueError(f"layers {layers} go past this piece's {mine}: the gained ones need load")
        lower = load(below) if below else None
        upper = load(above) if above else None
        position = layers.position(self.config.num_layers)
        ours = self.blocks[kept.start - mine.start:kept.stop - mine.start]
        alone = len(layers) < 2  # a piece of one layer stacks nothing: its tensors are copied (_own_block)
        blocks = [_own_block(b, alone) for b in [*(lower.blocks if lower else []), *ours,
                                                *(upper.blocks if upper else [])]]
        first = lower if lower is not None else self  # holds the embedding where `layers` starts the model
        last = upper if upper is not None else self  # holds the head where `layers` ends it
        head = position.has_lm_head
        sources = {k: v for part in (lower, self, upper) if part is not None for k, v in part._sources.items()
                   if (k == "output" and head and part is last) or (k.startswith("blk.") and int(k.split(".")[1]) in layers)}
        model = TransformerModel(self.config, layers, blocks, self.dtype,
                                 first.embedding if position.has_embedding else None,
                                 last.output_norm if head else None, last.output if head else None, self.weights,
                                 self.batch_invariant, sources, last.output_norm_b if head else None,
                                 last.output_bias if head else None)
        model.kv_dtype = self.kv_dtype
        types = {n: t for part in (lower, self, upper) if part is not None for n, t in part.tensor_types.items()}
        model.tensor_types = {n: t for n, t in types.items() if any(n in ns for ns in sources.values())}
        if self.memory is not None:
            model.memory = PieceMemory(budget=self.memory.budget,
                                       kv_bytes=self.memory.kv_bytes * len(layers) // len(mine),
                                       file_bytes=loader.tensor_bytes(loader.names_for(layers, position)),
                                       prefill_copy=self.memory.prefill_copy)
        return model

    @staticmethod
    def _block(config: ModelConfig, raw: Mapping[str, RawTensor], i: int, linear, vector, sources: dict[str, list[str]],
               path: str) -> Block:
        t = config.traits
        p = {ours: f"blk.{i}.{gguf_name}" for gguf_name, ours in BLOCK_TENSORS.items() if f"blk.{i}.{gguf_name}" in raw}
        qkv = [p["wqkv"]] if t.fused_qkv and "wqkv" in p else [p.get("wq"), p.get("wk"), p.get("wv")]
        gate_up = {"swiglu": [p.get("w_up")] if t.fused_gate_up else [p.get("w_gate"), p.get("w_up")],
                   "geglu": [p.get("w_gate"), p.get("w_up")], "gelu": [p.get("w_up")]}[t.mlp] if not t.moe else []
        required = {"attn_norm", "wo"} | (set() if t.parallel else {"ffn_norm"})
        required |= {"router", "gate_exps", "up_exps", "down_exps"} if t.moe else {"w_down"}
        required |= ({"bqkv"} if "wqkv" in p else {"bq", "bk", "bv"}) if t.qkv_bias else set()
        required |= {"q_norm", "k_norm"} if t.qk_norm else set()
        required |= ({"attn_norm_b"} | (set() if t.parallel else {"ffn_norm_b"})) if t.norm == "layer" else set()
        required |= {"bo", "b_up", "b_down"} if t.linear_bias else set()
        required |= {"post_attn_norm", "post_ffn_norm"} if t.post_norms else set()
        missing = [BLOCK_TENSORS_INV[r] for r in sorted(required) if r not in p]
        missing += [what for what, names in (("attn_q/k/v (or attn_qkv)", qkv), ("ffn_gate/ffn_up", gate_up)) if None in names]
        if missing:
            raise GgufError(f"{path}: block {i} lacks {', '.join(missing)} needed by architecture {config.architecture}")
        fused = {"qkv": qkv, "wo": [p["wo"]]}
        if not t.moe:
            fused |= {"gate_up": gate_up, "w_down": [p["w_down"]]}
        sources.update({f"blk.{i}.{ours}": names for ours, names in fused.items()})
        experts = None
        if t.moe:  # 3-D [E, I, D] / [E, D, I] tensors: expert e's matrix is rows [e * out, (e + 1) * out)
            for e in range(config.num_experts):
                sources[f"blk.{i}.expert{e}.gate_up"] = [p["gate_exps"], p["up_exps"]]
                sources[f"blk.{i}.expert{e}.down"] = [p["down_exps"]]
            experts = [(linear(expert_rows(raw[p["gate_exps"]], e), expert_rows(raw[p["up_exps"]], e)),
                        linear(expert_rows(raw[p["down_exps"]], e))) for e in range(config.num_experts)]
        bias = torch.cat([vector(p["bq"]), vector(p["bk"]), vector(p["bv"])]) if "bq" in p else None
        if "bqkv" in p:  # fused q|k|v bias (phi2)
            bias = vector(p["bqkv"])

        def optional(ours: str) -> torch.Tensor | None:
            return vector(p[ours]) if ours in p else None

        return Block(
            attn_norm=vector(p["attn_norm"]), qkv=linear(*fused["qkv"]), qkv_bias=bias,
            q_norm=optional("q_norm"), k_norm=optional("k_norm"), wo=linear(*fused["wo"]),
            ffn_norm=optional("ffn_norm"), gate_up=linear(*fused["gate_up"]) if not t.moe else None,
            w_down=linear(*fused["w_down"]) if not t.moe else None, experts=experts,
            router=vector(p["router"]).view(config.num_experts, -1) if t.moe else None,  # [E, D]
            attn_norm_b=optional("attn_norm_b"), ffn_norm_b=optional("ffn_norm_b"), wo_bias=optional("bo"),
            up_bias=optional("b_up"), down_bias=optional("b_down"), post_attn_norm=optional("post_attn_norm"),
            post_ffn_norm=optional("post_ffn_norm"),
        )

    # ---- capabilities ----------------------------------------------------------------------------------

    @property
    def has_embedding(self) -> bool:
        return self.position.has_embedding

    @property
    def has_lm_head(self) -> bool:
        return self.position.has_lm_head

    def weight_bytes(self) -> int:
        """Bytes of every weight representation this piece holds in memory (quantized kernels and dense copies both
        counted); the embedding table is read from the file's map and not counted (mapped_bytes)."""
        total = sum(t.nbytes for b in self.blocks for t in b.vectors())
        total += sum(w.nbytes for b in self.blocks for w in b.linears().values())
        for part in (self.output_norm, self.output_norm_b, self.output_bias, self.output):
            total += part.nbytes if part is not None else 0
        return total

    def memory_report(self) -> dict:
        """Budget, KV cache, the file's share, the weights held against it, and the prefill-copy decision."""
        mapped = self.embedding.nbytes if self.embedding is not None else 0
        return self.memory.report(self.weight_bytes(), mapped) if self.memory is not None else {}

    def weight_summary(self) -> dict[str, str]:
        """GGUF matrix name -> what it runs as here, e.g. 'int4-g32 (< 12 tokens) | bf16-prepacked'. Norms and
        biases always run as float32 and are not listed."""
        ours: dict[str, str] = {}
        for local, b in enumerate(self.blocks):
            for name, w in b.linears().items():
                ours[f"blk.{self.layers.start + local}.{name}"] = w.kind
        if self.output is not None:
            ours["output"] = self.output.kind
        out = {gguf: kind + (f" (fused {name.rsplit('.', 1)[-1]})" if len(self._sources[name]) > 1 else "")
               for name, kind in ours.items() for gguf in self._sources[name]}
        if self.embedding is not None:
            head = out.get("token_embd.weight")
            out["token_embd.weight"] = f"{self.embedding.kind} (embedding)" + (f", {head} (lm_head)" if head else "")
        return out

    def runs_as_by_type(self) -> dict[str, dict[str, int]]:
        """GGUF tensor type -> what its matrices run as here and how many of them, e.g. {"Q3_K": {"q3_k-dot-q8": 112}}
        (a stage's /info: weights.by_type). Empty for a model not built from a file."""
        out: dict[str, dict[str, int]] = {}
        summary = self.weight_summary()
        # a fused matmul's parts each count once, under the kernel's kind without the "(fused ...)" note
        for name, kind in ((n, k.split(" (fused ")[0]) for n, k in summary.items()):
            if name in self.tensor_types:
                runs = out.setdefault(self.tensor_types[name], {})
                runs[kind] = runs.get(kind, 0) + 1
        return out

    def new_kv_cache(self, num_slots: int, max_seq_len: int, device: torch.device | str = "cpu",
                     scratch: bool = False, prefix_slots: int = 0, prefix_bytes: int | None = None,
                     live_bytes: int | None = None) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), num_slots, max_seq_len, c.num_kv_heads, c.head_dim, self.kv_dtype, device,
                       scratch, prefix_slots, prefix_bytes, live_bytes)

    # ---- compute -----------------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> hidden [N, D] float32 (the GGUF's own values, whatever the weights mode)."""
        if self.embedding is None:
            raise CapabilityMissing(f"layers {self.layers} ({self.position.value} stage) hold no token embedding; "
                                    "only the first stage embeds token ids")
        hidden = self.embedding(token_ids)
        return hidden if self.config.embed_scale == 1.0 else hidden * self.config.embed_scale

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, D] -> logits [M, V] float32 (final norm included)."""
        if self.output is None or self.output_norm is None:
            raise CapabilityMissing(f"layers {self.layers} ({self.position.value} stage) hold no lm_head; "
                                    "only the last stage computes logits")
        logits = self.output(norm(hidden, self.output_norm, self.output_norm_b, self.config.norm_eps, self.dtype)).float()
        if cap := self.config.final_softcap:  # gemma2
            logits = torch.tanh(logits / cap) * cap
        return logits if self.output_bias is None else logits + self.output_bias

    def rope_tables(self, positions: torch.Tensor, context: int) -> Ropes:
        """cos / sin [N, rope_dim/2] float32 at `positions`: (every layer's, the sliding layers' own or None). Read
        from tables of positions 0 .. context - 1 computed once (the numbers rope_cos_sin gives at each: a step then
        indexes rather than computes them, a cost every one-token step of every piece would pay;
        benchmarks/decode_step.py measures the step)."""
        if positions.numel() and int(positions.max()) >= context:
            return self._rope_at(positions, context)
        index = positions.to(torch.long)
        rope, swa = self._rope_table(context)
        return (rope[0][index], rope[1][index]), None if swa is None else (swa[0][index], swa[1][index])

    def rope_row(self, pos: int, context: int) -> Ropes:
        """rope_tables at one position pos < context, as views of the tables' row (the numbers rope_tables gives,
        without indexing: [1, rope_dim/2] each, contiguous)."""
        rope, swa = self._rope_table(context)
        row = slice(pos, pos + 1)
        return (rope[0][row], rope[1][row]), None if swa is None else (swa[0][row], swa[1][row])

    def _rope_table(self, context: int) -> Ropes:
        """The rope tables of positions 0 .. context - 1, computed once per context."""
        if context not in self._rope_by_context:
            self._rope_by_context[context] = self._rope_at(torch.arange(context), context)
        return self._rope_by_context[context]

    def _rope_at(self, positions: torch.Tensor, context: int) -> Ropes:
        c = self.config
        rope = rope_cos_sin(positions, c.rope_dim, c.rope_theta, c.rope_scaling, context)
        if not any(c.is_sliding(layer) for layer in self.layers):
            return rope, None
        return rope, rope_cos_sin(positions, c.rope_dim, c.rope_theta_swa, c.rope_scaling_swa, context)  # gemma3

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, layout: BatchLayout, kv: KVCache, hook: LayerHook | None = None) -> torch.Tensor:
        """hidden [N, D] float32 -> [N, D] float32 through this piece's layers, writing their K/V into kv."""
        return self.run_layers(hidden, self.rope_tables(layout.positions, kv.max_seq_len), choose_attention(self.config, self.dtype, self.batch_invariant, layout),
                               kv.k, kv.v, hook)

    def run_layers(self, hidden: torch.Tensor, ropes: Ropes, attention: Attention, k_layers: list[torch.Tensor],
                   v_layers: list[torch.Tensor], hook: LayerHook | None = None) -> torch.Tensor:
        """The piece's layers, the one definition of a step: hidden [N, D] float32 -> [N, D] float32, each layer's
        K/V written into k_layers / v_layers ([slots, KVH, max_seq, hd] each) at attention's (token_slots,
        positions). forward runs it eagerly; shared.models.compiled_decode compiles this very function for one
        sequence's decode step (attention a OneSequenceDecode, static shapes but the context length)."""
        c = self.config
        scores = {False: Scores(c.attn_scale, c.attn_softcap), True: Scores(c.attn_scale, c.attn_softcap, c.sliding_window)}
        # qdot.cpp's norm and K/V writes, eagerly; a compiled step's trace (attention.traced) keeps torch's ops, for
        # inductor to fuse (torch.compiler.is_compiling() would not do: it is true in every thread while one compiles)
        kernel = self.eager_kernels and not attention.traced
        for local, block in enumerate(self.blocks):
            layer = self.layers.start + local
            if hook is not None:
                hidden = hook.on_layer_input(layer, hidden)
            # float32 residual stream + the block's outputs (bf16 or float32; the add promotes, no extra copy)
            x = norm(hidden, self._layer_norm("attn_norm", local, block), block.attn_norm_b, c.norm_eps, self.dtype,
                     kernel)
            sliding = c.is_sliding(layer)
            cos, sin = ropes[1] if sliding else ropes[0]
            attn = self._attention(block, x, cos, sin, attention, k_layers[local], v_layers[local], scores[sliding],
                                   kernel)
            if block.post_attn_norm is not None:  # gemma2/3: each branch's output is normed before its add
                attn = rms_norm(attn, block.post_attn_norm, c.norm_eps, kernel=kernel)
            if c.traits.parallel:  # phi2: attention and MLP both read x (the block has no ffn_norm)
                hidden = hidden + (attn + self._mlp(block, x))
            else:
                h = hidden + attn
                ffn_norm = self._layer_norm("ffn_norm", local, block)
                mlp = self._mlp(block, norm(h, ffn_norm, block.ffn_norm_b, c.norm_eps, self.dtype, kernel))
                hidden = h + (mlp if block.post_ffn_norm is None else rms_norm(mlp, block.post_ffn_norm, c.norm_eps,
                                                                                kernel=kernel))
            if hook is not None:
                hidden = hook.on_layer_output(layer, hidden)
        return hidden

    def _layer_norm(self, name: str, local: int, block: Block) -> torch.Tensor:
        """Layer `local`'s attn_norm / ffn_norm weight: its row of layer_norms (the same values as the block's)."""
        stacked = self.layer_norms.get(name)
        return getattr(block, name) if stacked is None else stacked[local]

    def _mlp(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        if b.experts is not None:
            return self._moe(b, x)
        if self.config.traits.mlp == "gelu":  # starcoder2: down(gelu(up x + b_up)) + b_down, tanh GELU as ggml's
            up = b.gate_up(x)  # [N, I]
            up = F.gelu(up.float() + b.up_bias if b.up_bias is not None else up, approximate="tanh")
            out = b.w_down(up.to(self.dtype))  # [N, D]
        else:
            gate, up = b.gate_up(x).chunk(2, dim=-1)  # [N, I] each
            act = F.gelu(gate, approximate="tanh") if self.config.traits.mlp == "geglu" else F.silu(gate)
            out = b.w_down(act * up)  # [N, D]
        return out if b.down_bias is None else out.float() + b.down_bias

    def _moe(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        """Each token's top-k experts by softmax router probability, their outputs weighted by those probabilities
        renormalised over the k (qwen3moe). x [N, D] -> [N, D] float32; each expert runs once on its tokens. Always
        eager: which experts run is data, so under torch.compile each choice would be a graph; the compiled decode
        step calls it between its graphs (compiled_decode.mark_graph_breaks)."""
        probs = torch.softmax(x.float() @ b.router.T, dim=-1)  # [N, E]
        # ties to the lower expert index, as llama.cpp's argsort (std::sort, insertion sort for <= 16 experts)
        weights, chosen = (t[:, :self.config.experts_used] for t in probs.sort(dim=-1, descending=True, stable=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros(x.shape[0], self.config.hidden_size, dtype=torch.float32, device=x.device)
        for e in chosen.unique().tolist():
            rows, rank = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = b.experts[e]
            gate, up = gate_up(x[rows]).chunk(2, dim=-1)  # [n_e, I] each
            out.index_add_(0, rows, down(F.silu(gate) * up).float() * weights[rows, rank, None])
        return out

    def _attention(self, b: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores = Scores(), kernel: bool = False) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        qkv = b.qkv(x)  # [N, q_size + 2 kv_size]
        if b.qkv_bias is not None:
            qkv = qkv.float() + b.qkv_bias
        v = qkv[:, c.q_size + c.kv_size:].view(n, c.num_kv_heads, c.head_dim).to(self.dtype)
        style = c.traits.rope_style
        if b.q_norm is None:  # rope q and k together: [N, H + KVH, hd], in float32 as llama.cpp does
            qk = apply_rope(qkv[:, :c.q_size + c.kv_size].float().view(n, -1, c.head_dim), cos, sin, style).to(self.dtype)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        else:
            q, k = qkv[:, :c.q_size].float().view(n, c.num_heads, c.head_dim), qkv[:, c.q_size:c.q_size + c.kv_size].float()
            q = apply_rope(rms_norm(q, b.q_norm, c.norm_eps), cos, sin, style).to(self.dtype)
            k = apply_rope(rms_norm(k.view(n, c.num_kv_heads, c.head_dim), b.k_norm, c.norm_eps), cos, sin, style)
            k = k.to(self.dtype)
        # k_cache / v_cache: [slots, KVH, max_seq, hd]; write this micro-batch's keys/values first (eagerly, where
        # qdot.cpp loads, both in one call)
        if kernel:
            qdot.write_kv(k_cache, v_cache, attention.token_slots, attention.positions, k, v)
        else:
            k_cache[attention.token_slots, :, attention.positions] = k.to(k_cache.dtype)
            v_cache[attention.token_slots, :, attention.positions] = v.to(v_cache.dtype)
        out = attention.attend(q, k_cache, v_cache, how)  # [N, H, hd]
        out = b.wo(out.reshape(n, c.q_size))  # [N, D]
        return out if b.wo_bias is None else out.float() + b.wo_bias


Ropes = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]  # (all layers', sliding's)


BLOCK_TENSORS_INV = {v: k for k, v in BLOCK_TENSORS.items()}
