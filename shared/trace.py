"""Capturing intermediate activations (LayerHook implementation) for tracing divergence layer by layer."""

from __future__ import annotations

import torch

DEFAULT_CAPTURE_BUDGET = 8 << 20  # bytes of raw tensors one stage may return per micro-batch


def summarize(t: torch.Tensor) -> dict:
    t = t.detach().float()
    return {"shape": list(t.shape), "mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "absmax": float(t.abs().max()), "l2": float(t.norm())}


class CaptureHook:
    """LayerHook that records each layer's output for the sequences being traced.

    rows: which packed rows belong to the traced sequence (captures stay per request, not per batch).
    Full float32 tensors are kept while within budget; beyond it only summaries."""

    def __init__(self, rows: slice | None = None, budget: int = DEFAULT_CAPTURE_BUDGET, stage: str = ""):
        self.rows = rows
        self.budget = budget
        self.stage = stage
        self.captures: list[dict] = []

    def on_layer_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def on_layer_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden[self.rows] if self.rows is not None else hidden
        entry = {"stage": self.stage, "layer": layer, "point": "layer_output", **summarize(x)}
        data = x.detach().float().contiguous()
        if data.nbytes <= self.budget:
            self.budget -= data.nbytes
            entry["data"] = data.numpy().tobytes()
        self.captures.append(entry)
        return hidden
