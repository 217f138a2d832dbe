"""Numerical parity with llama.cpp on SmolLM2, split invariance, and what a stage holds in memory."""

import math
import threading
import time
import types

import numpy as np
import pytest
import torch

from services.testing.tiny_gguf import llama_cpp_logits
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange, split_at
from shared.models import TransformerModel
from shared.models.device import resolve_dtype
from shared.runtime.generation import split_windows, window_logits
from shared.runtime.stage_runtime import LocalPipeline
from tests.conftest import uses_llama_cpp

pytestmark = pytest.mark.slow  # minutes of llama.cpp comparisons: not in the fast tier

CONTEXT = 256
SERVING_DTYPE = resolve_dtype(None)  # the activation dtype a stage serves with here: bf16 where the CPU has it, else f32


@pytest.fixture(scope="module")
def windows(smollm2, varied_text):
    ids = smollm2.tokenizer.encode(varied_text)
    wins = split_windows(ids, CONTEXT)
    assert sum(len(w) - 1 for w in wins) >= 1000  # >= 1,000 teacher-forced tokens
    return wins


@pytest.fixture(scope="module")
def reference_logits(llama_ref, windows):
    return [torch.from_numpy(llama_cpp_logits(llama_ref, w)) for w in windows]


@pytest.mark.parametrize("dtype,weights,min_top1,max_kl,max_ppl_rel", [
    (torch.float32, "f32", 0.95, 0.01, 0.015),
    (torch.bfloat16, "auto", 0.945, 0.01, 0.015),  # the default: these windows take auto's prefill kernel
    (torch.float32, "auto", 0.95, 0.01, 0.015),  # the default on CPUs without native bf16 (int4 | prepacked f32)
    (torch.bfloat16, "lean", 0.945, 0.01, 0.015),  # auto's decode kernel (int4 from the GGUF's Q4_1) at every size
    (torch.bfloat16, "bf16", 0.94, 0.02, 0.02),
])
def test_teacher_forced_parity_with_llama_cpp(smollm2, windows, reference_logits, dtype, weights, min_top1, max_kl,
                                              max_ppl_rel):
    """bf16 with the file's blocks: where the integer-dot kernels run (an AVX512-BF16 CPU that measured them faster),
    bf16 activations are rounded to 8 bits per block again; top-1 agreement measured 0.9486 there (KL 0.0047, perplexity
    -0.11 %), 0.95 or more on the int4 kernel."""
    pipeline = LocalPipeline.load(smollm2.loader, None, dtype, kv_slots=1, weights=weights)
    kls, agree, nll_ours, nll_ref = [], [], [], []
    for w, ref in zip(windows, reference_logits):
        ours = window_logits(pipeline, w).double()
        lr, lo = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
        kls.append((lr.exp() * (lr - lo)).sum(-1))  # KL(llama.cpp || ours) per position
        agree.append(ref.argmax(-1) == ours.argmax(-1))
        target = torch.tensor(w[1:])[:, None]
        nll_ours.append(-lo[:-1].gather(1, target))
        nll_ref.append(-lr[:-1].gather(1, target))
    kl = float(torch.cat(kls).mean())
    top1 = float(torch.cat(agree).double().mean())
    ppl_ours, ppl_ref = math.exp(torch.cat(nll_ours).mean()), math.exp(torch.cat(nll_ref).mean())
    print(f"\n{dtype} weights {weights}: top1 {top1:.4f} KL {kl:.5f} ppl ours {ppl_ours:.4f} llama.cpp {ppl_ref:.4f}")
    assert top1 >= min_top1
    assert kl <= max_kl
    assert abs(ppl_ours / ppl_ref - 1) <= max_ppl_rel


@pytest.fixture(scope="module")
def unsplit_logits(smollm2, windows):
    pipeline = LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=1)
    return window_logits(pipeline, windows[0])


@pytest.mark.parametrize("points", [[15], [7, 19], [1, 2, 29]])
def test_split_gives_exactly_the_unsplit_logits(smollm2, windows, unsplit_logits, points):
    ranges = split_at(30, points)
    pipeline = LocalPipeline.load(smollm2.loader, ranges, torch.float32, kv_slots=1)
    assert [p.model.position.value for p in pipeline.pieces][0] == "first"
    assert len(pipeline.pieces) == len(points) + 1
    split_logits = window_logits(pipeline, windows[0])
    assert torch.equal(split_logits, unsplit_logits)


def test_middle_stage_holds_a_third_of_the_weights(smollm2):
    """Measured as the bytes of every tensor the piece holds (TransformerModel.weight_bytes)."""
    full = TransformerModel.from_gguf(smollm2.loader, None, torch.float32)
    middle = TransformerModel.from_gguf(smollm2.loader, LayerRange(10, 20), torch.float32)
    ratio = middle.weight_bytes() / full.weight_bytes()
    print(f"\nmiddle 10:20 holds {middle.weight_bytes() / 2**20:.1f} MiB of {full.weight_bytes() / 2**20:.1f} MiB = {ratio:.3f}")
    assert ratio <= 0.30
    assert middle.embedding is None and middle.output is None
    assert len(middle.blocks) == 10


def test_chunked_prefill_and_batched_decode_match_one_pass(smollm2, windows):
    """Prefill in chunks, then decode sequences of different lengths together: the logits equal a single pass."""
    from shared.batch.steps import Decode, chunk_prompt
    from shared.wire.protocol import SeqEntry

    pipeline = LocalPipeline.load(smollm2.loader, [LayerRange(0, 12), LayerRange(12, 30)], torch.float32, kv_slots=3)
    full = {n: window_logits(pipeline, windows[1][:n]) for n in (40, 70, 100)}
    for n in (40, 70):  # prompts of n-1 tokens, prefilled in chunks of 16
        chunks = chunk_prompt(n - 1, 16)
        for c in chunks:
            seg = windows[1][c.chunk_start_position:c.chunk_start_position + c.chunk_tokens]
            last = pipeline.run([SeqEntry(f"s{n}", c)], torch.tensor(seg))
        np.testing.assert_allclose(last[0].numpy(), full[n][n - 2].numpy(), rtol=0, atol=1e-3)
    batch = [SeqEntry("s40", Decode(39)), SeqEntry("s70", Decode(69))]
    out = pipeline.run(batch, torch.tensor([windows[1][39], windows[1][69]]))
    np.testing.assert_allclose(out[0].numpy(), full[40][39].numpy(), rtol=0, atol=1e-3)
    np.testing.assert_allclose(out[1].numpy(), full[70][69].numpy(), rtol=0, atol=1e-3)
    assert torch.equal(out[0].argmax(), full[40][39].argmax())
    for s in ("s40", "s70"):
        pipeline.release(s)
    assert all(p.kv.used_slots == 0 for p in pipeline.pieces)


@pytest.fixture(params=["kernel", "sdpa"])
def batched_attention(request, monkeypatch):
    """Batched decode attends with qdot.cpp's decode_attention_batch (attention.KernelDecode, where the integer-dot
    kernels load), or with torch's SDPA over windows of slots (DecodeWindow / SplitDecode: other CPUs, bf16)."""
    from shared.kernels import qdot
    from shared.models.attention import KernelDecode

    if request.param == "sdpa":
        monkeypatch.setattr(KernelDecode, "applies", staticmethod(lambda config, dtype, device: False))
    elif not qdot.usable():
        pytest.skip(f"the decode-attention kernel does not run here: {qdot.why_not()}")
    return request.param


def test_batched_decode_reads_the_cache_in_place_around_idle_slots(smollm2, windows, batched_attention):
    """Decode batches whose KV slots have gaps (a released sequence, a sequence sitting a step out) and come in any
    order: each row still equals its single-pass logits (float32)."""
    from shared.batch.steps import Decode, Prefill
    from shared.wire.protocol import SeqEntry

    pipeline = LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=5)
    lengths = {"a": 30, "gone": 12, "b": 45, "idle": 20, "c": 60}
    texts = {name: windows[2][i * 10:i * 10 + n + 2] for i, (name, n) in enumerate(lengths.items())}
    for name, n in lengths.items():  # slots 0..4 in this order
        pipeline.run([SeqEntry(name, Prefill(n, 0, n, True))], torch.tensor(texts[name][:n]))
    pipeline.release("gone")
    for step in range(2):
        batch = ["c", "a", "b"]  # slots 4, 0, 2: the window spans idle slots 1 and 3
        out = pipeline.run([SeqEntry(s, Decode(lengths[s] + step)) for s in batch],
                           torch.tensor([texts[s][lengths[s] + step] for s in batch]))
        for row, s in zip(out, batch):
            full = window_logits(pipeline, texts[s][:lengths[s] + step + 1], seq_id="check")
            np.testing.assert_allclose(row.numpy(), full[-1].numpy(), rtol=0, atol=1e-3)


def decode_logits(pipeline, ids: list[int], seq_id: str = "decode") -> torch.Tensor:
    """Teacher-forced logits of ids[:-1] one token per step: a 1-token prefill, then a decode step per token."""
    from shared.batch.steps import Decode, Prefill
    from shared.wire.protocol import SeqEntry

    rows = [pipeline.run([SeqEntry(seq_id, Prefill(1, 0, 1, True))], torch.tensor(ids[:1]))]
    for t in range(1, len(ids) - 1):
        rows.append(pipeline.run([SeqEntry(seq_id, Decode(t))], torch.tensor(ids[t:t + 1])))
    pipeline.release(seq_id)
    return torch.cat(rows)


# compiled_pipeline's background compilation begins when this is set (by wait_compiled, or by the test of what runs
# meanwhile once it has decoded a few steps): from warm in-process caches the graphs take only a few seconds, which a
# prefill competing with the compiling thread for the GIL can outlast
COMPILE_GATE = threading.Event()


def test_batched_decode_attends_per_run_of_slots_when_the_batch_lies_far_apart(smollm2, windows, batched_attention):
    """Sequences in slots 0, 1 and 8 (kept prefixes or idle sequences between them): the batch attends as two windows,
    slots 0-1 and slot 8, not one window over the six between, and each row still equals its single-pass logits."""
    from shared.batch.layout import BatchLayout
    from shared.batch.steps import Decode, Prefill
    from shared.models.attention import DecodeWindow, SplitDecode
    from shared.wire.protocol import SeqEntry

    pipeline = LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=10)  # the 10th: window_logits
    names = [f"s{i}" for i in range(9)]
    texts = {name: windows[3][i * 7:i * 7 + 40] for i, name in enumerate(names)}
    lengths = {name: 20 + i for i, name in enumerate(names)}
    for name in names:  # slots 0..8 in this order
        pipeline.run([SeqEntry(name, Prefill(lengths[name], 0, lengths[name], True))],
                     torch.tensor(texts[name][:lengths[name]]))
    batch = ["s8", "s0", "s1"]
    layout = BatchLayout.build([8, 0, 1], [Decode(lengths[s]) for s in batch], 64)
    split = SplitDecode.of(layout, pipeline.pieces[0].model.config, torch.float32)
    assert isinstance(split, SplitDecode)
    assert [(rows.tolist(), w.lo, w.span) for rows, w in split.parts] == [([1, 2], 0, 2), ([0], 8, 1)]
    near = BatchLayout.build([0, 1, 3], [Decode(20)] * 3, 64)  # two idle slots between: one window
    assert isinstance(SplitDecode.of(near, pipeline.pieces[0].model.config, torch.float32), DecodeWindow)
    out = pipeline.run([SeqEntry(s, Decode(lengths[s])) for s in batch],
                       torch.tensor([texts[s][lengths[s]] for s in batch]))
    for row, s in zip(out, batch):
        full = window_logits(pipeline, texts[s][:lengths[s] + 1], seq_id="check")
        np.testing.assert_allclose(row.numpy(), full[-1].numpy(), rtol=0, atol=1e-3)


def test_with_the_kernel_a_batched_decode_row_is_the_sequence_decoded_alone(smollm2):
    """KernelDecode: each sequence of a decode batch reads exactly its own context, with numbers that do not depend on
    the batch, so with the integer-dot matmuls (row by row too) a row equals that sequence's step alone, bit for bit,
    at contexts across the kernel's 256-position chunks; and it predicts what torch's SDPA over windows of slots
    predicts (the logits differ a little: the matmuls' 8-bit rounding of the activations amplifies the last bits)."""
    from shared.batch.steps import Decode, Prefill
    from shared.kernels import qdot
    from shared.models.attention import KernelDecode
    from shared.wire.protocol import SeqEntry

    if not qdot.usable():
        pytest.skip(f"the decode-attention kernel does not run here: {qdot.why_not()}")
    pipeline = LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=6, max_seq_len=512, weights="lean")
    lengths = [5, 300, 40, 257, 100, 12]
    rng = np.random.default_rng(3)
    texts = [rng.integers(100, 40000, n + 1).tolist() for n in lengths]
    for i, n in enumerate(lengths):
        pipeline.run([SeqEntry(f"s{i}", Prefill(n, 0, n, True))], torch.tensor(texts[i][:n]))
    batch = [SeqEntry(f"s{i}", Decode(n)) for i, n in enumerate(lengths)]
    tokens = torch.tensor([t[n] for t, n in zip(texts, lengths)])
    out = pipeline.run(batch, tokens)
    for i, entry in enumerate(batch):  # the same K/V row written again: the cache does not change
        alone = pipeline.run([entry], tokens[i:i + 1])
        assert torch.equal(alone[0], out[i]), f"sequence {i} (context {lengths[i] + 1})"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KernelDecode, "applies", staticmethod(lambda config, dtype, device: False))
        windows_out = pipeline.run(batch, tokens)
    assert torch.equal(windows_out.argmax(-1), out.argmax(-1))
    spread = (out.amax(-1) - out.amin(-1))[:, None]
    assert bool(((windows_out - out).abs() <= 0.05 * spread).all())


# The compiled step's tests run on SmolLM2's first SHALLOW_LAYERS blocks (its real weights, embedding and head; the
# file cut by write_first_layers, which llama.cpp loads too): inductor compiles a graph per layer it unrolls, and the
# 30 blocks' two graphs took ~3.5 min of the suite's CPU where 4 take a seventh of it. Every block is the same code;
# eager SmolLM2 whole is held to llama.cpp above.
SHALLOW_LAYERS = 4


@pytest.fixture(scope="module")
def shallow(smollm2, tmp_path_factory) -> GgufLoader:
    from services.testing.tiny_gguf import write_first_layers

    path = tmp_path_factory.mktemp("shallow") / f"smollm2-first-{SHALLOW_LAYERS}.gguf"
    return GgufLoader(write_first_layers(smollm2.loader.path, str(path), SHALLOW_LAYERS))


@pytest.fixture(scope="module")
@uses_llama_cpp
def shallow_reference_logits(shallow, windows):
    from services.testing.tiny_gguf import llama_cpp_model

    llm = llama_cpp_model(shallow.path, n_ctx=CONTEXT)
    return [torch.from_numpy(llama_cpp_logits(llm, w)) for w in windows[:2]]


@pytest.fixture(scope="module")
def compiled_pipeline(shallow):
    """Compiling in the background, as a stage does by default (--compile-decode auto), once COMPILE_GATE is set;
    wait_compiled() waits for it. Weights lean: auto's decode kernels without its measured switch to dense
    ones, whose threshold a loaded machine can measure differently in two pipelines, so an eager pipeline with lean
    weights computes the same numbers."""
    from shared.models.compiled_decode import CompiledDecode

    warm_up = CompiledDecode.warm_up

    def gated_warm_up(self) -> None:
        COMPILE_GATE.wait()
        warm_up(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompiledDecode, "warm_up", gated_warm_up)
        pipeline = LocalPipeline.load(shallow, None, SERVING_DTYPE, kv_slots=3, max_seq_len=CONTEXT,
                                      weights="lean", compile_decode="auto")
        piece = pipeline.pieces[0]
        piece.compiled.warm_up = types.MethodType(gated_warm_up, piece.compiled)  # the thread may look it up later
    return pipeline


def eager_twin(shallow) -> LocalPipeline:
    """compiled_pipeline's eager twin: the same weights and KV shape, no compiled step."""
    return LocalPipeline.load(shallow, None, SERVING_DTYPE, kv_slots=3, max_seq_len=CONTEXT, weights="lean")


def wait_compiled(pipeline, timeout_s: float = 900.0):
    COMPILE_GATE.set()
    compiled = pipeline.pieces[0].compiled
    deadline = time.monotonic() + timeout_s
    while compiled.state == "compiling" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert compiled.state == "ready", compiled.info()
    return compiled


def test_background_compile_decodes_eagerly_until_the_graphs_are_ready(shallow, windows, compiled_pipeline):
    """--compile-decode auto: the pipeline serves at once; until every graph is compiled its decode steps are the eager
    step's, bit for bit, although the warm-up runs the graphs on the same KV tensors (in their scratch row, which no
    sequence holds); then the steps run compiled."""
    from shared.batch.steps import Decode, Prefill
    from shared.wire.protocol import SeqEntry

    piece = compiled_pipeline.pieces[0]
    compiled = piece.compiled
    assert compiled.state == "compiling"  # load returned before compiling (seconds even from inductor's cache)
    assert piece.kv.num_slots == 3 and piece.kv.scratch_slot == 3 and piece.kv.k[0].shape[0] == 4
    text = windows[0]

    def prefill(pipe) -> None:  # two live sequences: slots 0 and 1
        for name, n in (("a", 20), ("b", 30)):
            pipe.run([SeqEntry(name, Prefill(n, 0, n, True))], torch.tensor(text[:n]))

    # The compiled pipeline's steps first, right after its load: from a warm inductor cache the graphs take only
    # seconds, so the eager twin loads afterwards and replays the same steps.
    prefill(compiled_pipeline)
    taken = []  # (sequence, position, output, whether the step ran while the graphs compiled)
    for t in range(30, CONTEXT - 1):  # one-sequence decode steps, the compiled step's shape, for each sequence
        if t == 33:  # a few steps decoded: the compilation may begin
            COMPILE_GATE.set()
        state_before = compiled.state
        for name, pos in (("b", t), ("a", t - 10)):
            steps = compiled.steps
            out = compiled_pipeline.run([SeqEntry(name, Decode(pos))], torch.tensor([text[pos]]))
            during = state_before == compiled.state == "compiling"
            if during:
                assert compiled.steps == steps
            taken.append((name, pos, out, during))
        if compiled.state != "compiling":
            break
    assert any(during for *_, during in taken), compiled.info()
    eager = eager_twin(shallow)
    assert eager.pieces[0].compiled is None and eager.pieces[0].kv.scratch_slot is None
    prefill(eager)
    for name, pos, ours, during in taken:
        ref = eager.run([SeqEntry(name, Decode(pos))], torch.tensor([text[pos]]))
        if during:
            assert torch.equal(ours, ref), (name, pos)
    wait_compiled(compiled_pipeline)
    # once compiled, a step of each sequence runs the graph: one graph for every slot (slots 0, 1 and 2 here; it was
    # traced in the scratch row, 3). A fresh one: the loop above may have taken b and a to the graph's last context.
    compiled_pipeline.run([SeqEntry("c", Prefill(20, 0, 20, True))], torch.tensor(text[:20]))
    for name, pos in (("b", 29), ("a", 19), ("c", 20)):
        steps = compiled.steps
        compiled_pipeline.run([SeqEntry(name, Decode(pos))], torch.tensor([text[pos]]))  # (b and a: rewrites a position)
        assert compiled.steps == steps + 1, (name, compiled.info())
    assert not compiled.broken
    for name in ("a", "b", "c"):
        compiled_pipeline.release(name)


def test_compiled_decode_parity_with_llama_cpp(windows, shallow_reference_logits, compiled_pipeline):
    """--compile-decode: every decode step of two windows runs the compiled graph (one graph, every context length
    the windows reach) and keeps the default path's fidelity thresholds against llama.cpp on the same file."""
    compiled = wait_compiled(compiled_pipeline)
    assert compiled.contexts == (2, CONTEXT - 1)  # the graph's dynamic context length stops short of the cache's
    assert set(compiled.compile_seconds) == set(compiled.thread_counts)
    kls, agree = [], []
    for w, ref in zip(windows, shallow_reference_logits):
        steps = compiled.steps
        ours = decode_logits(compiled_pipeline, w).double()
        # every decode step ran compiled; the 1-token prefill is decode-shaped, but its context (1) runs eagerly
        assert compiled.steps - steps == len(w) - 2
        lr, lo = torch.log_softmax(ref[:-1], -1), torch.log_softmax(ours, -1)
        kls.append((lr.exp() * (lr - lo)).sum(-1))
        agree.append(ref[:-1].argmax(-1) == ours.argmax(-1))
    kl, top1 = float(torch.cat(kls).mean()), float(torch.cat(agree).double().mean())
    print(f"\ncompiled decode: top1 {top1:.4f} KL {kl:.5f} over {torch.cat(agree).numel()} decode steps")
    assert not compiled.broken
    # the compiled step agrees with the eager one to bf16 rounding (fused kernels round at other points), and with
    # bf16-rounded activations that flips a few close argmaxes: on a 2-core AVX2 EPYC (float32 activations) these
    # windows gave eager 0.955, compiled 0.953 with graphs per context bucket and 0.943 with one graph (KL 0.003)
    assert top1 >= 0.94
    assert kl <= 0.01


def test_compiled_decode_runs_decode_batches_on_one_batched_graph(shallow, windows, compiled_pipeline):
    """Decode micro-batches of 2..kv_slots sequences run a second graph whose one dynamic size is the batch (attention
    on qdot.cpp's kernel: each sequence reads its own context in place, so no shape depends on the contexts), where
    the kernel covers every layer (float32 on an AVX2 CPU); elsewhere they decode eagerly, bit for bit the eager
    pipeline's. Compiled, they predict what the eager step predicts (fused kernels round at other points)."""
    from shared.batch.steps import Decode, Prefill
    from shared.kernels import qdot
    from shared.wire.protocol import SeqEntry

    eager = eager_twin(shallow)
    compiled = wait_compiled(compiled_pipeline)
    batched = compiled.batch_reason is None
    assert batched == (qdot.usable() and SERVING_DTYPE == torch.float32), compiled.info()
    if batched:
        assert compiled.batch_sizes == (2, 3) and set(compiled.batch_compile_seconds) == set(compiled.thread_counts)
    text = windows[0]
    outs = []
    for pipe in (eager, compiled_pipeline):
        pos = {"a": 20, "b": 45, "c": 70}
        for name, n in pos.items():
            pipe.run([SeqEntry(name, Prefill(n, 0, n, True))], torch.tensor(text[:n]))
        steps, batch_steps = compiled.steps, compiled.batch_steps
        rows = []
        for k in range(6):  # 3 sequences, then 2 whose slots are out of order (2, 0), in turn
            names = ["a", "b", "c"] if k % 2 == 0 else ["c", "a"]
            rows.append(pipe.run([SeqEntry(n, Decode(pos[n])) for n in names], torch.tensor([text[pos[n]] for n in names])))
            for n in names:
                pos[n] += 1
        ran = compiled.batch_steps - batch_steps
        assert ran == (6 if batched and pipe is compiled_pipeline else 0), compiled.info()
        assert compiled.steps == steps  # never the one-sequence graph
        outs.append(torch.cat(rows))
        for name in pos:
            pipe.release(name)
    ours, ref = outs[1], outs[0]
    assert ref.abs().max() > 1 and ours.shape == ref.shape and ours.shape[0] == 15
    if not batched:
        assert torch.equal(ours, ref)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    spread = (ref.amax(-1) - ref.amin(-1))[:, None]
    assert bool(((ours - ref).abs() <= 0.05 * spread).all())
    assert not compiled.batch_broken


def test_compiled_decode_leaves_long_contexts_and_large_batches_to_the_eager_step(compiled_pipeline):
    """A context the one-sequence graph does not serve, or a batch larger than the batched graph's: eager."""
    from shared.batch.layout import BatchLayout
    from shared.batch.steps import Decode, Prefill
    from shared.models.compiled_decode import CompiledDecode

    compiled = wait_compiled(compiled_pipeline)
    piece = compiled_pipeline.pieces[0]
    short = CompiledDecode(piece.model, piece.kv)
    short.state = "ready"  # as if compiled: forward must decline on the context alone
    hidden = torch.zeros(1, piece.model.config.hidden_size)
    # contexts 1 (a 1-token prompt, decode-shaped) and the cache's whole length: past the graph's dynamic range
    for step in (Prefill(1, 0, 1, True), Decode(CONTEXT - 1)):
        layout = BatchLayout.build([0], [step], CONTEXT)
        assert layout.decode_only
        assert short.forward(hidden, layout) is None
    assert short.steps == 0
    # four sequences: more than the batched graph's (the KV cache's 3 live slots; the scratch row is the fourth)
    layout = BatchLayout.build([0, 1, 2, 3], [Decode(10)] * 4, CONTEXT)
    assert short.forward(torch.zeros(4, piece.model.config.hidden_size), layout) is None and short.batch_steps == 0
    # while another piece of the process compiles (dynamo's stance is process-wide), a covered step runs eager too
    from shared.models import compiled_decode

    layout = BatchLayout.build([0], [Decode(10)], CONTEXT)  # slot 0 is free again: nothing live is written
    with torch.inference_mode():  # as a stage's hidden state is made (dynamo guards on it)
        hidden = torch.zeros(1, piece.model.config.hidden_size)
    compiled_decode._compiling.add(id(short))
    try:
        assert compiled.forward(hidden, layout) is None
    finally:
        compiled_decode._compiling.discard(id(short))
    steps = compiled.steps
    assert compiled.forward(hidden, layout) is not None and compiled.steps == steps + 1 and not compiled.broken


@pytest.mark.parametrize("kwargs,reason", [
    ({"batch_invariant": True}, "batch-invariant"),
])
def test_compile_decode_refuses_what_it_does_not_cover(smollm2, kwargs, reason):
    from shared.errors import CapabilityMissing

    with pytest.raises(CapabilityMissing, match=reason):
        LocalPipeline.load(smollm2.loader, None, torch.bfloat16, kv_slots=1, compile_decode="on", **kwargs)
