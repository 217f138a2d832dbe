"""ModelConfig: one dataclass read from GGUF metadata, with per-architecture traits declared in one table."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import GgufError, UnsupportedArchitecture
from shared.gguf_loader import GgufLoader


@dataclass(frozen=True)
class ArchTraits:
    """What distinguishes one decoder architecture from another, as data. The block is always
    h = x + attn(norm(x)); out = h + mlp(norm(h)); these say which norm, which projections, which MLP."""

    rope_style: str  # "normal": rotate adjacent pairs (llama in GGUF); "neox": rotate first/second halves
    qkv_bias: bool = False  # qwen2: q, k, v projections carry a bias
    qk_norm: bool = False  # qwen3: per-head RMS norm on q and k before rope
    norm: str = "rms"  # "rms": RMSNorm (weight); "layer": LayerNorm (weight + bias), eps from layer_norm_epsilon
    mlp: str = "swiglu"  # "swiglu": down(silu(gate) * up); "gelu": down(gelu_tanh(up)), no gate
    linear_bias: bool = False  # starcoder2: every projection (q, k, v, output, up, down) carries a bias
    fused_qkv: bool = False  # phi3: one attn_qkv tensor holds q|k|v (separate q, k, v accepted too)
    fused_gate_up: bool = False  # phi3: ffn_up holds gate|up, [2 I, D]
    sliding_window: bool = False  # phi3: attention.sliding_window honoured by serving at most that many positions
    parallel: bool = False  # phi2: out = x + attn(norm(x)) + mlp(norm(x)), one norm, no ffn_norm
    moe: bool = False  # qwen3moe: the MLP is top-k of expert_count SwiGLU experts (softmax router, top-k renormalised)


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
}


HEAD_COST_FACTOR = 0.55


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weights(self) -> int:
        """Matmul weights of one block (what a decode step streams through)."""
        d = self.hidden_size
        mlp_matrices = (3 if self.traits.mlp == "swiglu" else 2) * max(1, self.experts_used)
        return 2 * self.q_size * d + 2 * self.kv_size * d + mlp_matrices * d * self.intermediate_size

    @property
    def head_cost_in_layers(self) -> float:
        """The last stage's extra work (norm + lm_head + sampling) in blocks, for planning a split of equal compute
        (shared.layers.balanced_split).
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
        if loader.arch_get("rope.scaling.type") not in (None, "none", "linear") or loader.has_tensor("rope_freqs.weight"):
            raise UnsupportedArchitecture(f"{loader.path}: rope scaling ({loader.arch_get('rope.scaling.type')}) is not supported yet")
        if loader.has_tensor("rope_factors_long.weight") or loader.has_tensor("rope_factors_short.weight"):
            raise UnsupportedArchitecture(f"{loader.path}: LongRoPE (rope_factors_long/short tensors, e.g. a 128k phi3) "
                                          "is not supported yet; use a 4k-context variant")
        traits = ARCHITECTURES[arch]
        eps_key = "attention.layer_norm_rms_epsilon" if traits.norm == "rms" else "attention.layer_norm_epsilon"
        context = int(loader.arch_get("context_length") or 2048)
        window = int(loader.arch_get("attention.sliding_window") or 0) if traits.sliding_window else 0
        if window:  # a sequence no longer than the window attends to every earlier token: full attention is exact
            context = min(context, window)
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
            rope_dim=int(loader.arch_get("rope.dimension_count") or head_dim),
            context_length=context,
            vocab_size=int(vocab),
            tied_embeddings=not loader.has_tensor("output.weight"),
            traits=traits,
            num_experts=int(need("expert_count")) if traits.moe else 0,
            experts_used=int(need("expert_used_count")) if traits.moe else 0,
        )
