"""One sequence's decode step under torch.compile (inductor), `--compile-decode` (auto by default on a stage).

Eager decode pays ~16 small ops per layer (norm, casts, rope, cache writes, adds, silu) at a few µs of dispatch and
Python each: on a small model at one token that is about as much as its int4 matmuls. Inductor fuses those ops into
a handful of C++ kernels per layer and runs the step from generated code. It only pays with static shapes
(benchmarks/decode_step.py measures eager against compiled):

- one graph per context bucket (CONTEXT_BUCKETS): attention reads the bucket's first C cached positions with an
  additive mask (keys past the sequence's position get -inf), so a graph serves every position below C;
- the KV cache is one tensor per layer (KVCache) and the step writes it with index_put on that tensor. Handing the
  graph a view of a larger cache tensor instead made inductor copy the whole cache back every step;
- one sequence (B = 1), int4 weights, one plane or two (the step is memory- and overhead-bound; larger micro-batches
  stay eager, where the SwitchedLinear's kernel choice applies).

Compiled and eager steps agree to bf16 rounding (fused kernels round at other points), not bit for bit, so the
batch-invariant mode never compiles. inductor's on-disk cache makes later starts fast. When the graphs compile
(COMPILE_MODES, `--compile-decode`):

- auto (a stage's default): in a background thread once the stage has loaded. The stage is ready at once and decodes
  eagerly until every graph is compiled, then switches; a piece the step does not cover, or a failed compilation
  (no C++ compiler), stays eager and says why in the log and /info. The warm-up writes the KV cache's scratch row,
  which no sequence ever holds, so it never touches a live sequence's keys.
- on: before the stage reports ready; a piece the step does not cover is refused at load.
- off: never.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.nn.functional as F

from shared.errors import CapabilityMissing
from shared.kv_cache import BatchLayout, KVCache
from shared.models.linear import GROUP, Int4Linear, SwitchedLinear
from shared.models.transformer import rope_cos_sin

log = logging.getLogger("stagemesh.compiled_decode")

CONTEXT_BUCKETS = (128, 512)  # a decode step at context length ctx runs the smallest bucket >= ctx; beyond: eager
COMPILE_MODES = ("auto", "on", "off")  # when the graphs compile: in the background, before ready, never
# CompiledDecodes of this process whose warm-up is running. No compiled step runs while it is non-empty: forward sets
# dynamo's stance, which is process-wide, and would make a compilation in another thread fail as a "recompile".
_compiling: set[int] = set()


def _int4(linear) -> Int4Linear | None:
    return linear.small if isinstance(linear, SwitchedLinear) else linear if isinstance(linear, Int4Linear) else None


def why_not_compilable(model) -> str | None:
    """None when the compiled step covers this piece; otherwise what it does not cover (then decode stays eager)."""
    c = model.config
    if model.batch_invariant:
        return "the batch-invariant mode needs eager decode (compiled kernels round differently at other batch sizes)"
    if model.dtype not in (torch.bfloat16, torch.float32) or model.blocks[0].attn_norm.device.type != "cpu":
        return "the compiled step is built for bfloat16 or float32 activations on the CPU"
    if (c.traits.norm != "rms" or c.traits.mlp != "swiglu" or c.traits.rope_style != "normal" or c.attn_softcap
            or c.sliding_window):
        return (f"architecture {c.architecture!r} (needs RMSNorm, a SwiGLU MLP, llama's rope pairs, no soft cap, "
                "no sliding window)")
    for b in model.blocks:
        if any(t is not None for t in (b.qkv_bias, b.q_norm, b.wo_bias, b.up_bias, b.down_bias, b.experts,
                                       b.post_attn_norm, b.post_ffn_norm, b.attn_norm_b)) or b.ffn_norm is None:
            return f"architecture {c.architecture!r} (biases, q/k norms, post norms, experts or a parallel block)"
        if any(_int4(w) is None for w in (b.qkv, b.wo, b.gate_up, b.w_down)):
            return ("some block matmul is not int4 (weights mode bf16 / f32, types mixed in one fused matmul, or a "
                    "type without an int4 form: Q6_K, Q2_K, Q3_K, IQ*)")
    for name in ("qkv", "wo", "gate_up", "w_down"):
        if len({_int4(getattr(b, name)).planes for b in model.blocks}) > 1:
            return f"{name} is one int4 plane in some layers and two in others (the step stacks each kind's layers)"
    return None


def _stack_layers(blocks) -> dict[str, torch.Tensor]:
    """The piece's per-layer weights as one tensor per kind, [layers, ...]: attn_norm / ffn_norm [L, D] f32 and each
    int4 matmul's packed / scales_and_zeros. Each block is rebound to views of these (same bytes, no second copy), so
    eager and compiled steps read one set of weights. Why: dynamo guards every tensor the graph reads on every call,
    and per-layer tensors made that one guard per weight plus an aliasing check over all of them, a visible share of
    a step under the profiler; ten stacked tensors are ten guards."""
    stacked: dict[str, torch.Tensor] = {}
    for norm in ("attn_norm", "ffn_norm"):
        stacked[norm] = torch.stack([getattr(b, norm) for b in blocks])
        for i, b in enumerate(blocks):
            setattr(b, norm, stacked[norm][i])
    for name in ("qkv", "wo", "gate_up", "w_down"):
        linears = [_int4(getattr(b, name)) for b in blocks]
        for part in ("packed", "scales_and_zeros"):
            stacked[f"{name}.{part}"] = torch.stack([getattr(lin, part) for lin in linears])
            for i, lin in enumerate(linears):
                setattr(lin, part, stacked[f"{name}.{part}"][i])
    return stacked


def _int4_mm(x: torch.Tensor, stacked: dict[str, torch.Tensor], name: str, layer: int) -> torch.Tensor:
    """x [1, K] bf16 @ layer `layer`'s int4 matmul `name` (qkv, wo, gate_up, w_down) from _stack_layers -> [1, N] bf16,
    as Int4Linear computes it: packed [N, K/2] bytes for one plane, [N, K] for two (the input repeated over them)."""
    packed = stacked[f"{name}.packed"][layer]
    if packed.shape[-1] == x.shape[-1]:  # two planes (Q8_0, Q5_*): static in a graph
        x = torch.cat([x, x], dim=-1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, stacked[f"{name}.scales_and_zeros"][layer])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, hd] float32; cos / sin [1, 1, d/2]: transformer.apply_rope's "normal" style (pairs (2i, 2i+1)) in
    real arithmetic (inductor does not fuse complex numbers)."""
    d = cos.shape[-1] * 2
    rot, rest = x[..., :d], x[..., d:]
    pairs = rot.unflatten(-1, (d // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class CompiledDecode:
    """The compiled decode step of one TransformerModel piece over its KVCache, one graph per context bucket."""

    def __init__(self, model, kv: KVCache, buckets: tuple[int, ...] = CONTEXT_BUCKETS):
        if kv.scratch_slot is None:
            raise ValueError("the compiled decode step warms up in a KV scratch row: new_kv_cache(..., scratch=True)")
        self.model, self.kv = model, kv
        self.buckets = tuple(sorted({min(b, kv.max_seq_len) for b in buckets}))  # none past the cache's length
        c = model.config
        self._weights = _stack_layers(model.blocks)
        self._shape = (c.num_heads, c.num_kv_heads, c.head_dim, c.q_size, c.kv_size, c.norm_eps, c.attn_scale)
        # cpp_wrapper: the generated code calls its kernels from C++, not Python: a shorter one-token step for
        # about twice the first compilation's time (benchmarks/decode_step.py)
        self._compiled = torch.compile(self._step, dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds its graph took to compile (warm_up)
        # pending -> compiling -> ready (forward runs the graphs) | failed (error says why; decode stays eager). Written
        # by the compiling thread only; forward reads it and runs nothing compiled before "ready".
        self.state = "pending"
        self.error: str | None = None
        self.broken = False  # set when a serving-time call would have recompiled: eager from then on
        self.steps = 0  # decode steps run compiled

    def _step(self, hidden: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor]) -> torch.Tensor:
        """hidden [1, D] f32, slot / pos [1] int64, cos / sin [1, 1, rope_dim/2] f32, mask [1, 1, 1, C] additive;
        k_layers / v_layers: per layer [slots, KVH, max_seq, hd] in the activation dtype (bf16, or f32 on CPUs
        without native bf16), written at (slot, pos) -> hidden [1, D] f32. The int4 kernel takes bf16 inputs
        whatever the activation dtype. The bucket C is mask's last dim (static: one graph per C)."""
        h, kvh, hd, q_size, kv_size, eps, scale = self._shape
        bf16, act = torch.bfloat16, mask.dtype
        ctx = mask.shape[-1]
        w = self._weights
        for i, (k_cache, v_cache) in enumerate(zip(k_layers, v_layers)):
            attn_norm, ffn_norm = w["attn_norm"][i], w["ffn_norm"][i]
            x = F.rms_norm(hidden, attn_norm.shape, attn_norm, eps).to(bf16)
            qkv = _int4_mm(x, w, "qkv", i)
            qk = _rope(qkv[:, :q_size + kv_size].float().view(1, h + kvh, hd), cos, sin).to(act)
            k_cache[slot, :, pos] = qk[:, h:]  # [1, KVH, hd]
            v_cache[slot, :, pos] = qkv[:, q_size + kv_size:].view(1, kvh, hd).to(act)
            keys, values = k_cache[slot, :, :ctx], v_cache[slot, :, :ctx]  # [1, KVH, C, hd]
            queries = qk[:, :h].view(1, kvh, h // kvh, hd)  # GQA as query length: [1, KVH, g, hd]
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
            out = _int4_mm(attn.reshape(1, q_size).to(bf16), w, "wo", i)
            hidden = hidden + out
            x = F.rms_norm(hidden, ffn_norm.shape, ffn_norm, eps).to(bf16)
            gate, up = _int4_mm(x, w, "gate_up", i).chunk(2, dim=-1)
            hidden = hidden + _int4_mm((F.silu(gate) * up).to(bf16), w, "w_down", i)
        return hidden

    def bucket(self, ctx: int) -> int | None:
        return next((b for b in self.buckets if ctx <= b), None)

    def _inputs(self, hidden: torch.Tensor, slot: int, pos: int, ctx_bucket: int):
        """The graph's arguments, built here under inference mode: a tensor from outside it (BatchLayout's) differs in
        dispatch keys, which dynamo guards on, and would recompile. hidden is copied (D floats) for the same reason: a
        stage after the first gets it straight from the wire, a view of a ZeroMQ frame made outside inference mode
        (and at any alignment, which inductor also guards); uncopied, that stage's first compiled call recompiled
        and the stage decoded eagerly for good."""
        hidden = hidden.clone(memory_format=torch.contiguous_format)
        c = self.model.config
        position = torch.tensor([pos])
        cos, sin = rope_cos_sin(position, c.rope_dim, c.rope_theta, c.rope_scaling, self.kv.max_seq_len)
        mask = torch.zeros(1, 1, 1, ctx_bucket, dtype=self.model.dtype)
        mask[..., pos + 1:] = float("-inf")
        return hidden, torch.tensor([slot]), position, cos[:, None], sin[:, None], mask, self.kv.k, self.kv.v

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every bucket's graph, one call each at the last position of the KV cache's scratch row (no sequence
        ever holds it); compile_seconds records each. Raises CapabilityMissing when inductor fails (state "failed")."""
        self.state = "compiling"
        _compiling.add(id(self))
        try:
            for b in self.buckets:
                t = time.perf_counter()
                hidden = torch.zeros(1, self.model.config.hidden_size)
                try:
                    self._compiled(*self._inputs(hidden, self.kv.scratch_slot, self.kv.max_seq_len - 1, b))
                except Exception as e:  # inductor: no C++ compiler, an unsupported op, ...
                    self.error = (f"torch.compile failed for contexts <= {b}: {str(e).strip().splitlines()[0][:300]} "
                                  "(inductor needs a C++ compiler, g++)")
                    self.state = "failed"
                    raise CapabilityMissing(f"--compile-decode: {self.error}; drop --compile-decode to decode "
                                            "eagerly") from None
                self.compile_seconds[b] = round(time.perf_counter() - t, 1)
                log.info("compiled the decode step for contexts <= %d in %.1f s", b, self.compile_seconds[b])
            self.state = "ready"
        finally:
            _compiling.discard(id(self))

    def warm_up_in_background(self) -> None:
        """warm_up in a daemon thread with the caller's torch thread count; until it is done, forward declines and the
        step runs eager. A failure is logged and leaves decode eager."""
        threads = torch.get_num_threads()
        self.state = "compiling"

        def run() -> None:
            torch.set_num_threads(threads)
            try:
                self.warm_up()
            except CapabilityMissing:
                log.warning("compiled decode step unavailable, decoding eagerly: %s", self.error)

        threading.Thread(target=run, name="compile-decode", daemon=True).start()

    def info(self) -> dict:
        """What a stage's /info reports: the compile state (and error), each bucket's compile seconds, the steps run
        compiled so far, and whether a serving-time call fell back to eager for good."""
        return {"state": self.state, "error": self.error,
                "compile_seconds": {str(b): s for b, s in self.compile_seconds.items()}, "steps": self.steps,
                "fell_back_to_eager": self.broken}

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, layout: BatchLayout) -> torch.Tensor | None:
        """hidden [1, D] f32 of a one-sequence decode micro-batch -> [1, D] f32, or None when no compiled graph covers
        it (graphs not compiled yet, or another piece's compiling; more than one sequence, not a decode step, a context
        past the largest bucket): run eager then. Never compiles: a call that would (a guard that fails on an input
        nobody foresaw) runs eager instead, and is logged."""
        if self.state != "ready" or _compiling or not layout.decode_only or len(layout.slots) != 1 or self.broken:
            return None
        pos = int(layout.positions[0])
        bucket = self.bucket(pos + 1)
        if bucket is None or bucket not in self.compile_seconds:
            return None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._compiled(*self._inputs(hidden, layout.slots[0], pos, bucket))
        except RuntimeError as e:  # dynamo's "Detected recompile when torch.compile stance is 'fail_on_recompile'"
            self.broken = True
            log.warning("compiled decode step would recompile while serving (%s); decoding eagerly from now on",
                        str(e).splitlines()[0][:300])
            return None
        self.steps += 1
        return out
