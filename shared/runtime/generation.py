"""The generation driver, written once: a sequence's progress (SequenceState), the prefill-then-decode loop
(drive), and the single-process front ends over a LocalPipeline (generate_tokens, perplexity).

drive() does no I/O ("sans-IO"): it yields each micro-batch to run and is sent back what was sampled, so the
same loop serves a LocalPipeline in this process (generate_tokens, trace) and a mesh over ZeroMQ
(run_group_on_mesh, used by tests and benchmarks). The gateway's scheduler batches many sequences its own way
but steps each one through the same SequenceState."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.batch.sampling import LogitInputs, SamplingParams, TopLogprobs, one_position_a_step, sample
from shared.batch.steps import MAX_DECODE_TOKENS, Decode, InferenceStep, Prefill
from shared.config import SCHEDULER_DEFAULTS
from shared.errors import StagemeshError
from shared.models import LayerHook
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import BatchResult, Sample, SeqEntry, sampling_rows

if TYPE_CHECKING:  # llguidance is imported only where grammars are compiled (the gateway), never by a stage
    from shared.text.grammar import SequenceGrammar

# seq_id -> the (token, logprob, top alternatives) its step sampled, in position order, for the sequences that sampled
Sampled = dict[str, list[Sample]]


@dataclass(eq=False)  # a sequence is itself, never equal to another with the same tokens
class SequenceState:
    """One sequence's progress, one invariant instead of two modes (vLLM's): `computed` tokens of
    `all_ids = prompt + output` have their KV in the pipeline; each step feeds the next slice -- a prefill chunk
    while computed < prefill_target, else the one newest token (a decode), followed by the tokens in `draft` when a
    drafter proposed some. take() accepts what a step sampled: a drafted token stands only where it equals what the
    pipeline sampled at its position, so the tokens are exactly those of one-token steps (each position's draw is
    seeded by its position), and the K/V of positions after a rejected draft no longer count (the next step writes
    over them)."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    max_tokens: int = 1 << 30
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)  # one per output token, as logprobs
    computed: int = 0
    prefill_target: int = 0  # tokens to prefill before decoding: the prompt, or prompt + output when replaying
    finish_reason: str | None = None
    attach: str | None = None  # a cached prefix holding positions [0, computed) that its first chunk starts from
    grammar: SequenceGrammar | None = None  # constrains what it samples (response_format, a forced tool call)
    draft: list[int] = field(default_factory=list)  # tokens proposed to follow the newest one, for its next decode
    verifying: tuple[int, ...] = ()  # the drafted tokens of its step in flight (set by next_step, read by take)
    drafts_accepted: int = 0  # drafted tokens that stood (each one a position that pass computed for free) ...
    drafts_rejected: int = 0  # ... and those that did not

    def __post_init__(self):
        self.prefill_target = self.prefill_target or len(self.prompt_ids)
        self._generated = Counter(self.output_ids)  # token -> times generated (the penalties' history)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_target

    def next_step(self, max_tokens: int) -> tuple[SeqEntry, list[int]]:
        """This sequence's next slice of work (at most max_tokens tokens) and the token ids it feeds."""
        if self.prefilling:
            n = min(max_tokens, self.prefill_target - self.computed)
            step: InferenceStep = Prefill(n, self.computed, self.prefill_target, self.computed + n == self.prefill_target,
                                          self.attach)
            inputs = self.logit_inputs() if step.produces_token else None
            return SeqEntry(self.seq_id, step, self.params, logit_inputs=inputs), \
                self.all_ids[self.computed:self.computed + n]
        inputs = self.logit_inputs()
        # drafts go only where the step carries no logit inputs (one_position_a_step), and within max_tokens
        room = min(max_tokens, self.max_tokens - len(self.output_ids)) - 1
        alone = one_position_a_step(self.params, self.grammar is not None)
        self.verifying = tuple(self.draft[:max(0, min(room, MAX_DECODE_TOKENS - 1))]) if not alone else ()
        self.draft = []
        return SeqEntry(self.seq_id, Decode(self.computed, 1 + len(self.verifying)), self.params,
                        logit_inputs=inputs), [self.output_ids[-1], *self.verifying]

    def logit_inputs(self) -> LogitInputs | None:
        """What its history adds to its next sample: the grammar's allowed tokens, the penalties' token counts
        (generated tokens; with a repetition penalty also the prompt's, at count 0 when only there)."""
        seen: tuple[tuple[int, int], ...] = ()
        if self.params.penalized:
            counts = dict.fromkeys(self.prompt_ids, 0) if self.params.repetition_penalty != 1.0 else {}
            counts.update(self._generated)
            seen = tuple(sorted(counts.items()))
        allowed = self.grammar.allowed() if self.grammar is not None else None
        return LogitInputs(allowed, seen) if allowed is not None or seen else None

    def advance(self, fed: int) -> None:
        """The pipeline now holds the KV of `fed` more tokens."""
        self.computed += fed
        self.attach = None  # the first chunk attached the prefix: its slot holds those positions now

    def start_from(self, prefix_id: str | None, tokens: int) -> None:
        """Begin (again) from nothing, or from a cached prefix holding the K/V of the first `tokens` prompt tokens."""
        self.computed = tokens if prefix_id is not None else 0
        self.attach = prefix_id

    def append(self, token: int, logprob: float | None = None, top: TopLogprobs | None = None) -> str | None:
        """Record a sampled token; returns the finish reason it causes ("stop" for a stop id, "length"), if any."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        self._generated[token] += 1
        if self.grammar is not None and not self.grammar.consume(token) and token not in self.stop_ids:
            return "error"  # the grammar refused what was sampled under its own mask: grammar.error says why
        if token in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.max_tokens:
            return "length"
        return None

    def take(self, fed: int, samples: list[Sample] | None) -> list[tuple[Sample, str | None]]:
        """The pipeline holds the K/V of the `fed` tokens of this sequence's last step and sampled `samples` (None:
        a prefill chunk that samples nothing). Returns each accepted sample with the finish reason it causes (the
        last one may end the sequence). Sample i > 0 of a decode stands only if every drafted token before it equals
        the sample before it; the K/V kept is that of the accepted positions."""
        drafted, self.verifying = self.verifying, ()
        accepted = (samples or [])[:1]
        for i in range(1, min(len(samples or ()), 1 + len(drafted))):
            if drafted[i - 1] != samples[i - 1][0]:
                break  # position i was fed a draft other than what position i - 1 sampled: nothing after it stands
            accepted.append(samples[i])
        self.advance(len(accepted) if drafted else fed)
        taken = []
        for one in accepted:
            reason = self.append(*one)
            taken.append((one, reason))
            if reason is not None:
                break
        if drafted:
            stood = min(len(taken) - 1, len(drafted))
            self.drafts_accepted += stood
            self.drafts_rejected += len(drafted) - stood
        return taken

    def reset_for_replay(self) -> None:
        """The pipeline lost this sequence's KV: prefill everything it has (prompt + output so far) again; the
        final chunk samples the next token at the same position a decode would have (same seed, same draw)."""
        self.computed = 0
        self.attach = None
        self.prefill_target = len(self.all_ids)
        self.verifying, self.draft = (), []  # a draft in flight died with that step: the replay prefills instead


Propose = Callable[[SequenceState], Sequence[int]]  # a drafter: tokens that may follow a sequence's newest one


def drive(states: Sequence[SequenceState], prefill_chunk: int = SCHEDULER_DEFAULTS.prefill_chunk,
          propose: Propose | None = None) -> Generator[tuple[list[SeqEntry], list[int]], Sampled, None]:
    """The prefill-then-decode loop: yields (entries, token ids) of one micro-batch holding every live sequence's
    next step, and is sent back what that micro-batch sampled. Ends when every sequence has finished. `propose`:
    drafts for each decoding sequence's next step (verified in that step; SequenceState.take)."""
    live = [s for s in states if not s.done]
    while live:
        work = [s.next_step(prefill_chunk) for s in live]
        sampled = yield [e for e, _ in work], [t for _, toks in work for t in toks]
        for s, (_, toks) in zip(live, work):
            for _, reason in s.take(len(toks), sampled.get(s.seq_id)):
                s.finish_reason = reason
        live = [s for s in live if not s.done]
        if propose is not None:
            for s in live:
                if not s.prefilling:
                    s.draft = list(propose(s))


def run_local(pipeline: LocalPipeline, entries: list[SeqEntry], tokens: list[int],
              hooks: Sequence[LayerHook | None] | None = None) -> Sampled:
    """One micro-batch through every piece in this process, sampled as the last stage does."""
    logits = pipeline.run(entries, torch.tensor(tokens, dtype=torch.int64),
                          hooks=hooks)
    producing, counts, params, positions, inputs = sampling_rows(entries)
    sampled = sample(logits, params, positions, inputs)
    return BatchResult(0, [e.seq_id for e in producing], sampled.tokens, sampled.logprobs, top=sampled.top,
                       counts=counts).by_sequence()


async def run_group_on_mesh(client, states: Sequence[SequenceState],
                            prefill_chunk: int = SCHEDULER_DEFAULTS.prefill_chunk,
                            before_step: Callable[[int], Awaitable[None]] | None = None,
                            propose: Propose | None = None) -> int:
    """drive() over a running mesh (a shared.wire.pipeline_client.PipelineClient): every sequence of the group shares
    each micro-batch. before_step(i) is awaited before micro-batch i (0 = the first prefill). Releases the group's
    KV slots at the end. Returns the micro-batches it ran."""
    from shared.wire.protocol import ForwardBatch

    loop = drive(states, prefill_chunk, propose)
    passes = 0
    try:
        entries, tokens = next(loop)
        for i in itertools.count():
            if before_step is not None:
                await before_step(i)
            # in_flight counts this one: alone in the pipeline, a stage sharing its host computes with every core
            result = await client.forward(ForwardBatch(client.next_mb_id(), entries,
                                                       tokens=torch.tensor(tokens, dtype=torch.int64),
                                                       in_flight=client.in_flight + 1))
            passes += 1
            entries, tokens = loop.send(result.by_sequence())
    except StopIteration:
        pass
    finally:
        await client.release([s.seq_id for s in states])
    return passes


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


StepHooks = Callable[[InferenceStep], Sequence[LayerHook | None]]  # the LayerHooks (one per piece) of one step
StepDone = Callable[[InferenceStep, Sequence[LayerHook | None], int | None], None]  # after each step: its token


def generate_tokens(pipeline: LocalPipeline, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                    stop_ids: frozenset[int] = frozenset(), prefill_chunk: int = SCHEDULER_DEFAULTS.prefill_chunk,
                    timings: GenerationTimings | None = None, seq_id: str = "local-0",
                    hooks_for: StepHooks | None = None, on_step: StepDone | None = None) -> Iterator[int]:
    """Yield generated token ids; a stop id is yielded last (the caller decides whether to show it).
    hooks_for / on_step let tracing observe every step's layers."""
    if not prompt_ids:
        raise StagemeshError("the prompt is empty; give at least one token")
    if len(prompt_ids) + max_tokens > pipeline.max_seq_len:
        raise StagemeshError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"of {pipeline.max_seq_len} tokens; shorten the prompt or lower --max-tokens")
    state = SequenceState(seq_id, prompt_ids, params.with_seed(), max_tokens, stop_ids)
    timings = timings or GenerationTimings()
    timings.prompt_tokens = len(prompt_ids)
    t0 = t_prev = time.perf_counter()
    loop = drive([state], prefill_chunk)
    entries, tokens = next(loop)
    try:
        while True:
            step = entries[0].step
            hooks = hooks_for(step) if hooks_for else None
            sampled = run_local(pipeline, entries, tokens, hooks)
            token = sampled[seq_id][0][0] if seq_id in sampled else None
            if on_step:
                on_step(step, hooks, token)
            if token is not None:
                now = time.perf_counter()
                if timings.generated_tokens == 0:
                    timings.prefill_s = now - t0
                else:
                    timings.per_token_s.append(now - t_prev)
                t_prev = now
                timings.generated_tokens += 1
            try:
                entries, tokens = loop.send(sampled)  # records the token; ends when the sequence is done
            except StopIteration:
                entries = None
            if token is not None:
                yield token
            if entries is None:
                return
    finally:
        pipeline.release(seq_id)


@dataclass
class PerplexityResult:
    perplexity: float
    nll_mean: float
    scored_tokens: int
    chunks: int
    running: list[float]  # exp(mean NLL so far) after each chunk, as llama-perplexity prints it


def window_logits(pipeline: LocalPipeline, window: list[int], seq_id: str = "window") -> torch.Tensor:
    """logits [T, V] float32 for every position of one window, from a fresh KV slot."""
    try:
        return pipeline.run([SeqEntry(seq_id, Prefill(len(window), 0, len(window), True))], torch.tensor(window),
                            all_logits=True)
    finally:
        pipeline.release(seq_id)


def token_nlls(pipeline: LocalPipeline, window: list[int], first: int = 0) -> torch.Tensor:
    """Teacher-forced: NLL [T-1-first] of tokens first+1..T-1 of the window given the earlier ones of that window."""
    logp = torch.log_softmax(window_logits(pipeline, window)[first:-1].double(), dim=-1)
    return -logp.gather(1, torch.tensor(window[first + 1:])[:, None])[:, 0]


def split_windows(ids: list[int], context: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly `context` tokens (a shorter tail is dropped, as llama.cpp does)."""
    if context < 2:
        raise StagemeshError("--context must be at least 2 tokens")
    windows = [ids[i:i + context] for i in range(0, len(ids) - context + 1, context)]
    if not windows:
        raise StagemeshError(f"the text has {len(ids)} tokens, fewer than one window of {context}; lower --context")
    return windows


def perplexity_chunks(ids: list[int], context: int, bos_id: int | None) -> list[list[int]]:
    """llama.cpp's llama-perplexity chunks (tools/perplexity/perplexity.cpp, `perplexity`, non-strided; read at
    ggml-org/llama.cpp 050fc7f32de16858ac667d775b43a51ed8976e6f), so that our figure and its figure agree: `ids` is
    the whole text tokenized once (BOS first if the model asks for it); chunk i is ids[i*context, (i+1)*context), the
    tail dropped, and for a model that asks for BOS (bos_id given) each chunk's first token is replaced by BOS (not
    inserted): every chunk then starts as the model saw text start in training (without it Gemma 3 reads far higher
    on the same chunks: tests/test_perplexity.py). At least 2 x context tokens are needed, as llama-perplexity
    requires."""
    if len(ids) < 2 * context:
        raise StagemeshError(f"the text has {len(ids)} tokens; perplexity over chunks of --context {context} needs at "
                             f"least 2 x {context} = {2 * context} (as llama-perplexity); lower --context to at most "
                             f"{len(ids) // 2} or give a longer text")
    chunks = split_windows(ids, context)
    if bos_id is not None:
        chunks = [[bos_id, *c[1:]] for c in chunks]
    return chunks


def perplexity(pipeline: LocalPipeline, ids: list[int], context: int, bos_id: int | None,
               progress=None) -> PerplexityResult:
    """llama-perplexity's estimate over perplexity_chunks(ids, context, bos_id): in each chunk only the second half
    is scored (tokens context//2+1 .. context-1, each given every earlier token of its chunk, so each has at least
    half a context before it); perplexity = exp(mean NLL over all scored tokens)."""
    if context > pipeline.max_seq_len:
        raise StagemeshError(f"--context {context} exceeds the runtime's max_seq_len {pipeline.max_seq_len}")
    chunks = perplexity_chunks(ids, context, bos_id)
    total, count, running = 0.0, 0, []
    for chunk in chunks:
        nll = token_nlls(pipeline, chunk, first=context // 2)
        total += float(nll.sum())
        count += nll.numel()
        running.append(math.exp(total / count))
        if progress:
            progress()
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(chunks), running)
