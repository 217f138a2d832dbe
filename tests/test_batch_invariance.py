"""batch_invariant=True: a sequence's logits are bit-identical whether it runs alone or inside micro-batches of other
sequences (other lengths, other KV slots, more tokens than auto's int4/bf16 crossover)."""

import pytest
import torch

from shared.batch.steps import Decode, Prefill
from shared.models.linear import INT4_MAX_TOKENS
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import SeqEntry

DECODE_STEPS = 4
NEIGHBOURS = 13  # > INT4_MAX_TOKENS decodes in one micro-batch: the default auto mode would switch kernels here


@pytest.fixture(scope="module")
def texts(smollm2, varied_text):
    ids = smollm2.tokenizer.encode(varied_text)
    target = ids[:24 + DECODE_STEPS]
    others = [ids[40 + 37 * i: 40 + 37 * i + 5 + 3 * i + DECODE_STEPS] for i in range(NEIGHBOURS)]  # 5..41 tokens
    return target, others


@pytest.fixture(scope="module")
def pipelines(smollm2):
    """(dtype, weights) -> one batch-invariant whole-model pipeline with a slot for the target and each neighbour,
    loaded once for the module's tests (each releases the sequences it made)."""
    loaded = {}

    def get(dtype: torch.dtype, weights: str) -> LocalPipeline:
        if (dtype, weights) not in loaded:
            loaded[dtype, weights] = LocalPipeline.load(smollm2.loader, None, dtype, kv_slots=NEIGHBOURS + 2,
                                                        weights=weights, batch_invariant=True)
        return loaded[dtype, weights]

    return get


def _prompt_and_continuation(ids):
    return ids[:-DECODE_STEPS], ids[-DECODE_STEPS:]


def _alone(pipeline: LocalPipeline, ids: list[int]) -> list[torch.Tensor]:
    """The target's logits rows: its prefill's last row, then one per decode step, run with nothing else."""
    prompt, cont = _prompt_and_continuation(ids)
    rows = [pipeline.run([SeqEntry("t", Prefill(len(prompt), 0, len(prompt), True))], torch.tensor(prompt))[0]]
    for k, tok in enumerate(cont[:-1]):
        rows.append(pipeline.run([SeqEntry("t", Decode(len(prompt) + k))], torch.tensor([tok]))[0])
    pipeline.release("t")
    return rows


def _in_company(pipeline: LocalPipeline, ids: list[int], others: list[list[int]]) -> tuple[list[torch.Tensor], int]:
    """The same rows with the target sharing every micro-batch: its prefill packed between other sequences'
    prefills, each decode step in the middle of the others' decode steps. Returns rows and the smallest batch."""
    prompt, cont = _prompt_and_continuation(ids)
    work, tokens = [], []
    for i, o in enumerate(others):  # neighbours first: the target gets another KV slot than when alone
        p, _ = _prompt_and_continuation(o)
        work.append(SeqEntry(f"o{i}", Prefill(len(p), 0, len(p), True)))
        tokens += p
        if i == len(others) // 2:
            work.append(SeqEntry("t", Prefill(len(prompt), 0, len(prompt), True)))
            tokens += prompt
    out = pipeline.run(work, torch.tensor(tokens))
    target_row = [w.seq_id for w in work].index("t")
    rows, smallest = [out[target_row]], len(tokens)
    for k in range(DECODE_STEPS - 1):
        # a different company each step: the neighbours rotate and some sit out
        order = others[k:] + others[:k]
        names = [f"o{(i + k) % len(others)}" for i in range(len(order))][: len(order) - k]
        step_work, step_tokens = [], []
        for j, name in enumerate(names):
            o = others[int(name[1:])]
            p, c = _prompt_and_continuation(o)
            step_work.append(SeqEntry(name, Decode(len(p) + k)))
            step_tokens.append(c[k])
            if j == 2:
                step_work.append(SeqEntry("t", Decode(len(prompt) + k)))
                step_tokens.append(cont[k])
        out = pipeline.run(step_work, torch.tensor(step_tokens))
        rows.append(out[[w.seq_id for w in step_work].index("t")])
        smallest = min(smallest, len(step_work))
        # neighbours that sat out this step catch up alone, so every sequence keeps a consistent history
        for name in {f"o{i}" for i in range(len(others))} - set(names):
            o = others[int(name[1:])]
            p, c = _prompt_and_continuation(o)
            pipeline.run([SeqEntry(name, Decode(len(p) + k))], torch.tensor([c[k]]))
    for w in work:
        pipeline.release(w.seq_id)
    return rows, smallest


# auto's bfloat16 case takes about a minute of both cores, f32's a few seconds: slow (make test runs them; the unit
# tier keeps bf16's)
@pytest.mark.parametrize("dtype,weights", [pytest.param(torch.bfloat16, "auto", marks=pytest.mark.slow),
                                           (torch.bfloat16, "bf16"),
                                           pytest.param(torch.float32, "f32", marks=pytest.mark.slow)])
def test_a_sequence_computes_the_same_bits_alone_and_in_a_batch(pipelines, texts, dtype, weights):
    target, others = texts
    pipeline = pipelines(dtype, weights)
    alone = _alone(pipeline, target)
    together, smallest = _in_company(pipeline, target, others)
    assert smallest >= INT4_MAX_TOKENS  # every shared micro-batch is past auto's kernel crossover
    assert len(alone) == len(together) == DECODE_STEPS
    for step, (a, t) in enumerate(zip(alone, together)):
        assert torch.equal(a, t), f"step {step}: max |diff| {(a - t).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype,weights", [(torch.bfloat16, "auto"), (torch.bfloat16, "bf16")])
def test_prefill_in_one_pass_in_chunks_or_token_by_token_gives_the_same_bits(pipelines, texts, dtype, weights):
    """What a failover replay relies on: a history re-prefilled in one pass (or in chunks) leaves the same K/V and
    the same next-token logits as the token-by-token decode that first produced it. Without batch_invariant the
    prefill's attention runs as one causal kernel over the chunk and the bf16 logits differ."""
    ids = texts[0]
    pipeline = pipelines(dtype, weights)
    one_pass = pipeline.run([SeqEntry("a", Prefill(len(ids), 0, len(ids), True))], torch.tensor(ids))[0]
    split = 10
    pipeline.run([SeqEntry("b", Prefill(split, 0, len(ids), False))], torch.tensor(ids[:split]))
    chunked = pipeline.run([SeqEntry("b", Prefill(len(ids) - split, split, len(ids), True))], torch.tensor(ids[split:]))[0]
    pipeline.run([SeqEntry("c", Prefill(split, 0, split, True))], torch.tensor(ids[:split]))
    for k in range(split, len(ids)):
        stepped = pipeline.run([SeqEntry("c", Decode(k))], torch.tensor([ids[k]]))[0]
    for seq in "abc":
        pipeline.release(seq)
    assert torch.equal(one_pass, chunked), f"max |diff| {(one_pass - chunked).abs().max().item():.3g}"
    assert torch.equal(one_pass, stepped), f"max |diff| {(one_pass - stepped).abs().max().item():.3g}"
