"""One sequence's decode step as a saved AOTInductor package: built once per model, split and machine, loaded in
seconds on every later start (benchmarks/aoti_trial.py; docs/performance.md#compiled-decode).

What is exported is the model's own TransformerModel.run_layers with a OneSequenceDecode, as CompiledDecode compiles
it: torch.export with the context length and the slot dynamic keeps the K/V writes as index_put_ on the cache inputs,
so the loaded package writes the caller's cache tensors in place. The model's weights are inputs of the exported
program, not constants: the package holds code only (a few MB), and every call hands it the live weight tensors the
model already holds, so loading it adds no copy of the weights (a package with the weights inside is 67 MB for
SmolLM2-135M, GBs for an 8B model). To make them inputs, the export traces a copy of the model's Python objects that
shares every tensor with the model, the weights swapped for the program's inputs in that copy (the serving model is
never touched: it keeps decoding meanwhile).

A package is valid for one key (package_key): the model file's fingerprint, the layer range, the weights mode and
each matrix's kernel, the dtype, torch's thread count, the KV cache's shapes, the CPU (model name and flags), torch's
version, the sources of shared/models and shared/kernels, and FORMAT_VERSION. Packages live under
$STAGEMESH_AOTI_CACHE (default ~/.cache/stagemesh/aoti; "off": none is read or written), one file per key, written to
a temporary name and renamed; a file that fails to load or to match is deleted and built again.

Not packaged (why_not_packaged; those pieces keep torch.compile): a mixture-of-experts block (its experts run eagerly
between graphs, a break export does not have), and oneDNN-prepacked matrices (the graph calls them through a Python
op by a per-process handle that the package would bake in)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time

import torch

from shared.batch.layout import BatchLayout
from shared.batch.steps import Decode, Prefill
from shared.kernels import qdot
from shared.models import linear
from shared.models.attention import OneSequenceDecode
from shared.models.kv_cache import KVCache

log = logging.getLogger("stagemesh.compiled_decode")

FORMAT_VERSION = 1  # of what a package holds and how it is called: a change here makes every saved package stale
CACHE_ENV = "STAGEMESH_AOTI_CACHE"  # the packages' folder; "off": never read or write one
META = "stagemesh"  # the package metadata entry holding our key and the weights' paths


def cache_dir() -> str | None:
    """$STAGEMESH_AOTI_CACHE ("off": None), else ~/.cache/stagemesh/aoti."""
    value = os.environ.get(CACHE_ENV)
    if value == "off":
        return None
    return value or os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "aoti")


def why_not_packaged(model) -> str | None:
    """None where the one-sequence step can be a package; otherwise why it stays on torch.compile."""
    if any(block.experts for block in model.blocks):
        return "a mixture-of-experts block's experts run eagerly between graphs, which export cannot make"

    def prepacked(lin) -> bool:  # what a one-row call reaches
        if isinstance(lin, linear.SwitchedLinear):
            return prepacked(lin.small if lin.max_tokens > 1 else lin.large)
        if isinstance(lin, linear.ConcatLinear):
            return any(prepacked(p) for p in lin.parts)
        return bool(getattr(lin, "prepacked", False))
    if any(prepacked(lin) for block in model.blocks for lin in block.linears().values()):
        return "oneDNN-prepacked matrices are called by a per-process handle, which a saved package would bake in"
    return None


# ---- the key -------------------------------------------------------------------------------------------------------

@functools.cache
def cpu_id() -> str:
    """The CPU's model name and flags (what inductor's generated code and our kernels were built for)."""
    found = {"model name": platform.processor() or platform.machine(), "flags": ""}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                if field.strip() in found and value.strip():
                    found[field.strip()] = value.strip()
                if line.startswith("flags"):  # the first processor's fields are enough
                    break
    return f"{found['model name']} | {' '.join(sorted(found['flags'].split()))}"


@functools.cache
def code_version() -> str:
    """A hash of the sources the traced step runs (shared/models, shared/kernels): a changed model makes new
    packages (the load's check against the eager step would catch most changes too, not every one)."""
    h = hashlib.sha256()
    shared = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("models", "kernels"):
        folder = os.path.join(shared, package)
        for name in sorted(os.listdir(folder)):
            if name.endswith((".py", ".cpp", ".h")):
                h.update(name.encode())
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def package_key(model, kv: KVCache, threads: int, fingerprint: str) -> dict:
    """Everything the package's code depends on: equal keys, the same compiled code."""
    return {"format": FORMAT_VERSION, "model": fingerprint, "layers": [model.layers.start, model.layers.stop],
            "weights": model.weights, "kernels": model.weight_summary(), "dtype": str(model.dtype),
            "threads": threads, "qdot": qdot.usable(),
            "kv": {"k": [list(t.shape) for t in kv.k], "v": [list(t.shape) for t in kv.v], "dtype": str(kv.k[0].dtype),
                   "max_seq_len": kv.max_seq_len},
            "cpu": cpu_id(), "torch": torch.__version__, "code": code_version()}


def package_path(folder: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(folder, f"decode-one-{digest}.pt2")


# ---- the weights: every tensor the step reads, by its path in the model ---------------------------------------------

def _tensors(model) -> dict[int, tuple[tuple, torch.Tensor]]:
    """id -> (path, tensor) of every tensor reachable from the model through our objects, lists, tuples and dicts;
    a path is a tuple of ("a", attribute) / ("i", index or key) steps, the first one found (a fixed order)."""
    found: dict[int, tuple[tuple, torch.Tensor]] = {}
    seen: set[int] = set()

    def walk(obj, path: tuple) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), (path, obj))
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(k, (str, int)):
                    walk(v, (*path, ("i", k)))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, (*path, ("i", i)))
        elif type(obj).__module__.startswith("shared.") and hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                walk(v, (*path, ("a", k)))
    walk(model, ())
    return found


def _get(obj, path):
    for kind, key in path:
        obj = getattr(obj, key) if kind == "a" else obj[key]
    return obj


def _set(obj, path, value) -> None:
    parent = _get(obj, path[:-1])
    kind, key = path[-1]
    if kind == "a":
        setattr(parent, key, value)
    else:
        parent[key] = value  # a tuple refuses: then the export fails and says so


class _ReadTensors(torch.overrides.TorchFunctionMode):
    """Records every tensor handed to a torch function (the model's weights among them)."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor):
                self.ids.add(id(a))
        return func(*args, **(kwargs or {}))


# ---- the step's inputs ------------------------------------------------------------------------------------------------

class _Inputs:
    """The exported program's flat inputs for one step: hidden, the rope rows, the slot and position, keys [C],
    slot_marker [slot + 2], the sliding mask (on models with a window), every layer's K then V, the weights."""

    def __init__(self, model, kv: KVCache):
        self.model, self.kv = model, kv
        self.keys = torch.arange(kv.max_seq_len)  # keys / slot_marker: views of these, of the step's lengths
        self.marker = torch.empty(kv.k[0].shape[0] + OneSequenceDecode.SLOT_OFFSET, dtype=torch.uint8)

    def parts(self, hidden: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor, slot: int, pos: int):
        model, kv = self.model, self.kv
        (cos, sin), swa = model.rope_row(pos, kv.max_seq_len)
        ropes = [cos, sin, *(swa or ())]
        keys = self.keys[:pos + 1]
        mask = OneSequenceDecode._sliding_mask(keys, pos, model.config, model.dtype)
        return (hidden.clone(memory_format=torch.contiguous_format), ropes, token_slots, positions, keys,
                self.marker[:slot + OneSequenceDecode.SLOT_OFFSET], [] if mask is None else [mask], list(kv.k), list(kv.v))


class _Step(torch.nn.Module):
    """run_layers of one sequence's decode step over flat arguments, for torch.export; `model` a copy of the model's
    objects sharing its tensors, in which forward swaps the weights at `paths` for its `weights` argument."""

    def __init__(self, model, paths: list[tuple]):
        super().__init__()
        self.__dict__["model"] = model  # not a Module
        self.__dict__["paths"] = paths

    def forward(self, hidden, ropes, token_slots, positions, keys, slot_marker, mask, k_layers, v_layers, weights):
        model = self.model
        for path, w in zip(self.paths, weights):
            _set(model, path, w)
        attention = OneSequenceDecode(token_slots, positions, keys, slot_marker, mask[0] if mask else None, qdot.usable())
        pair = (ropes[0], ropes[1]), ((ropes[2], ropes[3]) if len(ropes) > 2 else None)
        return model.run_layers(hidden, pair, attention, k_layers, v_layers)


class PackagedStep:
    """A loaded package as the one-sequence decode step: hidden [1, D] f32, the step's layout and position -> [1, D],
    the K/V written into the cache in place. `how`: "aoti-loaded" (from the cache) or "aoti-compiled" (built in this
    process); `seconds`: what that took."""

    def __init__(self, package, model, kv: KVCache, weights: list[torch.Tensor], path: str, how: str):
        self.package, self.model, self.kv, self.weights, self.path, self.how = package, model, kv, weights, path, how
        self.inputs = _Inputs(model, kv)
        self.seconds = 0.0
        self.exact: bool | None = None  # the check against the eager step: bit for bit, or to rounding

    def __call__(self, hidden: torch.Tensor, layout: BatchLayout, pos: int) -> torch.Tensor:
        parts = self.inputs.parts(hidden, layout.token_slots, layout.positions, layout.slots[0], pos)
        flat = [parts[0], *parts[1], parts[2], parts[3], parts[4], parts[5], *parts[6], *parts[7], *parts[8],
                *self.weights]
        return self.package.loader.run(flat)[0]

    @torch.inference_mode()
    def check(self, steps: int = 8) -> None:
        """A few positions of one sequence prefilled in the KV cache's scratch row, then one step packaged and eager:
        the same output and K/V, bit for bit (exact) or to rounding, else ValueError. The cache rows are the model's own K/V: random ones make attention's softmax so peaked that
        a last-bit difference in a score can pick another key."""
        model, kv = self.model, self.kv
        slot, gen = kv.scratch_slot, torch.Generator().manual_seed(3)
        pos = min(steps, kv.max_seq_len - 3)
        model.forward(torch.randn(pos, model.config.hidden_size, generator=gen),
                      BatchLayout.build([slot], [Prefill(pos, 0, pos, True)], kv.max_seq_len), kv)
        hidden = torch.randn(1, model.config.hidden_size, generator=gen)
        layout = BatchLayout.build([slot], [Decode(pos)], kv.max_seq_len)
        eager = model.forward(hidden.clone(), layout, kv).clone()
        written = torch.stack([t[slot, :, pos].float() for t in [*kv.k, *kv.v]])
        for t in [*kv.k, *kv.v]:
            t[slot, :, pos].fill_(float("nan"))
        ours = self(hidden, layout, pos).clone()
        ours_kv = torch.stack([t[slot, :, pos].float() for t in [*kv.k, *kv.v]])
        self.exact = torch.equal(ours, eager) and torch.equal(ours_kv, written)
        if self.exact:
            return
        # of the largest magnitude: fused kernels round at other points (a step of a real sequence, float32, differs
        # from eager's by up to ~1 % of its largest value, where the torch.compile step does too); a wrong weight or
        # cache row is off by the whole magnitude
        rel = 2e-2 if model.dtype == torch.float32 else 5e-2
        scale, kv_scale = float(eager.abs().max()) + 1e-6, float(written.abs().max()) + 1e-6
        diff, kv_diff = float((ours - eager).abs().max()), float((ours_kv - written).abs().nan_to_num(float("inf")).max())
        if not (diff <= rel * scale and kv_diff <= rel * kv_scale):
            raise ValueError(f"its step differs from the eager step (output by {diff:.3g} of {scale:.3g}, "
                             f"K/V by {kv_diff:.3g} of {kv_scale:.3g})")


def _resolve(model, meta: dict) -> list[torch.Tensor]:
    """The live weight tensors at the package's recorded paths, each checked against its recorded shape and dtype."""
    weights = []
    for path, shape, stride, dtype in zip(meta["paths"], meta["shapes"], meta["strides"], meta["dtypes"]):
        w = _get(model, [tuple(step) for step in path])
        if not isinstance(w, torch.Tensor) or list(w.shape) != shape or list(w.stride()) != stride or str(w.dtype) != dtype:
            raise ValueError(f"weight {path} is not the {dtype} {shape} tensor it was built with")
        weights.append(w)
    return weights


def load(path: str, model, kv: KVCache, key: dict) -> PackagedStep:
    """The package at `path` as this model's step (raises on anything amiss: unreadable, another key, weights that
    do not match)."""
    t = time.perf_counter()
    package = torch._inductor.aoti_load_package(path)
    meta = json.loads(package.get_metadata()[META])
    if meta["key"] != json.loads(json.dumps(key)):
        raise ValueError("it was built for another model, split or machine")
    step = PackagedStep(package, model, kv, _resolve(model, meta), path, "aoti-loaded")
    step.seconds = time.perf_counter() - t
    return step


@torch.inference_mode()
def build(path: str, model, kv: KVCache, key: dict) -> PackagedStep:
    """Export the step, compile it with AOTInductor into a package saved at `path` (a temporary file renamed), load
    it. Compiles with torch's current thread count (the key's)."""
    t = time.perf_counter()
    # the weights: the model's tensors that the step, run eagerly in the scratch row, hands to torch's functions
    inputs = _Inputs(model, kv)
    pos = 40 if kv.max_seq_len > 44 else kv.max_seq_len // 2
    scratch = inputs.parts(torch.zeros(1, model.config.hidden_size), torch.tensor([kv.scratch_slot]),
                           torch.tensor([pos]), kv.scratch_slot, pos)
    seen = _ReadTensors()
    with seen:
        _Step(model, [])(*scratch, [])
    by_id = _tensors(model)
    used = [pt for i, pt in by_id.items() if i in seen.ids]  # in the walk's order
    paths, weights = [p for p, _ in used], [w for _, w in used]
    # a copy of the model's objects, its tensors shared, in which the export swaps the weights for its inputs
    twin = copy.deepcopy(model, memo={i: w for i, (_, w) in by_id.items()})
    # traced at a slot and a context that differ (neither is mistaken for the other)
    trace_slot = 1 if kv.k[0].shape[0] > 2 else 0
    args = inputs.parts(torch.zeros(1, model.config.hidden_size), torch.tensor([trace_slot]), torch.tensor([pos]),
                        trace_slot, pos)
    args = (*args, weights)
    context = torch.export.Dim("context", min=2, max=kv.max_seq_len - 1)
    slot_dim = torch.export.Dim("slot", min=OneSequenceDecode.SLOT_OFFSET,
                                max=kv.k[0].shape[0] - 1 + OneSequenceDecode.SLOT_OFFSET)
    layers = len(kv.k)
    dynamic = (None, [None] * len(args[1]), None, None, {0: context}, {0: slot_dim}, [{3: context}] * len(args[6]),
               [None] * layers, [None] * layers, [None] * len(weights))
    ep = torch.export.export(_Step(twin, paths), args, dynamic_shapes=dynamic)
    baked = sum(c.numel() * c.element_size() for c in ep.constants.values() if isinstance(c, torch.Tensor))
    if baked > 2**20:  # a weight read some other way than through a torch function: it would be copied in
        raise ValueError(f"{baked / 2**20:.0f} MiB of the model's tensors would be copied into the package")
    meta = {"key": key, "paths": [list(map(list, p)) for p in paths], "shapes": [list(w.shape) for w in weights],
            "strides": [list(w.stride()) for w in weights], "dtypes": [str(w.dtype) for w in weights]}
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".pt2", dir=folder)
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=tmp,
                                                 inductor_configs={"aot_inductor.metadata": {META: json.dumps(meta)}})
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    step = load(path, model, kv, key)
    step.how, step.seconds = "aoti-compiled", time.perf_counter() - t
    return step


def load_or_build(folder: str, model, kv: KVCache, threads: int, fingerprint: str) -> PackagedStep:
    """This piece's packaged step at this thread count: the saved package where one loads and passes the check
    against the eager step, else a new one (the bad file deleted first). Raises where building fails."""
    key = package_key(model, kv, threads, fingerprint)
    path = package_path(folder, key)
    if os.path.exists(path):
        try:
            step = load(path, model, kv, key)
            step.check()
            return step
        except Exception as e:
            log.warning("the saved compiled decode step %s is unusable (%s): building it again", path,
                        str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__)
            with contextlib.suppress(OSError):
                os.remove(path)
    step = build(path, model, kv, key)
    step.check()
    return step
