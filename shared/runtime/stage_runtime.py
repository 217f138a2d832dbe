"""StageRuntime: one model piece plus the KV cache it owns; runs micro-batches. LocalPipeline chains pieces
in one process, handing each other only the hidden state (the code path a stage runs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import torch

from shared.batch.layout import BatchLayout
from shared.batch.steps import decodes_only
from shared.config import COMPILE_MODES, STAGE_DEFAULTS
from shared.errors import BadBatch, CapabilityMissing, DoesNotFit, MissingActivation
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange
from shared.models import LayerHook, TransformerModel
from shared.models.aoti_decode import cache_dir as package_cache_dir
from shared.models.attention import KernelDecode
from shared.models.compiled_decode import CompiledDecode, why_not_compilable
from shared.models.crossover import apply_measured_crossover
from shared.models.device import resolve_kv_dtype
from shared.models.kv_cache import KVCache, position_bytes
from shared.models.memory import default_budget, default_prefix_bytes, mib
from shared.wire.protocol import SeqEntry

log = logging.getLogger("stagemesh.runtime")


class StageRuntime:
    """Runs micro-batches through one TransformerModel piece and owns its KV cache: a sequence's KV
    slot is allocated exactly once (its first prefill chunk) and freed by release()."""

    def __init__(self, model: TransformerModel, kv: KVCache, compiled: CompiledDecode | None = None,
                 eager_reason: str = "--compile-decode off"):
        self.model = model
        self.kv = kv
        self.compiled = compiled  # one-sequence decode steps under torch.compile (--compile-decode), else None
        self.eager_reason = eager_reason  # why there is no compiled step (when compiled is None)
        self._spec: dict | None = None  # how load() loaded it: what reload() loads another range with
        self.head_seconds = 0.0  # the final norm + lm_head's time over every run (a live re-split's measure of it)
        # the context it serves and why (fit_context): {"model", "max_seq_len", "why"}; /info's `context`
        self.context: dict = {"model": model.config.context_length, "max_seq_len": kv.max_seq_len, "why": "given"}

    @classmethod
    def load(cls, loader: GgufLoader, layers: LayerRange | None, dtype: torch.dtype, device: torch.device | str = "cpu",
             kv_slots: int = STAGE_DEFAULTS.kv_slots, max_seq_len: int | None = STAGE_DEFAULTS.max_seq_len, *,
             weights: str | None = None, batch_invariant: bool = False, compile_decode: str = "off",
             memory_budget: int | None = None, thread_counts: tuple[int, ...] | None = None, prefix_slots: int = 0,
             prefix_memory: int | None = None, model: TransformerModel | None = None,
             kv_dtype: str | None = None) -> StageRuntime:
        """kv_dtype: the K/V cache's, a --kv-dtype choice (None: the activations' dtype,
        shared.models.device.resolve_kv_dtype);
        max_seq_len: positions per sequence, at most the model's context (None: the model's context, as far as the
        memory budget holds it: fit_context); weights: a shared.models.linear.WEIGHT_MODES entry (None: f32 for
        float32 dtype, else auto);
        batch_invariant: each sequence's numbers independent of the rest of its micro-batch (see TransformerModel);
        memory_budget: bytes for the piece's weights and KV cache (None: shared.models.memory's default);
        compile_decode: a COMPILE_MODES entry (shared.config): "on" compiles the one-sequence decode
        step before returning (refusing a piece it does not cover), "auto" starts compiling it in the background
        where it covers the piece, "off" never; thread_counts: the torch thread counts its decode steps run with
        (a compiled step has graphs for each; None: the count it compiles with); prefix_slots: KV rows for cached
        prefixes beside the kv_slots of live sequences, whose K/V prefix_memory bounds (bytes; None:
        shared.models.memory.default_prefix_bytes). The bound is apart from memory_budget: kept prefixes are given
        up for room, so they never decide whether the weights fit. `model`: the piece of `layers` already built
        (reload's TransformerModel.rebuilt), served instead of loading one."""
        if compile_decode not in COMPILE_MODES:
            raise ValueError(f"compile_decode must be one of {', '.join(COMPILE_MODES)}, got {compile_decode!r}")
        spec = dict(loader=loader, dtype=dtype, device=device, kv_slots=kv_slots, max_seq_len=max_seq_len,
                    weights=weights, batch_invariant=batch_invariant, compile_decode=compile_decode,
                    memory_budget=memory_budget, thread_counts=thread_counts, prefix_slots=prefix_slots,
                    prefix_memory=prefix_memory, kv_dtype=kv_dtype)
        if model is None:
            model = TransformerModel.from_gguf(loader, layers, dtype, device, weights=weights,
                                               batch_invariant=batch_invariant, memory_budget=memory_budget,
                                               kv_slots=kv_slots, max_seq_len=max_seq_len,
                                               kv_dtype=resolve_kv_dtype(kv_dtype, dtype))
            apply_measured_crossover(model)  # auto: where int4 hands over to the prefill kernel, timed on this machine
        c = model.config  # one KV row: every position of one sequence
        per_position = position_bytes(len(model.layers), c.num_kv_heads, c.head_dim, model.kv_dtype)
        context = fit_context(model, max_seq_len, per_position,
                              rows_at_once=1 if torch.device(device).type == "cpu" else kv_slots + 1)
        max_seq_len = context["max_seq_len"]
        log.info("layers %s: a context of %d tokens (%s)", model.layers, max_seq_len, context["why"])
        row_bytes = max_seq_len * per_position
        if prefix_memory is None:  # kept prefixes also use the rows live sequences leave free
            prefix_memory = default_prefix_bytes((kv_slots + prefix_slots) * row_bytes)
        if torch.device(device).type != "cpu":  # rows take their memory at once there (KVCache._zeros): only as many
            prefix_slots = min(prefix_slots, prefix_memory // row_bytes)  # as the bound holds
        # the live sequences' own K/V: what the budget leaves beside the weights and the kept prefixes' bound, and
        # never less than one whole row (one sequence of the full context always runs)
        live_bytes = None
        if model.memory is not None:
            live_bytes = max(row_bytes, model.memory.budget - model.weight_bytes() - prefix_memory)
        reason = "--compile-decode off" if compile_decode == "off" else why_not_compilable(model)
        if compile_decode == "on" and reason is not None:
            raise CapabilityMissing(f"--compile-decode cannot compile layers {model.layers}: {reason}; "
                                    "drop --compile-decode to decode eagerly")
        if reason is not None:
            if compile_decode == "auto":
                log.info("layers %s decode eagerly: %s", model.layers, reason)
            runtime = cls(model, model.new_kv_cache(kv_slots, max_seq_len, device, prefix_slots=prefix_slots,
                                                    prefix_bytes=prefix_memory, live_bytes=live_bytes),
                          eager_reason=reason)
            runtime._spec, runtime.context = spec, context
            return runtime
        kv = model.new_kv_cache(kv_slots, max_seq_len, device, scratch=True,  # the warm-up writes the scratch row
                                prefix_slots=prefix_slots, prefix_bytes=prefix_memory, live_bytes=live_bytes)
        # the one-sequence step: a saved AOTInductor package where one applies ($STAGEMESH_AOTI_CACHE), keyed by
        # the model file among the rest
        compiled = CompiledDecode(model, kv, thread_counts=thread_counts, fingerprint=loader.fingerprint,
                                  package_dir=package_cache_dir())
        if compile_decode == "on":
            compiled.warm_up()
        else:
            compiled.warm_up_in_background()
        runtime = cls(model, kv, compiled)
        runtime._spec, runtime.context = spec, context
        return runtime

    def reload(self, layers: LayerRange) -> StageRuntime:
        """A new runtime for another range of the same model, loaded as this one was (the file's own map, the same
        dtype, weights mode, KV rows and context, budget and compiled step): a stage's side of a live re-split or a
        membership change. The layers it keeps are built from the weights this one holds, only the layers it gains
        are read from the file (TransformerModel.rebuilt); a range apart from this one's is loaded whole. Its KV
        cache is empty (KVCache.take_over fills it)."""
        if self._spec is None:
            raise CapabilityMissing("this runtime was not loaded by StageRuntime.load and cannot load another range")
        # the context it serves stays (a default one is not fitted afresh to the new range: the K/V it takes over
        # and the pipeline's context are of this one)
        mine, spec = self.model.layers, {**self._spec, "max_seq_len": self.kv.max_seq_len}
        if layers.start >= mine.stop or layers.stop <= mine.start:  # nothing kept: loaded from the file
            return self._keeping_context(StageRuntime.load(layers=layers, **spec))

        held = self.model.weight_bytes() + (self.model.memory.kv_bytes if self.model.memory else 0)
        budget = spec["memory_budget"] if spec["memory_budget"] is not None else default_budget()

        def gained(part: LayerRange) -> TransformerModel:
            """The layers it takes on, loaded as this runtime's own were, in what the budget leaves beside what it
            holds (auto's dense prefill copy only where that fits)."""
            model = TransformerModel.from_gguf(spec["loader"], part, spec["dtype"], spec["device"],
                                               weights=spec["weights"], batch_invariant=spec["batch_invariant"],
                                               memory_budget=max(1, budget - held), kv_slots=spec["kv_slots"],
                                               max_seq_len=self._spec["max_seq_len"],  # weighed as its own were
                                               kv_dtype=resolve_kv_dtype(spec["kv_dtype"], spec["dtype"]))
            apply_measured_crossover(model)
            return model

        # the layers it keeps built from its own weights, only the gained ones read from the file
        return self._keeping_context(
            StageRuntime.load(layers=layers, model=self.model.rebuilt(layers, spec["loader"], gained), **spec))

    def _keeping_context(self, runtime: StageRuntime) -> StageRuntime:
        runtime.context, runtime._spec = self.context, self._spec  # as this one chose it, and reloads as it would
        return runtime

    def context_info(self) -> dict:
        """What /info reports of the context: self.context and the rope factor set it chooses ("long" or "short" for
        LongRoPE, whose choice depends on it; None where one set serves every context)."""
        rope = self.model.config.rope_scaling
        which = None
        if rope is not None and rope.freq_factors is None and rope.long_factors is not None:
            which = "long" if rope.factors_for(self.kv.max_seq_len) is rope.long_factors else "short"
        return {**self.context, "rope": which}

    def compiled_decode_info(self) -> dict:
        """What /info reports of the compiled decode step: CompiledDecode.info(), or why decode is eager."""
        if self.compiled is None:
            return {"state": "off", "reason": self.eager_reason}
        return self.compiled.info()

    @property
    def device(self) -> torch.device:
        return self.kv.device

    # ---- sequence lifecycle ------------------------------------------------------------------------------

    def init_pipeline_request(self, seq_id: Hashable) -> int:
        return self.kv.allocate(seq_id)

    def release(self, seq_id: Hashable) -> bool:
        return self.kv.release(seq_id)

    def keep(self, seq_id: Hashable) -> bool:
        """The finished sequence's K/V stays, as a cached prefix (KVCache.keep)."""
        return self.kv.keep(seq_id)

    # ---- compute -------------------------------------------------------------------------------------------

    def run(self, work: Sequence[SeqEntry], *, token_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
            all_logits: bool = False, hook: LayerHook | None = None) -> torch.Tensor:
        """Run one micro-batch. The first piece takes token_ids [N]; the others hidden [N, D] (never substituted).
        Returns hidden [N, D] float32, or on the last piece logits [M, V] for the rows that sample a token (the last
        row of a final prefill chunk, every row of a decode step; InferenceStep.samples) -- every row when
        all_logits."""
        model = self.model
        n = sum(w.step.num_tokens for w in work)
        if model.has_embedding:
            if token_ids is None or token_ids.numel() != n:
                got = "none" if token_ids is None else token_ids.numel()
                raise BadBatch(f"layers {model.layers} (first stage) needs token ids, {n} of them; got {got}")
        elif hidden is None:
            raise MissingActivation(f"layers {model.layers} ({model.position.value} stage) received a micro-batch without "
                                    "its input activation; a non-first stage never embeds tokens itself")
        elif tuple(hidden.shape) != (n, model.config.hidden_size):
            raise BadBatch(f"activation shape {tuple(hidden.shape)} does not match {n} tokens x hidden "
                                 f"{model.config.hidden_size}")
        fresh = []
        try:
            for w in work:
                if w.step.starts_sequence:
                    self.init_pipeline_request(w.seq_id)
                    fresh.append(w.seq_id)
                    if w.step.attach is not None:  # a first chunk starting from a cached prefix
                        self.kv.attach(w.seq_id, w.step.attach, w.step.start_position)
            # a step continues its sequence from its start position: the slot must hold every position before it
            slots = [self.kv.slot(w.seq_id, w.step.start_position) for w in work]
            # several positions of one sequence in a decode micro-batch: as that many one-token rows where the decode
            # attention reads each row's own slot and context (KernelDecode), so a verified draft's numbers are those
            # of one-token steps; the batch-invariant mode's rowwise attention already computes them so
            as_rows = any(w.step.num_tokens > 1 for w in work) and decodes_only(w.step for w in work) \
                and not model.batch_invariant and KernelDecode.applies(model.config, model.dtype, self.device)
            layout = BatchLayout.build(slots, [w.step for w in work], self.kv.max_seq_len, self.device, as_rows)
            self.kv.check_room(layout, starting=bool(fresh))
            self.kv.wrote(layout)
        except Exception:
            for seq_id in fresh:
                self.release(seq_id)
            raise
        with torch.inference_mode():
            x = model.embed(token_ids.to(self.device)) if model.has_embedding else hidden.to(self.device, torch.float32)
            compiled = self.compiled.forward(x, layout) if self.compiled is not None and hook is None else None
            x = compiled if compiled is not None else model.forward(x, layout, self.kv, hook)
            if not model.has_lm_head:
                return x
            if not all_logits and not as_rows:  # each step's last `samples` rows (one, or every row of a decode)
                rows = [r for w, o, ln in zip(work, layout.offsets, layout.lengths)
                        for r in range(o + ln - w.step.samples, o + ln)]
                x = x[torch.tensor(rows, device=x.device, dtype=torch.long)]  # (as rows: every row samples)
            t_head = time.perf_counter()
            logits = model.lm_head(x)
            self.head_seconds += time.perf_counter() - t_head
            return logits


MIN_AUTO_CONTEXT = 256  # the least context the default takes from a memory budget: below it, a clear refusal


def fit_context(model: TransformerModel, asked: int | None, per_position: int, rows_at_once: int = 1) -> dict:
    """The context a piece serves: `asked` (--max-seq-len) capped by the model's trained context; unasked, the
    model's context as far as the memory budget holds `rows_at_once` rows of it beside the weights (on a CPU a row
    takes memory as it is written, so one sequence of the full context must fit, as live_bytes guarantees one; on an
    accelerator every row is allocated at once; cached prefixes give their memory up for live rows), in whole
    multiples of MIN_AUTO_CONTEXT. {"model": the trained context, "max_seq_len": the one served, "why": how it was
    chosen}; DoesNotFit when the budget leaves less than MIN_AUTO_CONTEXT positions."""
    trained = model.config.context_length
    if asked is not None:
        why = "--max-seq-len" if asked <= trained else f"--max-seq-len {asked}, capped by the model's context"
        return {"model": trained, "max_seq_len": min(asked, trained), "why": why}
    if model.memory is None:
        return {"model": trained, "max_seq_len": trained, "why": "the model's context"}
    room = model.memory.budget - model.weight_bytes()
    holds = max(0, room) // max(1, per_position * rows_at_once)
    if holds >= trained:
        return {"model": trained, "max_seq_len": trained, "why": "the model's context"}
    if holds < MIN_AUTO_CONTEXT:
        raise DoesNotFit(f"layers {model.layers}: the memory budget ({mib(model.memory.budget)}) leaves "
                         f"{mib(max(0, room))} beside the weights, {holds} positions of K/V ({per_position} bytes "
                         f"a position{f' x {rows_at_once} rows' if rows_at_once > 1 else ''}), under "
                         f"{MIN_AUTO_CONTEXT}: give the stage more memory (--memory-budget) or fewer layers")
    served = holds // MIN_AUTO_CONTEXT * MIN_AUTO_CONTEXT
    return {"model": trained, "max_seq_len": served,
            "why": f"the model's {trained}, capped by the memory budget ({mib(model.memory.budget)}, "
                   f"{mib(model.weight_bytes())} of it weights): --max-seq-len to choose"}


class LocalPipeline:
    """Several StageRuntimes in one process; each hands the next only its hidden state."""

    def __init__(self, pieces: list[StageRuntime]):
        self.pieces = pieces

    @classmethod
    def load(cls, loader: GgufLoader, ranges: list[LayerRange] | None, dtype: torch.dtype,
             device: torch.device | str = "cpu", kv_slots: int = 4,
             max_seq_len: int | None = STAGE_DEFAULTS.max_seq_len, *, weights: str | None = None,
             batch_invariant: bool = False, compile_decode: str = "off", memory_budget: int | None = None,
             prefix_slots: int = 0, prefix_memory: int | None = None, kv_dtype: str | None = None) -> LocalPipeline:
        """memory_budget: per piece (each piece is a stage's share); None: the default, split over the pieces.
        prefix_slots, prefix_memory: each piece's rows for cached prefixes and their bound (StageRuntime.load)."""
        ranges = ranges or [None]
        if memory_budget is None:
            memory_budget = default_budget(len(ranges))
        return cls([StageRuntime.load(loader, r, dtype, device, kv_slots, max_seq_len, weights=weights,
                                      batch_invariant=batch_invariant, compile_decode=compile_decode,
                                      memory_budget=memory_budget, prefix_slots=prefix_slots,
                                      prefix_memory=prefix_memory, kv_dtype=kv_dtype) for r in ranges])

    @property
    def max_seq_len(self) -> int:
        return min(p.kv.max_seq_len for p in self.pieces)

    def run(self, work: Sequence[SeqEntry], token_ids: torch.Tensor, all_logits: bool = False,
            hooks: Sequence[LayerHook | None] | None = None) -> torch.Tensor:
        """hooks: one LayerHook (or None) per piece."""
        out = token_ids
        for i, piece in enumerate(self.pieces):
            hook = hooks[i] if hooks else None
            if i == 0:
                out = piece.run(work, token_ids=out, all_logits=all_logits, hook=hook)
            else:
                out = piece.run(work, hidden=out, all_logits=all_logits, hook=hook)
        return out

    def release(self, seq_id: Hashable) -> None:
        for piece in self.pieces:
            piece.release(seq_id)

    def keep(self, seq_id: Hashable) -> None:
        for piece in self.pieces:
            piece.keep(seq_id)
