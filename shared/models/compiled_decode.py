"""One sequence's decode step under torch.compile (inductor), `--compile-decode` (auto by default on a stage).

Eager decode pays ~16 small ops per layer (norm, casts, rope, cache writes, adds, silu) at a few µs of dispatch and
Python each: on a small model at one token that is about as much as its int4 matmuls. Inductor fuses those ops into
a handful of C++ kernels per layer and runs the step from generated code. What it compiles is the model's own
TransformerModel.run_layers -- the function every eager step runs -- so every architecture has a compiled step and a
change to a block is made once (gpt-fast's way). It only pays with static shapes (benchmarks/decode_step.py measures
eager against compiled), all but one:

- the context length C = position + 1 and the slot are the graph's dynamic sizes (attention.OneSequenceDecode:
  attention reads the slot's first C cached positions, in place; sliding layers mask the keys before their window),
  so one graph serves every slot and every position from 1 to the cache's length - 2 (CompiledDecode.contexts).
  Graphs per context bucket, as before, made a step at a short context attend to the whole bucket, and decoded
  eagerly, much slower, past the largest;
- the KV cache is one tensor per layer (KVCache) and the step writes it with index_put on that tensor. Handing the
  graph a view of a larger cache tensor instead made inductor copy the whole cache back every step;
- one sequence (B = 1; the step is memory- and overhead-bound) in one graph; decode micro-batches of 2..kv_slots
  sequences in a second (the batched step: run_layers again, B its one dynamic size, attention a
  attention.BatchDecode on qdot.cpp's kernel, which reads each sequence's own context in place, so no shape depends
  on the slots or contexts). The batched graph needs the kernel on every layer (float32 on an AVX2 CPU; no
  attention soft cap, no experts) and stops below the batch size where a SwitchedLinear changes kernel; other batches
  decode eagerly. The batched graph saves about the same time a step at every batch size: half the step of 2
  sequences, a small part of one of 16 or more (benchmarks/decode_step.py --compile measures it;
  docs/performance.md#compiled-decode has the figures). A mixture-of-experts block's experts run eagerly between the
  one-sequence graphs.
- each graph input costs a call a few µs (dynamo's guard, the wrapper's handling), so the model keeps its per-layer
  weights stacked where the layers share a shape (linear.stack_layers, TransformerModel.layer_norms): a step reads
  ten-odd weight tensors instead of ten per layer (benchmarks/decode_step.py; docs/performance.md has the figures).
- a graph is then called without dynamo (DirectCall): dynamo's frame still fetched every argument (the KV cache is
  two tensors a layer) and cost about a tenth of a piece's step (docs/performance.md#compiled-decode). After
  compiling, two calls through dynamo show which argument is which input; later steps hand the graph those arguments
  straight. A graph that broke in several (experts), or whose arguments do not map, keeps being called through
  dynamo.

Compiled and eager steps agree to bf16 rounding (fused kernels round at other points), not bit for bit, so the
batch-invariant mode never compiles. The one-sequence step is a saved AOTInductor package where one applies
(aoti_decode: loaded in seconds on later starts, built and saved the first time; torch.compile where it fails or does
not apply); inductor's on-disk cache makes the torch.compile graphs' later starts fast. When the graphs compile
(COMPILE_MODES, `--compile-decode`; both graphs at every thread count, each tens of seconds from a cold cache on 2
cores: benchmarks/decode_step.py --compile reports it, docs/performance.md#compiled-decode has the figures):

- auto (a stage's default): in a background thread once the stage has loaded. The stage is ready at once and decodes
  eagerly until every graph is compiled, then switches; a piece the step does not cover, or a failed compilation
  (no C++ compiler), stays eager and says why in the log and /info. The warm-up writes the KV cache's scratch row,
  which no sequence ever holds, so it never touches a live sequence's keys.
- on: before the stage reports ready; a piece the step does not cover is refused at load.
- off: never.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import types

import torch

from shared.batch.layout import BatchLayout
from shared.errors import CapabilityMissing
from shared.models import aoti_decode, linear, transformer
from shared.models.attention import BatchDecode, OneSequenceDecode
from shared.models.kv_cache import KVCache

log = logging.getLogger("stagemesh.compiled_decode")

# CompiledDecodes of this process whose warm-up is running. No compiled step runs while it is non-empty: forward sets
# dynamo's stance, which is process-wide, and would make a compilation in another thread fail as a "recompile".
_compiling: set[int] = set()


def why_not_compilable(model) -> str | None:
    """None when the compiled step covers this piece; otherwise what it does not cover (then decode stays eager)."""
    if model.batch_invariant:
        return "the batch-invariant mode needs eager decode (compiled kernels round differently at other batch sizes)"
    if model.dtype not in (torch.bfloat16, torch.float32) or model.blocks[0].attn_norm.device.type != "cpu":
        return "the compiled step is built for bfloat16 or float32 activations on the CPU"
    return None


@functools.cache
def mark_graph_breaks() -> None:
    """Wrap what runs eagerly between the step's graphs in torch.compiler.disable: a mixture-of-experts block's
    experts (TransformerModel._moe: which run is data). (A oneDNN-prepacked matrix, which inductor does not lower,
    runs inside the graph as an op of its own: linear.prepacked_mm.) Done here, once, before the first graph is
    traced, not as a decorator where it is defined: the decorator imports torch._dynamo (over a second), which every
    process importing the models would then pay -- the gateway, every CLI command, every stage that never compiles."""
    transformer.TransformerModel._moe = torch.compiler.disable(transformer.TransformerModel._moe,
                                                               reason="which experts run is data")


def switch_rows(model) -> int | None:
    """The fewest rows at which one of the piece's matmuls changes kernel (a SwitchedLinear's max_tokens: a batched
    graph must not cross it), or None where none does."""
    def rows(lin) -> list[int]:
        if isinstance(lin, linear.SwitchedLinear):
            return [lin.max_tokens]
        return [r for part in getattr(lin, "parts", ()) for r in rows(part)]
    found = [r for block in model.blocks for lin in block.linears().values() for r in rows(lin)]
    return min(found, default=None)


def _own_code(method):
    """`method` over a code object of its own (the same source and bytecode, a distinct object). dynamo keeps its
    graphs in a cache per code object and past 8 entries silently runs the frame eagerly; so that a process holding
    several pieces (a LocalPipeline, the tests) gives each piece its own cache, not one shared run_layers cache."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, method.__self__)


class _Graph:
    """The compiled graph dynamo made of run_layers (what the backend returned: inductor's callable, its arguments
    dynamo's graph inputs, flat), called through; `record` keeps the next call's arguments (DirectCall.bind)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.record = False
        self.args: tuple | None = None

    def __call__(self, *args):
        if self.record:
            self.args = args
        return self.compiled(*args)


def _inputs_flat(inputs: tuple) -> list[torch.Tensor]:
    """Every tensor of run_layers' arguments (hidden, ropes, attention, k_layers, v_layers), in a fixed order."""
    hidden, ropes, attention, k_layers, v_layers = inputs
    fields = (getattr(attention, f.name) for f in dataclasses.fields(attention))
    return [hidden, *(t for pair in ropes if pair is not None for t in pair),
            *(t for t in fields if isinstance(t, torch.Tensor)), *k_layers, *v_layers]


class DirectCall:
    """A compiled graph called without dynamo. Dynamo's frame fetches each of the graph's inputs from run_layers'
    arguments at every call (the weights, every layer's KV tensors) and checks the guards; here the weights are bound
    once and the rest placed by index. `slots`: (argument index, index in _inputs_flat) of each input tensor;
    `sizes`: (argument index, name in the step's sizes) of each dynamic size; `bound`: the arguments, weights in place.
    Built by bind() only where two calls through dynamo show every argument's source, and checked there bit for bit
    against dynamo's call; the caller keeps to what the graph was compiled for (CompiledDecode.forward: the thread
    count, the batch size's range, the dtype and shapes), as dynamo's guards would."""

    def __init__(self, graph: _Graph, bound: list, slots: list[tuple[int, int]], sizes: list[tuple[int, str]]):
        self.graph, self.bound, self.slots, self.sizes = graph.compiled, bound, slots, sizes

    def __call__(self, inputs: tuple, sizes: dict[str, int]) -> torch.Tensor:
        args = self.bound.copy()
        flat = _inputs_flat(inputs)
        for at, i in self.slots:
            args[at] = flat[i]
        for at, name in self.sizes:
            args[at] = sizes[name]
        return self.graph(*args)[0]

    @classmethod
    def bind(cls, graph: _Graph, probes: list[tuple[tuple, dict[str, int]]], call) -> tuple[DirectCall | None, str]:
        """The DirectCall of `graph` (or None, and why not): each probe (run_layers' inputs, the step's sizes) is
        called through dynamo (`call`), and its arguments matched to the inputs by identity, its ints to the sizes.
        The probes' sizes must differ where they can (so that an int names one size): an argument that maps to no
        input, to different inputs, or that changes but is no input, leaves dynamo in charge (which takes two probes to
        tell)."""
        if len(probes) < 2:
            return None, f"{len(probes)} probe call: two are needed to tell the inputs from the weights"
        seen = []
        for inputs, sizes in probes:
            graph.record, graph.args = True, None
            try:
                out = call(inputs)
            finally:
                graph.record = False
            if graph.args is None:
                return None, "dynamo did not call the graph (it recompiled, or broke the step in several graphs)"
            seen.append((inputs, sizes, graph.args, out))
        (_, _, first, _), rest = seen[0], seen[1:]
        bound, slots, size_slots = list(first), [], []
        for at, arg in enumerate(first):
            if isinstance(arg, torch.Tensor):
                where = [next((i for i, t in enumerate(_inputs_flat(inputs)) if t is args[at]), None)
                         for inputs, _, args, _ in seen]
                if where[0] is not None and all(w == where[0] for w in where):
                    slots.append((at, where[0]))
                elif any(w is not None for w in where):
                    return None, f"graph argument {at} is an input in one call and not in another"
                elif any(args[at] is not arg for _, _, args, _ in rest):
                    return None, f"graph argument {at} changes from call to call but is none of the step's inputs"
            elif type(arg) is int:
                names = [n for n in seen[0][1] if all(args[at] == sizes[n] for _, sizes, args, _ in seen)]
                if len(names) != 1:
                    return None, f"graph argument {at} ({arg}) is not one of the step's sizes {sorted(seen[0][1])}"
                size_slots.append((at, names[0]))
            else:
                return None, f"graph argument {at} is a {type(arg).__name__}"
        direct = cls(graph, bound, slots, size_slots)
        inputs, sizes, _, out = seen[-1]
        again = direct(inputs, sizes)  # the same inputs again: the same K/V rewritten, the same output
        if not torch.equal(again, out):
            return None, "called directly, the graph did not give dynamo's call's output"
        return direct, ""


class CompiledDecode:
    """The compiled decode steps of one TransformerModel piece over its KVCache: one sequence's graph, the context
    length dynamic, and the batched graph (where it applies), the batch size dynamic."""

    def __init__(self, model, kv: KVCache, thread_counts: tuple[int, ...] | None = None, *,
                 fingerprint: str | None = None, package_dir: str | None = None):
        if kv.scratch_slot is None:
            raise ValueError("the compiled decode step warms up in a KV scratch row: new_kv_cache(..., scratch=True)")
        if kv.max_seq_len < 4:
            raise ValueError(f"the compiled decode step needs a KV cache of at least 4 positions, not {kv.max_seq_len}")
        self.model, self.kv = model, kv
        # the context lengths the graph serves: dynamo treats sizes 0 and 1 as constants, and a slice that reaches the
        # cache's full length makes inductor guard on it, so the step at either end runs eagerly
        self.contexts = (2, kv.max_seq_len - 1)
        # The model's own run_layers, the function eager steps run, compiled for one sequence (attention a
        # OneSequenceDecode). cpp_wrapper: the generated code calls its kernels from C++, not Python: a shorter one-token
        # step for about twice the first compilation's time (benchmarks/decode_step.py)
        # One thing runs eagerly between graphs (mark_graph_breaks): a mixture-of-experts block's experts
        # (TransformerModel._moe). Without them the step is one graph (tests/test_architectures.py counts the graph
        # breaks), oneDNN-prepacked matrices included (linear.prepacked_mm: a type kept dense, weights mode bf16).
        # dynamic=False: every size is static but the two _inputs marks dynamic, the context length and the slot.
        mark_graph_breaks()
        # The graphs dynamo made (a _Graph each: one a thread count, or several where the step broke) and the ones
        # called directly (DirectCall, by thread count; direct_reason: why a graph is not, None when all are)
        self._graphs: dict[str, list[_Graph]] = {"one": [], "batched": []}
        self._direct: dict[tuple[str, int], DirectCall] = {}
        self.direct_reason: str | None = None
        self._compiled = torch.compile(_own_code(model.run_layers), dynamic=False, backend=self._backend("one"))
        # The graphs are specialised to torch's thread count (the kernels size per-thread buffers by it; dynamo
        # guards on it), so there is one set per count the step runs with: a stage that uses more threads for a
        # micro-batch alone in the pipeline (StageConfig.threads_alone) has two. None: this thread's count (which
        # warm_up_in_background's thread takes over).
        self.thread_counts = tuple(sorted(set(thread_counts or (torch.get_num_threads(),))))
        self.compile_seconds: dict[int, float] = {}  # thread count -> seconds its graph took to compile (warm_up)
        # pending -> compiling -> ready (forward runs the graphs) | failed (error says why; decode stays eager). Written
        # by the compiling thread only; forward reads it and runs nothing compiled before "ready".
        self.state = "pending"
        self.error: str | None = None
        # The one-sequence step as a saved AOTInductor package (aoti_decode), by thread count, where it applies:
        # package_dir (aoti_decode.cache_dir()) and the model file's fingerprint given, and aoti_decode.why_not_packaged
        # None. It is loaded (or built, then saved) first, and runs as soon as it passed its check against the eager
        # step, whatever the torch.compile graphs' progress; where it fails the one-sequence graph is torch.compile's.
        self._packaged: dict[int, aoti_decode.PackagedStep] = {}
        self.package_dir = package_dir
        self.fingerprint = fingerprint
        self.package_reason = ("no package folder ($STAGEMESH_AOTI_CACHE off)" if package_dir is None
                               else "no model fingerprint" if fingerprint is None
                               else aoti_decode.why_not_packaged(model))
        self.one_path: str | None = None  # "aoti-loaded" | "aoti-compiled" | "torch.compile", once the step runs
        self.one_seconds: dict[int, float] = {}  # thread count -> seconds to the one-sequence step (load or build)
        self.broken = False  # set when a serving-time call would have recompiled: eager from then on
        self.steps = 0  # decode steps run compiled
        # The batched step: decode micro-batches of B = batch_sizes[0]..[1] sequences through a second copy of
        # run_layers, B the one dynamic size (attention a BatchDecode: the kernel reads each sequence's own context in
        # place, so nothing else depends on the values). Where the kernel does not cover every layer, or a matmul
        # switches kernel inside the range, batched steps stay eager (batch_reason says why).
        self.batch_sizes = (2, min(kv.num_slots, (switch_rows(model) or kv.num_slots + 1) - 1))
        self.batch_reason = BatchDecode.covers(model.config, model.dtype)
        if self.batch_reason is None and self.batch_sizes[1] < 3:  # 2..2 cannot be dynamic, and would serve little
            self.batch_reason = f"batches of at most {self.batch_sizes[1]} sequences decode eagerly"
        self._batched = None if self.batch_reason else torch.compile(_own_code(model.run_layers), dynamic=False,
                                                                     backend=self._backend("batched"))
        self.batch_compile_seconds: dict[int, float] = {}
        self.batch_broken = False
        self.batch_steps = 0  # decode steps of 2 or more sequences run compiled

    def _backend(self, kind: str):
        """The torch.compile backend of one graph kind: inductor with its C++ wrapper, the result kept as a _Graph."""
        def backend(gm, example_inputs):
            # imported here: inductor takes seconds to import
            from torch._inductor.compile_fx import compile_fx
            graph = _Graph(compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True}))
            self._graphs[kind].append(graph)
            return graph
        return backend

    def _bind(self, kind: str, threads: int, made: int, probes: list[tuple[tuple, dict[str, int]]], graph) -> None:
        """Call the graph just compiled for `threads` directly from now on, where DirectCall.bind can tie its
        arguments to the probes' inputs (`made`: how many graphs of the kind there were before it compiled)."""
        new = self._graphs[kind][made:]
        if len(new) != 1:
            direct, why = None, f"the step compiled to {len(new)} graphs"
        else:
            direct, why = DirectCall.bind(new[0], probes, lambda inputs: graph(*inputs))
        if direct is None:
            self.direct_reason = f"{kind} step, {threads} threads: {why}"
            log.info("the compiled %s step runs through dynamo with %d threads: %s", kind, threads, why)
        else:
            self._direct[kind, threads] = direct

    def _one_probes(self, pos: int) -> list[tuple[tuple, dict[str, int]]]:
        """Two one-sequence steps in the scratch row at two contexts, neither equal to the slot's size (so that each
        int the graph takes names one size)."""
        slot, d = self.kv.scratch_slot, self.model.config.hidden_size
        marker = slot + OneSequenceDecode.SLOT_OFFSET
        positions = [p for p in (pos, pos + 1, pos - 1, pos + 2) if p + 1 != marker and self.covers(p + 1)][:2]
        gen = torch.Generator().manual_seed(0)
        return [(self._inputs(torch.randn(1, d, generator=gen), slot, p), self._one_sizes(slot, p)) for p in positions]

    @staticmethod
    def _one_sizes(slot: int, pos: int) -> dict[str, int]:
        """The one-sequence graph's dynamic sizes (what OneSequenceDecode's tensor lengths carry)."""
        return {"context": pos + 1, "slot": slot + OneSequenceDecode.SLOT_OFFSET}

    def covers(self, ctx: int) -> bool:
        return self.contexts[0] <= ctx <= self.contexts[1]

    def _inputs(self, hidden: torch.Tensor, slot: int, pos: int):
        """run_layers' arguments, built here under inference mode: a tensor from outside it (BatchLayout's) differs in
        dispatch keys, which dynamo guards on, and would recompile. hidden is copied (D floats) for the same reason: a
        stage after the first gets it straight from the wire, a view of a ZeroMQ frame made outside inference mode
        (and at any alignment, which inductor also guards); uncopied, that stage's first compiled call recompiled
        and the stage decoded eagerly for good."""
        model = self.model
        hidden = hidden.clone(memory_format=torch.contiguous_format)
        ropes = model.rope_tables(torch.tensor([pos]), self.kv.max_seq_len)
        attention = OneSequenceDecode.at(slot, pos, model.config, model.dtype)
        torch._dynamo.mark_dynamic(attention.keys, 0, min=self.contexts[0], max=self.contexts[1])
        rows = self.kv.k[0].shape[0]  # every slot the step may read, the scratch row included
        torch._dynamo.mark_dynamic(attention.slot_marker, 0, min=OneSequenceDecode.SLOT_OFFSET,
                                   max=rows - 1 + OneSequenceDecode.SLOT_OFFSET)
        if attention.sliding_mask is not None:
            torch._dynamo.mark_dynamic(attention.sliding_mask, 3, min=self.contexts[0], max=self.contexts[1])
        return hidden, ropes, attention, self.kv.k, self.kv.v

    def _direct_inputs(self, hidden: torch.Tensor, layout: BatchLayout, pos: int):
        """_inputs' arguments for a DirectCall of one sequence at `pos`, less what only a trace needs: the layout's own
        slot and position tensors, the rope tables' row as views (OneSequenceDecode.called_directly). hidden is still
        copied: from the wire it is a view of a ZeroMQ frame, at any alignment."""
        model = self.model
        hidden = hidden.clone(memory_format=torch.contiguous_format)
        attention = OneSequenceDecode.called_directly(layout.token_slots, layout.positions, pos, model.config, model.dtype)
        return hidden, model.rope_row(pos, self.kv.max_seq_len), attention, self.kv.k, self.kv.v

    def _batch_inputs(self, hidden: torch.Tensor, slots: list[int], positions: torch.Tensor, mark: bool = True):
        """The batched graph's run_layers arguments (hidden [B, D] f32, B in batch_sizes), built under inference mode
        as _inputs' are; B, every tensor's first size, is the graph's one dynamic size."""
        lo, hi = self.batch_sizes
        hidden = hidden.clone(memory_format=torch.contiguous_format)
        attention = BatchDecode.at(slots, positions)
        ropes = self.model.rope_tables(attention.positions, self.kv.max_seq_len)  # ((cos, sin), sliding's or None)
        if not mark:
            return hidden, ropes, attention, self.kv.k, self.kv.v
        tables = [t for pair in ropes if pair is not None for t in pair]
        for t in (hidden, *tables, attention.token_slots, attention.positions, attention.contexts):
            torch._dynamo.mark_dynamic(t, 0, min=lo, max=hi)
        return hidden, ropes, attention, self.kv.k, self.kv.v

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Make the steps at every thread count: first the one-sequence step's package where one applies (loaded,
        else built and saved; it runs as soon as it passes its check), then with torch.compile the one-sequence graph
        where there is no package and the batched graph, one call each in the KV cache's scratch row (no sequence ever
        holds it); compile_seconds records each count's. Raises CapabilityMissing when inductor fails (state
        "failed"). Leaves this thread's torch thread count as it found it."""
        self.state = "compiling"
        own = torch.get_num_threads()
        pos = (self.contexts[0] + self.contexts[1]) // 2 - 1  # inside the dynamic range, at neither end
        try:
            if self.package_reason is None:
                for threads in self.thread_counts:
                    torch.set_num_threads(threads)
                    self._package_one(threads)
            _compiling.add(id(self))
            for threads in self.thread_counts:
                t = time.perf_counter()
                torch.set_num_threads(threads)
                if threads in self._packaged:
                    if self._batched is not None:
                        self._warm_up_batched(threads, pos)
                    continue
                hidden = torch.zeros(1, self.model.config.hidden_size)
                made = len(self._graphs["one"])
                try:  # no duck sizing: the context and the slot are two sizes even where they are equal when traced
                    with torch.fx.experimental._config.patch(use_duck_shape=False):
                        self._compiled(*self._inputs(hidden, self.kv.scratch_slot, pos))
                except Exception as e:  # inductor: no C++ compiler, an unsupported op, ...
                    self.error = (f"torch.compile failed: {str(e).strip().splitlines()[0][:300]} "
                                  "(inductor needs a C++ compiler, g++)")
                    self.state = "failed"
                    raise CapabilityMissing(f"--compile-decode: {self.error}; drop --compile-decode to decode "
                                            "eagerly") from None
                self.compile_seconds[threads] = round(time.perf_counter() - t, 1)
                self.one_seconds[threads] = self.compile_seconds[threads]
                self.one_path = "torch.compile"
                log.info("compiled the decode step for contexts %d..%d with %d threads in %.1f s", *self.contexts,
                         threads, self.compile_seconds[threads])
                self._bind("one", threads, made, self._one_probes(pos), self._compiled)
                if self._batched is not None:
                    self._warm_up_batched(threads, pos)
            self.state = "ready"
        finally:
            torch.set_num_threads(own)
            _compiling.discard(id(self))

    def _package_one(self, threads: int) -> None:
        """The one-sequence step at this thread count from its AOTInductor package: loaded from the cache, else
        built and saved (aoti_decode.load_or_build), checked against the eager step; from then on forward runs it.
        Any failure is logged in a line and leaves the step to torch.compile."""
        t = time.perf_counter()
        try:
            key = aoti_decode.package_key(self.model, self.kv, threads, self.fingerprint)
            if not os.path.exists(aoti_decode.package_path(self.package_dir, key)):
                log.info("decoding runs slower until the compiled decode step is built (a one-time build of about a "
                         "minute on 2 cores, saved for later starts in %s)", self.package_dir)
                _compiling.add(id(self))  # export and inductor trace while torch.compile graphs would run
            try:
                step = aoti_decode.load_or_build(self.package_dir, self.model, self.kv, threads, self.fingerprint)
            finally:
                _compiling.discard(id(self))
        except Exception as e:
            why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            self.package_reason = f"{type(e).__name__}: {why}"
            log.warning("the saved compiled decode step is unavailable (%s); compiling it with torch.compile instead",
                        self.package_reason)
            return
        self.one_seconds[threads] = round(time.perf_counter() - t, 1)
        self._packaged[threads] = step
        self.one_path = step.how
        if step.how == "aoti-loaded":
            log.info("decoding at full speed: compiled step loaded from cache in %.1f s (%d threads)",
                     self.one_seconds[threads], threads)
        else:
            log.info("decoding at full speed: compiled step built in %.1f s and saved for later starts (%d threads)",
                     self.one_seconds[threads], threads)

    def _warm_up_batched(self, threads: int, pos: int) -> None:
        """Compile the batched graph at this thread count: one call of B sequences, all in the scratch row at
        positions pos..pos+B-1. A failure leaves batched steps eager (batch_reason), the one-sequence step as it is."""
        t = time.perf_counter()
        b = min(self.batch_sizes[1], 4)
        hidden = torch.zeros(b, self.model.config.hidden_size)
        made = len(self._graphs["batched"])
        try:
            self._batched(*self._batch_inputs(hidden, [self.kv.scratch_slot] * b, torch.arange(pos, pos + b)))
        except Exception as e:
            self.batch_reason = f"torch.compile failed: {str(e).strip().splitlines()[0][:300]}"
            self._batched = None
            log.warning("batched decode steps stay eager: %s", self.batch_reason)
            return
        self.batch_compile_seconds[threads] = round(time.perf_counter() - t, 1)
        log.info("compiled the batched decode step for %d..%d sequences with %d threads in %.1f s", *self.batch_sizes,
                 threads, self.batch_compile_seconds[threads])
        gen = torch.Generator().manual_seed(0)
        probes = [(self._batch_inputs(torch.randn(n, self.model.config.hidden_size, generator=gen),
                                      [self.kv.scratch_slot] * n, torch.arange(pos, pos + n)), {"batch": n})
                  for n in (self.batch_sizes[0], self.batch_sizes[0] + 1)]  # batch_sizes[1] >= 3 (__init__)
        self._bind("batched", threads, made, probes, self._batched)

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
        """What a stage's /info reports: the compile state (and error), the context lengths the graph serves, each
        thread count's compile seconds, the steps run compiled so far, and whether a serving-time call fell back to
        eager for good."""
        one_ready = all(n in self._packaged for n in self.thread_counts) or self.state == "ready"
        return {"state": self.state, "error": self.error, "threads": list(self.thread_counts),
                # the one-sequence step: which path runs it ("aoti-loaded": a saved package, "aoti-compiled": a package
                # built by this process, "torch.compile"), whether it runs at every thread count, the seconds each took,
                # and why there is no package where there is none
                "one_sequence": {"path": self.one_path, "ready": one_ready,
                                 "seconds": {str(n): s for n, s in self.one_seconds.items()},
                                 "package_reason": self.package_reason,
                                 "packages": sorted({p.path for p in self._packaged.values()})},
                "contexts": list(self.contexts),
                "compile_seconds": {str(n): s for n, s in self.compile_seconds.items()}, "steps": self.steps,
                # the graphs called without dynamo ("one" / "batched" and the thread count), and why one is not
                "direct": sorted(f"{kind}:{threads}" for kind, threads in self._direct), "direct_reason": self.direct_reason,
                "fell_back_to_eager": self.broken,
                "batched": {"sizes": list(self.batch_sizes), "reason": self.batch_reason,
                            "compile_seconds": {str(n): s for n, s in self.batch_compile_seconds.items()},
                            "steps": self.batch_steps, "fell_back_to_eager": self.batch_broken}}

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, layout: BatchLayout) -> torch.Tensor | None:
        """hidden [B, D] f32 of a decode micro-batch -> [B, D] f32, or None when no compiled graph covers it (graphs
        not compiled yet, or another piece's compiling; not a decode step; one sequence at a context outside
        `contexts`; B outside `batch_sizes` or no batched graph; a thread count it was not compiled for): run eager
        then. Never compiles: a call that would (a guard that fails on an input nobody foresaw) runs eager instead,
        from then on, and is logged."""
        if not layout.decode_only or torch.get_num_threads() not in self.thread_counts:
            return None
        if len(layout.slots) == 1 and self._packaged:  # a package runs without dynamo: whatever else compiles
            packaged = self._packaged.get(torch.get_num_threads())
            pos = layout.starts[0]
            if packaged is not None and self.covers(pos + 1) and hidden.dtype == torch.float32 \
                    and tuple(hidden.shape) == (1, self.model.config.hidden_size):
                out = packaged(hidden, layout, pos)
                self.steps += 1
                return out
        if self.state != "ready" or _compiling:
            return None
        b = len(layout.slots)
        if hidden.dtype != torch.float32 or tuple(hidden.shape) != (b, self.model.config.hidden_size):
            return None  # not what the graphs were built for (eager raises the error that names it)
        if b == 1:
            pos = layout.starts[0]  # a decode step's one position
            if self.broken or not self.covers(pos + 1):
                return None
            slot = layout.slots[0]
            direct = self._direct.get(("one", torch.get_num_threads()))
            if direct is not None:
                out = direct(self._direct_inputs(hidden, layout, pos), self._one_sizes(slot, pos))
            else:
                out = self._run(self._compiled, self._inputs(hidden, slot, pos), "broken")
            self.steps += out is not None
            return out
        if self._batched is None or self.batch_broken or not self.batch_sizes[0] <= b <= self.batch_sizes[1]:
            return None
        direct = self._direct.get(("batched", torch.get_num_threads()))
        if direct is not None:
            out = direct(self._batch_inputs(hidden, layout.slots, layout.positions, mark=False), {"batch": b})
        else:
            out = self._run(self._batched, self._batch_inputs(hidden, layout.slots, layout.positions), "batch_broken")
        self.batch_steps += out is not None
        return out

    def _run(self, graph, inputs: tuple, broken: str) -> torch.Tensor | None:
        """One serving-time call of a compiled graph; None (and self.<broken> set: eager from then on) where it would
        have recompiled."""
        try:
            # Only the guards that tell the graphs apart (the thread count) run: the full set checks every weight
            # tensor the step reads, a sizeable share of a small model's step. What they would check is fixed here:
            # the model's weights and KV cache are the same tensors at every call, _inputs / _batch_inputs build the
            # rest the same way, and forward holds the sizes and dtype of what varies.
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                return graph(*inputs)
        except RuntimeError as e:  # dynamo's "Detected recompile when torch.compile stance is 'fail_on_recompile'"
            setattr(self, broken, True)
            log.warning("compiled decode step would recompile while serving (%s); decoding eagerly from now on",
                        str(e).splitlines()[0][:300])
            return None
