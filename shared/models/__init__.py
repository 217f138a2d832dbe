"""Stateless model implementations. An architecture is a config (traits table) plus this one module."""

from shared.models.config import ARCHITECTURES, ModelConfig
from shared.models.transformer import LayerHook, TransformerModel

__all__ = ["ARCHITECTURES", "LayerHook", "ModelConfig", "TransformerModel"]
