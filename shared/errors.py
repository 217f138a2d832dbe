"""Typed errors, raised once at the edge where they can be explained. Every message says how to fix it."""


class StagemeshError(Exception):
    """Base class: a user-facing, one-line explanation of what went wrong and how to fix it."""


class GgufError(StagemeshError):
    """The GGUF file is missing, corrupt, truncated, or uses something we do not support."""


class UnsupportedArchitecture(GgufError):
    pass


class UnsupportedTensorType(GgufError):
    pass


class ModelNotFound(StagemeshError):
    pass


class LayerRangeError(StagemeshError):
    """A layer range or split that does not describe a valid piece of the model."""


class ChatTemplateError(StagemeshError):
    """The chat template failed, was refused by the sandbox, or exceeded its caps."""


class KVCacheFull(StagemeshError):
    pass


class MissingActivation(StagemeshError):
    """A middle or last stage got a micro-batch without its input activation (never falls back to embeddings)."""


class CapabilityMissing(StagemeshError):
    """An optional capability was asked of a piece that does not have it (e.g. embed() on a middle stage)."""
