"""Single-process generation and perplexity over a LocalPipeline (one piece, or several via --split)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.errors import StagemeshError
from shared.runtime import LocalPipeline, SeqWork
from shared.sampling import SamplingParams, sample
from shared.steps import Decode, Prefill, chunk_prompt

DEFAULT_PREFILL_CHUNK = 256


@dataclass
class GenerationTimings:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    per_token_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        decode_s = sum(self.per_token_s)
        decode_tps = len(self.per_token_s) / decode_s if decode_s > 0 else None
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_s": round(self.prefill_s, 4), "time_to_first_token_s": round(self.prefill_s, 4),
                "decode_s": round(decode_s, 4), "decode_tokens_per_s": decode_tps and round(decode_tps, 2)}


def generate_tokens(pipeline: LocalPipeline, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                    stop_ids: frozenset[int] = frozenset(), prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                    timings: GenerationTimings | None = None, seq_id: str = "local-0") -> Iterator[int]:
    """Yield generated token ids; a stop id is yielded last (the caller decides whether to show it)."""
    if not prompt_ids:
        raise StagemeshError("the prompt is empty; give at least one token")
    if len(prompt_ids) + max_tokens > pipeline.max_seq_len:
        raise StagemeshError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"of {pipeline.max_seq_len} tokens; shorten the prompt or lower --max-tokens")
    params = params.with_seed()
    timings = timings or GenerationTimings()
    timings.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    try:
        logits = None
        for chunk in chunk_prompt(len(prompt_ids), prefill_chunk):
            ids = torch.tensor(prompt_ids[chunk.chunk_start_position:chunk.chunk_start_position + chunk.chunk_tokens])
            logits = pipeline.run([SeqWork(seq_id, chunk)], ids)
        position = len(prompt_ids)
        t_prev = t0
        for i in range(max_tokens):
            token = sample(logits, [params], [position])[0][0]
            now = time.perf_counter()
            if i == 0:
                timings.prefill_s = now - t0
            else:
                timings.per_token_s.append(now - t_prev)
            t_prev = now
            timings.generated_tokens += 1
            yield token
            if token in stop_ids or i == max_tokens - 1:
                break
            logits = pipeline.run([SeqWork(seq_id, Decode(position))], torch.tensor([token]))
            position += 1
    finally:
        pipeline.release(seq_id)


@dataclass
class PerplexityResult:
    perplexity: float
    nll_mean: float
    scored_tokens: int
    windows: int


def window_logits(pipeline: LocalPipeline, window: list[int], seq_id: str = "window") -> torch.Tensor:
    """logits [T, V] float32 for every position of one window, from a fresh KV slot."""
    try:
        return pipeline.run([SeqWork(seq_id, Prefill(len(window), 0, len(window), True))], torch.tensor(window),
                            all_logits=True)
    finally:
        pipeline.release(seq_id)


def token_nlls(pipeline: LocalPipeline, window: list[int]) -> torch.Tensor:
    """Teacher-forced: NLL [T-1] of tokens 1..T-1 of the window given the earlier ones of that window."""
    logp = torch.log_softmax(window_logits(pipeline, window)[:-1].double(), dim=-1)
    return -logp.gather(1, torch.tensor(window[1:])[:, None])[:, 0]


def split_windows(ids: list[int], context: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly `context` tokens (a shorter tail is dropped, as llama.cpp does)."""
    if context < 2:
        raise StagemeshError("--context must be at least 2 tokens")
    windows = [ids[i:i + context] for i in range(0, len(ids) - context + 1, context)]
    if not windows:
        raise StagemeshError(f"the text has {len(ids)} tokens, fewer than one window of {context}; lower --context")
    return windows


def perplexity(pipeline: LocalPipeline, ids: list[int], context: int, progress=None) -> PerplexityResult:
    if context > pipeline.max_seq_len:
        raise StagemeshError(f"--context {context} exceeds the runtime's max_seq_len {pipeline.max_seq_len}")
    windows = split_windows(ids, context)
    total, count = 0.0, 0
    for w in windows:
        nll = token_nlls(pipeline, w)
        total += float(nll.sum())
        count += nll.numel()
        if progress:
            progress()
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(windows))
