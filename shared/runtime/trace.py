"""Tracing: capture intermediate activations during inference and compare two runs layer by layer, so a
divergence between deployments (split, dtype, device, a faulty stage) is pinned to the layer and step where it
starts. Captures are keyed by (step, layer, point), never by stage, so runs with different splits compare.

- CaptureHook (the LayerHook implementation) records one sequence's rows at each layer of a piece;
  TraceRecorder holds a whole run's captures and tokens.
- HookCapture, TraceRecorder, StageComparison, TraceResult serialize to JSON.
"""

from __future__ import annotations

import base64
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from shared.config import SCHEDULER_DEFAULTS

DEFAULT_CAPTURE_BUDGET = 1 << 20  # bytes of raw float32 one stage may return per micro-batch
LAYER_OUTPUT = "layer_output"
STAGE_TRANSFER = "stage_transfer"  # the activation a stage received from the previous one


@dataclass
class HookCapture:
    stage: str
    layer: int
    point: str
    position: int  # absolute position of the first captured token (identifies the step)
    shape: list[int]
    summary: dict
    data: bytes | None = None  # float32, row-major; None when over budget

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.position, self.layer, self.point)

    def tensor(self) -> torch.Tensor | None:
        if self.data is None:
            return None
        return torch.from_numpy(np.frombuffer(self.data, dtype=np.float32).copy()).reshape(self.shape)

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> HookCapture:
        return cls(**d)

    def to_json(self) -> dict:
        d = asdict(self)
        d["data"] = base64.b64encode(self.data).decode() if self.data is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> HookCapture:
        return cls(**{**d, "data": base64.b64decode(d["data"]) if d.get("data") else None})


def summarize(t: torch.Tensor) -> dict:
    t = t.detach().float()
    return {"mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "absmax": float(t.abs().max()), "l2": float(t.norm())}


class CaptureHook:
    """LayerHook recording one sequence's rows at each layer output, and the activation a non-first stage
    received (point STAGE_TRANSFER). Full tensors while within budget, summaries beyond."""

    def __init__(self, stage: str, position: int, rows: slice | None = None, first_layer: int | None = None,
                 budget: int = DEFAULT_CAPTURE_BUDGET):
        self.stage, self.position, self.rows = stage, position, rows
        self.first_layer = first_layer  # set on non-first stages: its input is a stage transfer
        self.budget = budget
        self.captures: list[HookCapture] = []

    @classmethod
    def for_piece(cls, layers, position, at_position: int, rows: slice | None = None) -> CaptureHook:
        """The hook of one stage/piece: named stage[a:b]; a non-first piece also records what it received."""
        first = None if position.has_embedding else layers.start
        return cls(f"stage[{layers}]", at_position, rows, first)

    def _record(self, layer: int, point: str, hidden: torch.Tensor) -> None:
        x = (hidden[self.rows] if self.rows is not None else hidden).detach().float().contiguous()
        data = None
        if x.nbytes <= self.budget:
            self.budget -= x.nbytes
            data = x.cpu().numpy().tobytes()
        self.captures.append(HookCapture(self.stage, layer, point, self.position, list(x.shape), summarize(x), data))

    def on_layer_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        if layer == self.first_layer:
            self._record(layer, STAGE_TRANSFER, hidden)
        return hidden

    def on_layer_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        self._record(layer, LAYER_OUTPUT, hidden)
        return hidden


@dataclass
class TraceRecorder:
    """One traced run: the captures of every step and the tokens it produced."""

    captures: list[HookCapture] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0

    def step_of(self, position: int) -> int:
        """0 for the prefill, k for the k-th decode step."""
        return 0 if position < self.prompt_len else position - self.prompt_len + 1

    def to_json(self, prompt_ids: list[int]) -> dict:
        """The `trace` field of a gateway response (what trace_gateway reads back)."""
        return {"prompt_ids": prompt_ids, "tokens": self.tokens, "captures": [c.to_json() for c in self.captures]}

    @classmethod
    def from_json(cls, d: dict) -> TraceRecorder:
        return cls([HookCapture.from_json(c) for c in d["captures"]], d["tokens"], len(d["prompt_ids"]))


# ---- comparison ----------------------------------------------------------------------------------------------------

@dataclass
class StageComparison:
    step: int
    layer: int
    point: str
    stage_baseline: str | None
    stage_target: str | None
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    cosine: float | None = None
    problem: str | None = None  # missing in one run, shape mismatch, data missing
    exceeds: bool = False


@dataclass
class TraceResult:
    baseline: str
    target: str
    prompt: str
    threshold: float
    tokens_baseline: list[int]
    tokens_target: list[int]
    comparisons: list[StageComparison]
    first_divergence: StageComparison | None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def first_token_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.tokens_baseline, self.tokens_target)):
            if a != b:
                return i
        return None


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    d = (a.double() - b.double()).abs()
    fa, fb = a.double().flatten(), b.double().flatten()
    denom = float(fa.norm() * fb.norm())
    cos = float(fa @ fb) / denom if denom > 0 else (1.0 if float(d.max()) == 0 else 0.0)
    return float(d.max()), float(d.mean()), cos


def compare_captures(baseline: TraceRecorder, target: TraceRecorder, threshold: float = 1e-3,
                     baseline_name: str = "baseline", target_name: str = "target", prompt: str = "",
                     rtol: float = 0.0) -> TraceResult:
    """Per (step, layer, point): max / mean abs diff and cosine similarity. Missing fields and shape mismatches
    are reported, not crashed on. The first layer and step whose max abs diff crosses threshold + rtol * (the
    baseline tensor's largest magnitude) is named -- rtol as in numpy's allclose, for activations that reach 1e4
    and more, where one float32 ulp already exceeds an absolute threshold."""
    base = {c.key: c for c in baseline.captures}
    targ = {c.key: c for c in target.captures}

    def counterpart(side: dict, key):
        """A stage transfer into layer L is, in a run without that boundary, the output of layer L-1."""
        if key in side:
            return side[key]
        position, layer, point = key
        return side.get((position, layer - 1, LAYER_OUTPUT)) if point == STAGE_TRANSFER else None

    rows = []
    for key in sorted(set(base) | set(targ), key=lambda k: (k[0], k[1], k[2] != STAGE_TRANSFER)):
        b, t = counterpart(base, key), counterpart(targ, key)
        position, layer, point = key
        row = StageComparison(baseline.step_of(position), layer, point, b and b.stage, t and t.stage)
        limit = threshold
        if b is None or t is None:
            row.problem = f"missing in {'baseline' if b is None else 'target'}"
        elif b.shape != t.shape:
            row.problem = f"shape {b.shape} vs {t.shape}"
        else:
            tb, tt = b.tensor(), t.tensor()
            if tb is None or tt is None:
                row.problem = "summary only (over capture budget)"
                row.max_abs_diff = abs(b.summary["absmax"] - t.summary["absmax"])
            else:
                row.max_abs_diff, row.mean_abs_diff, row.cosine = _diff(tb, tt)
                limit = threshold + rtol * float(tb.abs().max()) if tb.numel() else threshold
        row.exceeds = row.max_abs_diff is not None and (row.max_abs_diff > limit or math.isnan(row.max_abs_diff))
        rows.append(row)
    first = next((r for r in rows if r.exceeds), None)
    return TraceResult(baseline_name, target_name, prompt, threshold, baseline.tokens, target.tokens, rows, first)


# ---- running a traced generation in this process ----------------------------------------------------------------

def trace_local(pipeline, prompt_ids: list[int], steps: int, prefill_chunk: int = SCHEDULER_DEFAULTS.prefill_chunk,
                hook_factory=None, seq_id: str = "trace") -> TraceRecorder:
    """Greedy generation of steps+1 tokens over a LocalPipeline (the one generation driver), capturing every layer
    of every piece at the prefill chunks and each of the `steps` decode steps. hook_factory(piece_index, piece,
    position) may supply the CaptureHook of a piece (tests use it to inject a fault)."""
    from shared.batch.sampling import SamplingParams
    from shared.runtime.generation import generate_tokens

    rec = TraceRecorder(prompt_len=len(prompt_ids))

    def hooks_for(step) -> list[CaptureHook]:
        position = step.start_position
        if hook_factory is not None:
            return [hook_factory(i, piece, position) for i, piece in enumerate(pipeline.pieces)]
        return [CaptureHook.for_piece(p.model.layers, p.model.position, position) for p in pipeline.pieces]

    def on_step(step, hooks, token) -> None:
        rec.captures.extend(c for h in hooks for c in h.captures)

    rec.tokens = list(generate_tokens(pipeline, prompt_ids, SamplingParams(), steps + 1, prefill_chunk=prefill_chunk,
                                      seq_id=seq_id, hooks_for=hooks_for, on_step=on_step))
    return rec
