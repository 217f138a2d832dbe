"""Stateless model implementations. An architecture is a config (traits table) plus this one module.

ModelConfig, TransformerModel, LayerHook and ARCHITECTURES are imported on first use, so importing a light module of
this package (memory, device) does not load the model's code."""

import importlib

_EXPORTS = {"ARCHITECTURES": "shared.models.config", "ModelConfig": "shared.models.config",
            "LayerHook": "shared.models.transformer", "TransformerModel": "shared.models.transformer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shared.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
