"""Stateless llama-family TransformerModel over one layer range (llama, mistral, qwen2, qwen3).

Holds weights and config only. The runtime owns the KV cache and passes it in. Shapes:
N = packed tokens of a micro-batch, D = hidden, H / KVH = query / kv heads, hd = head_dim.
The residual stream stays float32 whatever the weight dtype; matmuls run in the weight dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from shared.errors import CapabilityMissing, GgufError
from shared.gguf_loader import GgufLoader
from shared.kv_cache import BatchLayout, KVCache
from shared.layers import LayerRange
from shared.models.config import ModelConfig


class LayerHook(Protocol):
    """Observe (or, in tests, perturb) each layer's input and output; used by tracing. Returns the tensor to use."""

    def on_layer_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...

    def on_layer_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...


# GGUF per-block tensor names -> our parameter names, declared once (tinygrad's convert_from_gguf style).
# Fused at load: q|k|v -> qkv, gate|up -> gate_up, so one matmul does the work of several.
BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
_NORMS = {"attn_norm", "ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv"}  # kept in float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [N, rope_dim/2] float32 for the given absolute positions (llama.cpp's theta_i = p * base^(-2i/d))."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x: [N, heads, hd] float32; rotates the first rope_dim dims. normal: pairs (2i, 2i+1); neox: (i, i + d/2)."""
    d = cos.shape[-1] * 2
    rot, rest = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, d/2]
    if style == "normal":
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = rot[..., : d // 2], rot[..., d // 2:]
        out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


@dataclass
class Block:
    """One transformer block's weights (float32 norms/biases, matmul weights in the model dtype)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, D]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [D, q_size]
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, D]
    w_down: torch.Tensor  # [D, I]


class TransformerModel:
    """Weights + config of layers [range.start, range.stop), plus embedding and/or lm_head by position."""

    def __init__(self, config: ModelConfig, layers: LayerRange, blocks: list[Block], dtype: torch.dtype,
                 embedding: torch.Tensor | None, output_norm: torch.Tensor | None, output: torch.Tensor | None):
        self.config = config
        self.layers = layers
        self.position = layers.position(config.num_layers)
        self.blocks = blocks
        self.dtype = dtype
        self.embedding = embedding  # [V, D] or None
        self.output_norm = output_norm  # [D] or None
        self.output = output  # [V, D] or None (may be the same tensor as embedding when tied)

    # ---- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, loader: GgufLoader, layers: LayerRange | None = None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> TransformerModel:
        """Load only the tensors of `layers` (default: all), plus embedding / head by stage position."""
        config = ModelConfig.from_gguf(loader)
        layers = layers or LayerRange(0, config.num_layers)
        position = layers.position(config.num_layers)
        names = loader.names_for(layers, position)
        raw: dict[str, torch.Tensor] = {}
        for name, tensor in loader.iter_tensors(names, torch.float32, device, desc=f"layers {layers}"):
            raw[name] = tensor
        blocks = [cls._block(config, raw, i, dtype, loader.path) for i in layers]
        embedding = raw["token_embd.weight"].to(dtype) if position.has_embedding else None
        output_norm = output = None
        if position.has_lm_head:
            output_norm = raw["output_norm.weight"]
            if config.tied_embeddings and embedding is not None:
                output = embedding
            else:
                output = raw["output.weight" if not config.tied_embeddings else "token_embd.weight"].to(dtype)
        return cls(config, layers, blocks, dtype, embedding, output_norm, output)

    @staticmethod
    def _block(config: ModelConfig, raw: dict[str, torch.Tensor], i: int, dtype: torch.dtype, path: str) -> Block:
        p: dict[str, torch.Tensor] = {}
        for gguf_name, ours in BLOCK_TENSORS.items():
            t = raw.pop(f"blk.{i}.{gguf_name}", None)
            if t is not None:
                p[ours] = t if ours in _NORMS else t.to(dtype)
        required = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
        if config.traits.qkv_bias:
            required += ["bq", "bk", "bv"]
        if config.traits.qk_norm:
            required += ["q_norm", "k_norm"]
        missing = [BLOCK_TENSORS_INV[r] for r in required if r not in p]
        if missing:
            raise GgufError(f"{path}: block {i} lacks {', '.join(missing)} needed by architecture {config.architecture}")
        bias = torch.cat([p["bq"], p["bk"], p["bv"]]) if "bq" in p else None
        return Block(
            attn_norm=p["attn_norm"], qkv=torch.cat([p["wq"], p["wk"], p["wv"]]).contiguous(), qkv_bias=bias,
            q_norm=p.get("q_norm"), k_norm=p.get("k_norm"), wo=p["wo"], ffn_norm=p["ffn_norm"],
            gate_up=torch.cat([p["w_gate"], p["w_up"]]).contiguous(), w_down=p["w_down"],
        )

    # ---- capabilities ----------------------------------------------------------------------------------

    @property
    def has_embedding(self) -> bool:
        return self.position.has_embedding

    @property
    def has_lm_head(self) -> bool:
        return self.position.has_lm_head

    def weight_bytes(self) -> int:
        """Bytes of every weight this piece holds (a tied embedding/head counted once)."""
        seen, total = set(), 0
        tensors = [self.embedding, self.output_norm, self.output]
        for b in self.blocks:
            tensors += [b.attn_norm, b.qkv, b.qkv_bias, b.q_norm, b.k_norm, b.wo, b.ffn_norm, b.gate_up, b.w_down]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total

    def new_kv_cache(self, num_slots: int, max_seq_len: int, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        return KVCache(len(self.layers), num_slots, max_seq_len, c.num_kv_heads, c.head_dim, self.dtype, device)

    # ---- compute -----------------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> hidden [N, D] float32."""
        if self.embedding is None:
            raise CapabilityMissing(f"layers {self.layers} ({self.position.value} stage) hold no token embedding; "
                                    "only the first stage embeds token ids")
        return F.embedding(token_ids, self.embedding).float()

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, D] -> logits [M, V] float32 (final norm included)."""
        if self.output is None or self.output_norm is None:
            raise CapabilityMissing(f"layers {self.layers} ({self.position.value} stage) hold no lm_head; "
                                    "only the last stage computes logits")
        x = rms_norm(hidden, self.output_norm, self.config.rms_norm_eps).to(self.dtype)
        return F.linear(x, self.output).float()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, layout: BatchLayout, kv: KVCache, hook: LayerHook | None = None) -> torch.Tensor:
        """hidden [N, D] float32 -> [N, D] float32 through this piece's layers, writing their K/V into kv."""
        c = self.config
        cos, sin = rope_cos_sin(layout.positions, c.rope_dim, c.rope_theta)
        for local, block in enumerate(self.blocks):
            layer = self.layers.start + local
            if hook is not None:
                hidden = hook.on_layer_input(layer, hidden)
            h = hidden + self._attention(block, rms_norm(hidden, block.attn_norm, c.rms_norm_eps), cos, sin,
                                         layout, kv.k[local], kv.v[local])
            hidden = h + self._mlp(block, rms_norm(h, block.ffn_norm, c.rms_norm_eps))
            if hook is not None:
                hidden = hook.on_layer_output(layer, hidden)
        return hidden

    def _mlp(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x.to(self.dtype), b.gate_up).chunk(2, dim=-1)  # [N, I] each
        return F.linear(F.silu(gate) * up, b.w_down).float()

    def _attention(self, b: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        qkv = F.linear(x.to(self.dtype), b.qkv)  # [N, q_size + 2 kv_size]
        if b.qkv_bias is not None:
            qkv = qkv.float() + b.qkv_bias
        q, k, v = qkv.float().split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(n, c.num_heads, c.head_dim)
        k = k.view(n, c.num_kv_heads, c.head_dim)
        if b.q_norm is not None:
            q, k = rms_norm(q, b.q_norm, c.rms_norm_eps), rms_norm(k, b.k_norm, c.rms_norm_eps)
        style = c.traits.rope_style
        q = apply_rope(q, cos, sin, style).to(self.dtype)
        k = apply_rope(k, cos, sin, style).to(self.dtype)
        v = v.view(n, c.num_kv_heads, c.head_dim).to(self.dtype)
        # k_cache / v_cache: [slots, KVH, max_seq, hd]; write this micro-batch's keys/values first.
        k_cache[layout.token_slots, :, layout.positions] = k
        v_cache[layout.token_slots, :, layout.positions] = v
        if layout.decode_only:
            out = self._decode_attention(q, layout, k_cache, v_cache)
        else:
            out = torch.cat([self._sequence_attention(q[o:o + ln], slot, start, ln, k_cache, v_cache)
                             for slot, start, ln, o in zip(layout.slots, layout.starts, layout.lengths, layout.offsets)])
        return F.linear(out.reshape(n, c.q_size), b.wo).float()

    @staticmethod
    def _decode_attention(q, layout, k_cache, v_cache) -> torch.Tensor:
        """One query per sequence, sequences of different lengths: q [B, H, hd] -> [B, H, hd]."""
        ends = layout.positions + 1  # [B] keys visible to each query
        ctx = int(ends.max())
        slots = layout.token_slots  # one token per sequence: the token's slot is its sequence's
        keys, values = k_cache[slots, :, :ctx], v_cache[slots, :, :ctx]  # [B, KVH, ctx, hd]
        mask = (torch.arange(ctx, device=q.device)[None, :] < ends[:, None])[:, None, None, :]  # [B, 1, 1, ctx]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=True)
        return out[:, :, 0, :]

    @staticmethod
    def _sequence_attention(q, slot, start, length, k_cache, v_cache) -> torch.Tensor:
        """A chunk of one sequence at positions [start, start+length): q [T, H, hd] -> [T, H, hd], causal."""
        end = start + length
        keys, values = k_cache[slot, :, :end][None], v_cache[slot, :, :end][None]  # [1, KVH, end, hd]
        query_pos = torch.arange(start, end, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]  # [T, end]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)


BLOCK_TENSORS_INV = {v: k for k, v in BLOCK_TENSORS.items()}
