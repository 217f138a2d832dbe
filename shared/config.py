"""ServingConfig: the serving defaults, written once. The CLI (`stage`, `gateway`, `up`), the gateway's scheduler,
local generation and `trace` all read them from here."""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared.errors import StagemeshError


@dataclass(frozen=True)
class ServingConfig:
    prefill_chunk: int = 128  # prompt tokens per prefill chunk: a long prompt delays running decodes by one chunk
    token_budget: int = 512  # tokens per micro-batch (decodes count 1 each)
    max_queue: int = 256  # requests waiting for admission before the gateway answers 429
    kv_slots: int = 32  # concurrent sequences per stage
    max_seq_len: int = 2048  # tokens per sequence (capped by the model's context)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + f.name.replace("_", "-")
                raise StagemeshError(f"{flag} must be a positive integer, got {value!r}")


SERVING_DEFAULTS = ServingConfig()
