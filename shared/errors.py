"""Typed errors, raised once at the edge where they can be explained. Every message says how to fix it."""


class StagemeshError(Exception):
    """Base class: a user-facing, one-line explanation of what went wrong and how to fix it. `code` is the
    machine-readable kind that travels with a stage's BatchError (ERROR_CODES lists them all)."""

    code = "stage_error"


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


class DoesNotFit(StagemeshError):
    """A piece's weights need more memory than this process can have (the host's, or its cgroup's limit)."""


class KVCacheFull(StagemeshError):
    code = "kv_full"


class UnknownSequence(StagemeshError):
    """A stage was asked to continue a sequence it holds no KV for (it restarted, or the sequence never began)."""

    code = "unknown_sequence"


class PrefixMiss(StagemeshError):
    """A stage was asked to start a sequence from a cached prefix it no longer keeps (evicted for room, or the stage
    restarted): the gateway drops that prefix from its index and prefills the sequence in full."""

    code = "prefix_miss"


class MissingActivation(StagemeshError):
    """A middle or last stage got a micro-batch without its input activation (never falls back to embeddings)."""

    code = "bad_input"


class CapabilityMissing(StagemeshError):
    """An optional capability was asked of a piece that does not have it (e.g. embed() on a middle stage)."""


class BadBatch(StagemeshError):
    """A micro-batch that does not fit this stage (wrong token count, activation shape, position past the cache)."""

    code = "bad_input"


# Every code a stage may put in a BatchError; "internal" is an unexpected failure inside the stage.
ERROR_CODES = frozenset({StagemeshError.code, KVCacheFull.code, UnknownSequence.code, BadBatch.code, PrefixMiss.code,
                         "internal"})
