"""ModelConfig: one dataclass read from GGUF metadata, with per-architecture traits declared in one table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import GgufError, UnsupportedArchitecture
from shared.files.gguf_loader import GgufLoader


@dataclass(frozen=True)
class ArchTraits:
    """What distinguishes one decoder architecture from another, as data. The block is always
    h = x + attn(norm(x)); out = h + mlp(norm(h)); these say which norm, which projections, which MLP."""

    rope_style: str  # "normal": rotate adjacent pairs (llama in GGUF); "neox": rotate first/second halves
    qkv_bias: bool = False  # qwen2: q, k, v projections carry a bias
    qk_norm: bool = False  # qwen3: per-head RMS norm on q and k before rope
    norm: str = "rms"  # "rms": RMSNorm (weight); "layer": LayerNorm (weight + bias), eps from layer_norm_epsilon
    mlp: str = "swiglu"  # "swiglu": down(silu(gate) * up); "geglu": down(gelu_tanh(gate) * up); "gelu": down(gelu_tanh(up))
    linear_bias: bool = False  # starcoder2: every projection (q, k, v, output, up, down) carries a bias
    fused_qkv: bool = False  # phi3: one attn_qkv tensor holds q|k|v (separate q, k, v accepted too)
    fused_gate_up: bool = False  # phi3: ffn_up holds gate|up, [2 I, D]
    sliding_window: bool = False  # phi3: attention.sliding_window honoured by serving at most that many positions
    parallel: bool = False  # phi2: out = x + attn(norm(x)) + mlp(norm(x)), one norm, no ffn_norm
    moe: bool = False  # qwen3moe: the MLP is top-k of expert_count SwiGLU experts (softmax router, top-k renormalised)
    # gemma family (llama.cpp's gemma*.cpp); GGUF norm weights already hold gemma's 1 + w (the converter adds the 1)
    embed_scale: bool = False  # the embedding times sqrt(D)
    post_norms: bool = False  # gemma2/3: h = x + post_attention_norm(attn(norm(x))); out = h + post_ffw_norm(mlp(norm(h)))
    tied_head: bool = False  # gemma, gemma2: the lm_head is always token_embd (llama.cpp refuses an output.weight)
    swa_pattern: int = 0  # gemma2 2, gemma3 6: layer i is a sliding-window layer iff i % p < p - 1
    swa_default: int = 0  # gemma2 4096: the window when the file names none (gemma3: then no layer slides)
    swa_rope_10k: bool = False  # gemma3: sliding layers rope with freq_base_swa (default 10000), unscaled
    attn_softcap: float | None = None  # gemma2 (50): scores -> c * tanh(scores / c); the default of attn_logit_softcapping
    final_softcap: float | None = None  # gemma2 (30), gemma3 (0: none): the same on logits; final_logit_softcapping
    wide_query_scale_layers: int = 0  # its 27B (by layer count, as llama.cpp decides): q scaled 1/sqrt(D/H), not 1/sqrt(hd)


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope_style="normal"),
    "mistral": ArchTraits(rope_style="normal"),
    "mistral3": ArchTraits(rope_style="normal"),  # its text model: the llama block (rope scaling refused below)
    "qwen2": ArchTraits(rope_style="neox", qkv_bias=True),
    "qwen3": ArchTraits(rope_style="neox", qk_norm=True),
    "starcoder2": ArchTraits(rope_style="neox", norm="layer", mlp="gelu", qkv_bias=True, linear_bias=True),
    "phi2": ArchTraits(rope_style="neox", norm="layer", mlp="gelu", qkv_bias=True, linear_bias=True, fused_qkv=True,
                       parallel=True),
    "qwen3moe": ArchTraits(rope_style="neox", qk_norm=True, moe=True),
    "phi3": ArchTraits(rope_style="neox", fused_qkv=True, fused_gate_up=True, sliding_window=True),
    "gemma": ArchTraits(rope_style="neox", mlp="geglu", embed_scale=True, tied_head=True),
    "gemma2": ArchTraits(rope_style="neox", mlp="geglu", embed_scale=True, tied_head=True, post_norms=True, swa_pattern=2,
                         swa_default=4096, attn_softcap=50.0, final_softcap=30.0, wide_query_scale_layers=46),
    "gemma3": ArchTraits(rope_style="neox", mlp="geglu", embed_scale=True, post_norms=True, qk_norm=True, swa_pattern=6,
                         swa_rope_10k=True, final_softcap=0.0, wide_query_scale_layers=62),
}


HEAD_COST_FACTOR = 0.55

# llama.cpp reads rope.scaling.yarn_beta_fast / yarn_beta_slow / yarn_log_multiplier only for these architectures
# (other architectures use its defaults whatever the file says).
YARN_METADATA_ARCHS = frozenset({"mistral3"})
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Rope beyond theta_i = p * base^(-2i/d), as llama.cpp's ggml_rope_ext computes it; every default is a no-op.

    Per rotated pair i: theta_extrap = p * base^(-2i/d) / ff_i (ff: frequency factors), theta_interp = theta_extrap
    / factor; YaRN mixes the two by a ramp over i (extrapolated where the wavelength is short, interpolated where it
    is long); cos and sin are multiplied by mscale (so q.k by mscale^2)."""

    factor: float = 1.0  # rope.scaling.factor (linear, yarn): theta interpolated by 1/factor
    yarn: bool = False  # ext_factor 1: the ramp mix of interpolated and extrapolated theta
    original_context: int = 0  # rope.scaling.original_context_length (llama.cpp's n_ctx_orig_yarn)
    beta_fast: float = 32.0  # yarn: the ramp runs over dims whose rotations in original_context lie in [slow, fast]
    beta_slow: float = 1.0
    mscale: float = 1.0  # the magnitude of cos / sin: yarn's 1 + 0.1 ln(factor) (or a log_mul ratio) x attn_factor
    freq_factors: tuple[float, ...] | None = None  # rope_freqs.weight (llama 3.1): one per pair, for any context
    long_factors: tuple[float, ...] | None = None  # LongRoPE (phi3 128k): for a context > original_context
    short_factors: tuple[float, ...] | None = None  # LongRoPE: for a context <= original_context

    def factors_for(self, context: int) -> tuple[float, ...] | None:
        """The frequency factors a sequence of at most `context` tokens uses: llama.cpp's get_rope_factors with
        n_ctx_seq = context (rope_freqs first; LongRoPE's long set once the context exceeds the original one).
        (llama.cpp pads n_ctx to a multiple of 256 first; the choice is the same whenever original_context is such
        a multiple, as in every LongRoPE model.)"""
        if self.freq_factors is not None:
            return self.freq_factors
        return self.long_factors if context > self.original_context else self.short_factors

    @classmethod
    def from_gguf(cls, loader: GgufLoader, rope_dim: int, context: int) -> RopeScaling | None:
        """None when the file asks for plain rope. context: the trained context (context_length), llama.cpp's
        default for original_context_length."""
        arch, path = loader.architecture, loader.path
        kind = loader.arch_get("rope.scaling.type") or "linear"  # llama.cpp's default: linear, factor 1
        if kind not in ROPE_SCALING_TYPES:
            raise UnsupportedArchitecture(f"{path}: rope scaling type {kind!r} is not supported; supported: "
                                          f"{', '.join(ROPE_SCALING_TYPES)}")
        factor = float(loader.arch_get("rope.scaling.factor") or loader.arch_get("rope.scale_linear") or 1.0)
        factor = 1.0 if kind == "none" else factor
        yarn = kind == "yarn"
        attn_factor = float(loader.arch_get("rope.scaling.attn_factor") or 1.0)
        beta_fast, beta_slow, log_mul = 32.0, 1.0, 0.0
        if arch in YARN_METADATA_ARCHS:
            beta_fast = float(loader.arch_get("rope.scaling.yarn_beta_fast") or beta_fast)
            beta_slow = float(loader.arch_get("rope.scaling.yarn_beta_slow") or beta_slow)
            log_mul = float(loader.arch_get("rope.scaling.yarn_log_multiplier") or 0.0)
        mscale = attn_factor
        if yarn:  # llama_context's yarn_attn_factor times the kernel's 1 + 0.1 ln(factor) (which that divides out)
            def get_mscale(scale: float, m: float) -> float:
                return 1.0 if scale <= 1.0 else 0.1 * m * float(np.log(scale)) + 1.0
            mscale *= get_mscale(factor, 1.0) / (get_mscale(factor, log_mul) if log_mul else 1.0)

        def factors(name: str) -> tuple[float, ...] | None:
            if not loader.has_tensor(name):
                return None
            raw = loader.raw(name)
            if raw.ggml_type != "F32" or raw.shape[-1] < rope_dim // 2:
                raise GgufError(f"{path}: {name} must be F32 with at least rope_dim/2 = {rope_dim // 2} values; it is "
                                f"{raw.ggml_type} {list(raw.shape)}")
            return tuple(float(v) for v in raw.data.numpy().reshape(-1).view(np.float32)[: rope_dim // 2])

        scaling = cls(factor=factor, yarn=yarn, original_context=int(loader.arch_get("rope.scaling.original_context_length")
                                                                      or context),
                      beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale, freq_factors=factors("rope_freqs.weight"),
                      long_factors=factors("rope_factors_long.weight"), short_factors=factors("rope_factors_short.weight"))
        if (scaling.long_factors is None) != (scaling.short_factors is None):
            raise GgufError(f"{path}: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight")
        plain = cls(original_context=scaling.original_context)
        return None if scaling == plain else scaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # RMSNorm's or LayerNorm's, as traits.norm says
    rope_theta: float
    rope_dim: int
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    traits: ArchTraits
    num_experts: int = 0  # MoE: experts per layer, and how many each token uses (intermediate_size: one expert's)
    experts_used: int = 0
    rope_scaling: RopeScaling | None = None  # None: plain rope
    sliding_window: int = 0  # on sliding layers a query at position p sees keys (p - sliding_window, p]
    swa_layers: tuple[bool, ...] = ()  # per layer: a sliding-window layer (empty: none is)
    rope_theta_swa: float = 0.0  # the sliding layers' rope base and scaling (gemma3: 10000, unscaled)
    rope_scaling_swa: RopeScaling | None = None
    attn_scale: float | None = None  # q.k scale; None: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before softmax; 0: none
    final_softcap: float = 0.0  # the same on the logits
    embed_scale: float = 1.0  # the embedding's multiplier

    def is_sliding(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weights(self) -> int:
        """Matmul weights of one block a token goes through (what a decode step streams: the used experts only)."""
        return self._block_weights(self.experts_used)

    def _block_weights(self, experts: int) -> int:
        d = self.hidden_size
        mlp_matrices = (2 if self.traits.mlp == "gelu" else 3) * max(1, experts)
        return 2 * self.q_size * d + 2 * self.kv_size * d + mlp_matrices * d * self.intermediate_size

    @property
    def head_cost_in_layers(self) -> float:
        """The last stage's extra work (norm + lm_head + sampling) in blocks, for planning a split of equal compute
        (shared.files.layers.balanced_split).
        Weights alone say vocab*hidden/layer_weights (8.0 for SmolLM2), but a block also pays attention and
        per-layer overhead the head does not: measured on SmolLM2 (bf16, CPU, decode batch 8) the head costs
        4.4 blocks, hence the factor."""
        return HEAD_COST_FACTOR * self.vocab_size * self.hidden_size / self.layer_weights

    @classmethod
    def from_gguf(cls, loader: GgufLoader) -> ModelConfig:
        arch = loader.architecture
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )

        def need(suffix: str):
            value = loader.arch_get(suffix)
            if value is None:
                raise GgufError(f"{loader.path}: required metadata key {arch}.{suffix} is missing")
            return value

        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        head_dim = int(loader.arch_get("attention.key_length") or hidden // heads)
        traits = ARCHITECTURES[arch]
        eps_key = "attention.layer_norm_rms_epsilon" if traits.norm == "rms" else "attention.layer_norm_epsilon"
        context = int(loader.arch_get("context_length") or 2048)
        rope_dim = int(loader.arch_get("rope.dimension_count") or head_dim)
        rope_scaling = RopeScaling.from_gguf(loader, rope_dim, context)
        window = int(loader.arch_get("attention.sliding_window") or 0) if traits.sliding_window else 0
        if window:  # a sequence no longer than the window attends to every earlier token: full attention is exact
            context = min(context, window)
        if float(loader.arch_get("attention.temperature_scale") or 0.0):
            # Ministral 3 (llama 4 style): q times 1 + s ln(floor(p / n) + 1), n = rope.scaling.original_context_length,
            # not implemented; it is exactly 1 below n, so serving at most n positions is exact
            context = min(context, rope_scaling.original_context if rope_scaling else context)
        vocab = loader.arch_get("vocab_size") or len(loader.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            vocab = loader.tensor_shape("token_embd.weight")[0]
        return cls(
            architecture=arch,
            num_layers=int(need("block_count")),
            hidden_size=hidden,
            intermediate_size=int(need("expert_feed_forward_length" if traits.moe else "feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(loader.arch_get("attention.head_count_kv") or heads),
            head_dim=head_dim,
            norm_eps=float(need(eps_key)),
            rope_theta=float(loader.arch_get("rope.freq_base") or 10000.0),
            rope_dim=rope_dim,
            context_length=context,
            vocab_size=int(vocab),
            tied_embeddings=not loader.has_tensor("output.weight"),
            traits=traits,
            num_experts=int(need("expert_count")) if traits.moe else 0,
            experts_used=int(need("expert_used_count")) if traits.moe else 0,
            rope_scaling=rope_scaling,
            **_gemma_fields(loader, traits, int(need("block_count")), hidden, heads, rope_scaling),
        )


def _gemma_fields(loader: GgufLoader, traits: ArchTraits, num_layers: int, hidden: int, heads: int,
                  rope_scaling: RopeScaling | None) -> dict:
    """Sliding-window layers, soft caps, query and embedding scales, read as llama.cpp's gemma2 / gemma3 loaders
    read them (src/models/gemma2.cpp, gemma3.cpp; llama_hparams::set_swa_pattern). Empty for other architectures."""
    out: dict = {"embed_scale": hidden ** 0.5} if traits.embed_scale else {}
    if traits.tied_head and loader.has_tensor("output.weight"):
        raise GgufError(f"{loader.path}: {loader.architecture} ties its lm_head to token_embd, yet the file carries "
                        "output.weight (llama.cpp refuses such a file too); drop that tensor")
    if traits.attn_softcap is not None:
        out["attn_softcap"] = float(loader.arch_get("attn_logit_softcapping") or traits.attn_softcap)
    if traits.final_softcap is not None:
        out["final_softcap"] = float(loader.arch_get("final_logit_softcapping") or traits.final_softcap)
    if num_layers == traits.wide_query_scale_layers:
        out["attn_scale"] = (hidden // heads) ** -0.5
    window = int(loader.arch_get("attention.sliding_window") or traits.swa_default) if traits.swa_pattern else 0
    if window:
        pattern = loader.arch_get("attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):  # one flag per layer
            flags = tuple(bool(f) for f in pattern)[:num_layers]
        else:
            p = int(pattern if pattern is not None else traits.swa_pattern)
            flags = tuple(p == 0 or i % p < p - 1 for i in range(num_layers))
        theta = float(loader.arch_get("rope.freq_base_swa") or (10000.0 if traits.swa_rope_10k else
                                                                 loader.arch_get("rope.freq_base") or 10000.0))
        out |= {"sliding_window": window, "swa_layers": flags, "rope_theta_swa": theta,
                "rope_scaling_swa": None if traits.swa_rope_10k else rope_scaling}
    return out
