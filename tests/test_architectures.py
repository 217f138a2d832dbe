"""Each architecture beyond llama, on a tiny random GGUF from the factory: loads by layer range (a stage holds only
its layers' tensors), any split gives exactly the unsplit logits (float32), its chat template renders sandboxed as
llama.cpp's formatter renders it, and what it cannot run yet is refused in one line. Logits against llama.cpp:
test_tiny_models.py."""

import dataclasses

import pytest
import torch

from services.testing.tiny_gguf import TinySpec, write_tiny_gguf
from shared.errors import GgufError, UnsupportedArchitecture
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange, split_at
from shared.models import ModelConfig, TransformerModel
from shared.runtime.generation import window_logits
from shared.runtime.stage_runtime import LocalPipeline
from shared.text.chat_template import ChatTemplate
from tests.test_tiny_models import IDS, ROPE_CASES

ARCHS = ["llama", "qwen2", "qwen3", "starcoder2", "phi3", "phi2", "qwen3moe", "mistral3", "gemma", "gemma2", "gemma3"]


def _spec(arch: str) -> TinySpec:
    # gemma's and gemma2's lm_head is always token_embd; gemma3 needs 6 layers for a global one among its sliding ones
    return TinySpec(arch=arch, layers=6 if arch == "gemma3" else 4, tied=arch in ("gemma", "gemma2"),
                    head_dim=32 if arch in ("qwen3", "gemma3") else 16, rope_dim=8 if arch == "phi2" else None)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> tuple[str, TinySpec]:
    spec = _spec(request.param)
    return write_tiny_gguf(str(tmp_path_factory.mktemp(spec.arch) / "tiny.gguf"), spec), spec


@pytest.mark.parametrize("points", [[2], [1, 3]], ids=str)
def test_any_split_gives_exactly_the_unsplit_logits(tiny, points):
    path, spec = tiny
    loader = GgufLoader(path)
    unsplit = window_logits(LocalPipeline.load(loader, None, torch.float32, kv_slots=1), IDS)
    split = window_logits(LocalPipeline.load(loader, split_at(spec.layers, points), torch.float32, kv_slots=1), IDS)
    assert unsplit.abs().max() > 0
    assert torch.equal(split, unsplit)


@pytest.mark.slow
def test_every_architecture_decodes_compiled_with_the_eager_steps_numbers(tiny, monkeypatch):
    """The compiled decode step is the model's own run_layers under torch.compile, so every architecture has one (the
    same definition eager steps run: sliding windows, soft caps, q/k norms, parallel blocks, biases, experts). Each
    decode step of a sequence runs compiled and gives the eager step's logits (float32: fused kernels sum in another
    order, so equal to rounding, not bit for bit). The graph is called without dynamo where it is one graph
    (DirectCall), with exactly the numbers of the same graph called through dynamo."""
    from torch._dynamo.utils import counters

    from shared.batch.steps import Decode, Prefill
    from shared.models.compiled_decode import DirectCall
    from shared.wire.protocol import SeqEntry

    path, spec = tiny
    loader = GgufLoader(path)
    ids = torch.tensor(IDS * 4)[:36]  # past gemma's sliding window (8): the sliding layers' mask bites
    logits, steps = {}, {}
    counters.clear()
    for mode in ("off", "on", "through dynamo"):
        with monkeypatch.context() as patch:
            if mode == "through dynamo":
                patch.setattr(DirectCall, "bind", classmethod(lambda cls, *args: (None, "refused by the test")))
            pipe = LocalPipeline.load(loader, None, torch.float32, kv_slots=2, max_seq_len=64,
                                      compile_decode="off" if mode == "off" else "on")
        pipe.run([SeqEntry("a", Prefill(20, 0, 20, True))], ids[:20])
        logits[mode] = torch.cat([pipe.run([SeqEntry("a", Decode(20 + k))], ids[20 + k:21 + k]) for k in range(16)])
        steps[mode] = pipe.pieces[0].compiled
        if mode == "on":  # counted before the third load: its graphs come from the caches
            # compiled for this model (a graph of its own, not another architecture's cache entry nor dynamo's eager
            # fallback), and one graph, except that a mixture-of-experts block's experts run eagerly between graphs
            assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
            breaks = dict(counters["graph_break"])
            assert bool(breaks) == (spec.arch == "qwen3moe"), breaks
    direct, dynamo = steps["on"].info(), steps["through dynamo"].info()
    assert direct["steps"] == dynamo["steps"] == 16, (direct, dynamo)
    threads = torch.get_num_threads()
    if spec.arch == "qwen3moe":  # several graphs with eager experts between them: dynamo runs the step
        assert direct["direct"] == [] and "graphs" in direct["direct_reason"], direct
    else:
        assert f"one:{threads}" in direct["direct"] and direct["direct_reason"] is None, direct
        assert dynamo["direct"] == [] and "refused by the test" in dynamo["direct_reason"], dynamo
    eager = logits["off"]
    assert eager.abs().max() > 1 and not torch.equal(eager[0], eager[-1])
    torch.testing.assert_close(logits["on"], eager, rtol=1e-5, atol=1e-4)
    assert torch.equal(logits["on"], logits["through dynamo"])


@pytest.mark.slow
def test_matrices_kept_dense_run_inside_the_compiled_graphs(tmp_path):
    """Real K-quant files keep some matrices dense (Q6_K under weights auto: oneDNN-prepacked float32 on CPUs without
    fast bf16, which inductor does not lower). They run inside the compiled graphs as an op of their own (linear.prepacked_mm), so
    the one-sequence step stays one graph of its own; with graph breaks around them dynamo compiled each layer's
    frames apart, ran out of cache entries and the stage decoded eagerly for good (the real Gemma 3 Q4_K_M did)."""
    from torch._dynamo.utils import counters

    from shared.batch.steps import Decode, Prefill
    from shared.models.linear import dense_dtype
    from shared.wire.protocol import SeqEntry

    # float32 matrices under weights auto: every matmul is oneDNN's prepacked GEMM here (bf16 where the CPU has it)
    loader = GgufLoader(write_tiny_gguf(str(tmp_path / "tiny.gguf"), dataclasses.replace(_spec("llama"), layers=10)))
    ids = torch.tensor(IDS * 4)[:40]
    outs = []
    counters.clear()
    for mode in ("off", "on"):
        pipe = LocalPipeline.load(loader, None, torch.float32, kv_slots=3, max_seq_len=64, weights="auto",
                                  compile_decode=mode)
        kinds = set(pipe.pieces[0].model.weight_summary().values())
        prepacked = "bf16-prepacked" if dense_dtype() == torch.bfloat16 else "f32-prepacked"  # auto's dense kernel here
        assert any(prepacked in k for k in kinds) == torch.backends.mkldnn.is_available(), kinds
        for name, n in (("a", 20), ("b", 25)):
            pipe.run([SeqEntry(name, Prefill(n, 0, n, True))], ids[:n])
        rows = [pipe.run([SeqEntry("a", Decode(20 + k))], ids[20 + k:21 + k]) for k in range(10)]
        rows += [pipe.run([SeqEntry("a", Decode(30 + k)), SeqEntry("b", Decode(25 + k))],
                          torch.stack([ids[30 + k], ids[25 + k]])) for k in range(4)]
        outs.append(torch.cat(rows))
    step = pipe.pieces[0].compiled
    assert step.steps == 10 and not step.broken, step.info()  # 10 layers: more than dynamo's 8 entries a frame
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    assert step.batch_steps == (4 if step.batch_reason is None else 0), step.info()
    eager, compiled = outs
    assert eager.abs().max() > 1 and not torch.equal(eager[0], eager[-1])
    if dense_dtype() == torch.float32:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-4)
    else:  # bf16 matrices: the compiled graph rounds its bf16 products in other places (1 % of the logits' range)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0.01 * float(eager.max() - eager.min()))


@pytest.mark.slow
def test_sliding_layers_decode_batches_on_the_kernel_and_the_batched_graph(tmp_path, monkeypatch):
    """gemma3's sliding layers (window 8) in decode batches: qdot's attention kernel reads each sequence's window of its
    own context, so a sequence decoded in a batch of 3 gives its numbers alone bit for bit, and torch's masked SDPA's
    to rounding; compiled, the batch runs the batched graph (where the kernel runs: an AVX2 CPU) with eager's logits."""
    from shared.batch.steps import Decode, Prefill
    from shared.kernels import qdot
    from shared.models.attention import KernelDecode
    from shared.wire.protocol import SeqEntry

    # Q4_0 matrices, weights auto: on an AVX2 CPU the integer-dot matmuls, whose rows never depend on the batch
    loader = GgufLoader(write_tiny_gguf(str(tmp_path / "tiny.gguf"), dataclasses.replace(_spec("gemma3"), quant="Q4_0")))
    assert ModelConfig.from_gguf(loader).sliding_window == 8
    ids = torch.tensor(IDS * 4)[:40]
    starts = {"a": 12, "b": 20, "c": 27}  # contexts past the window, each its own length

    def decode(pipe, together: bool) -> torch.Tensor:
        for name, n in starts.items():
            pipe.run([SeqEntry(name, Prefill(n, 0, n, True))], ids[:n])
        rows = []
        for k in range(5):
            work = [SeqEntry(name, Decode(n + k)) for name, n in starts.items()]
            tokens = torch.stack([ids[n + k] for n in starts.values()])
            if together:
                rows.append(pipe.run(work, tokens))
            else:
                rows.append(torch.cat([pipe.run([w], tokens[i:i + 1]) for i, w in enumerate(work)]))
        for name in starts:
            pipe.release(name)
        return torch.cat(rows)

    eager = LocalPipeline.load(loader, None, torch.float32, kv_slots=3, max_seq_len=64, weights="auto")
    batched, alone = decode(eager, True), decode(eager, False)
    kernel = qdot.usable()
    if kernel:
        assert torch.equal(batched, alone)
    with monkeypatch.context() as patch:  # torch's SDPA with the sliding mask, as on CPUs without the kernel
        patch.setattr(KernelDecode, "applies", staticmethod(lambda config, dtype, device: False))
        sdpa = decode(LocalPipeline.load(loader, None, torch.float32, kv_slots=3, max_seq_len=64, weights="auto"), True)
    assert batched.abs().max() > 1 and not torch.equal(batched[0], batched[3])
    torch.testing.assert_close(batched, sdpa, rtol=1e-5, atol=1e-4)
    compiled = LocalPipeline.load(loader, None, torch.float32, kv_slots=3, max_seq_len=64, weights="auto",
                                  compile_decode="on")
    step = compiled.pieces[0].compiled
    assert (step.batch_reason is None) == kernel, step.info()
    torch.testing.assert_close(decode(compiled, True), batched, rtol=1e-5, atol=1e-4)
    assert step.batch_steps == (5 if kernel else 0) and not step.batch_broken


def test_a_stage_loads_only_its_layers(tiny):
    path, spec = tiny
    loader = GgufLoader(path)
    middle = TransformerModel.from_gguf(loader, LayerRange(1, 3))
    whole_blocks = TransformerModel.from_gguf(loader, LayerRange(0, 4))
    assert [len(m.blocks) for m in (middle, whole_blocks)] == [2, 4]
    assert not middle.has_embedding and not middle.has_lm_head
    sources = {g for names in middle._sources.values() for g in names}
    assert sources and all(g.startswith(("blk.1.", "blk.2.")) for g in sources), sources
    # every tensor of blocks 1 and 2 (norms and biases included) runs somewhere: none is silently ignored
    held = middle.weight_bytes()
    expected = sum(4 * torch.Size(loader.tensor_shape(n)).numel() for n in loader.tensor_names
                   if n.startswith(("blk.1.", "blk.2.")))
    assert held == expected, (held, expected)


PHI3_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] "
                 "+ '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
                 "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}"
                 "{% endif %}")
STARCODER2_TEMPLATE = ("{{bos_token}}{{'You are an exceptionally intelligent coding assistant that consistently delivers "
                       "accurate and reliable responses to user instructions.\\n\\n'}}\n{%- for message in messages %}\n"
                       "    {%- if message['role'] == 'system' %}\n"
                       "        {{ raise_exception('System messages are not allowed in this template.') }}\n"
                       "    {%- else %}\n        {%- if message['role'] == 'user' %}\n"
                       "{{'### Instruction\\n' + message['content'] + '\\n\\n'}}\n        {%- else %}\n"
                       "{{'### Response\\n' + message['content'] + eos_token + '\\n\\n'}}\n        {%- endif %}\n"
                       "    {%- endif %}\n{%- endfor %}\n{{'### Response\\n'}}")


GEMMA2_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                   "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                   "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
                   "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
GEMMA3_TEMPLATE = ("{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
                   "    {%- if messages[0]['content'] is string -%}\n"
                   "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
                   "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
                   "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
                   "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
                   "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
                   "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
                   "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
                   "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
                   "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
                   "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
                   "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
                   "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
                   "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
                   "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
                   "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
                   "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")


@pytest.mark.reference
@pytest.mark.parametrize("source,bos,eos,ends_with", [
    (PHI3_TEMPLATE, "<s>", "<|endoftext|>", "<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\n"),
    (STARCODER2_TEMPLATE, "<|endoftext|>", "<|endoftext|>", "### Instruction\nAnd 3+3?\n\n### Response\n"),
    (GEMMA2_TEMPLATE, "<bos>", "<eos>", "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"),
    (GEMMA3_TEMPLATE, "<bos>", "<eos>", "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"),
], ids=["phi3", "starcoder2", "gemma2", "gemma3"])
def test_chat_template_renders_as_llama_cpp_formats_it(source, bos, eos, ends_with):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render([dict(m) for m in msgs], add_generation_prompt=True)
    ref = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos, add_generation_prompt=True)(messages=msgs).prompt
    assert ours == ref
    assert ours.endswith(ends_with)


@pytest.mark.reference
def test_end_of_turn_ends_generation_as_in_llama_cpp(tmp_path):
    """Gemma GGUFs name no eot_token_id: <end_of_turn> ends generation by its text, as llama.cpp's end-of-generation
    set has it (the same set of ids, checked over a whole vocabulary)."""
    import llama_cpp

    from services.testing.tiny_gguf import llama_cpp_vocab, write_vocab_gguf
    from shared.text.tokenizer import GgufTokenizer

    path = write_vocab_gguf(str(tmp_path / "gemma-vocab.gguf"), model="llama", bos="<s>", eos="</s>",
                            control_tokens=("<start_of_turn>", "<end_of_turn>"), chat_template=GEMMA2_TEMPLATE)
    tok = GgufTokenizer.from_gguf(GgufLoader(path))
    end_of_turn = tok.control["<end_of_turn>"]
    llm = llama_cpp_vocab(path)  # held: the vocab pointer lives as long as the model
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)} == set(tok.eos_ids)
    assert end_of_turn in tok.eos_ids and tok.eos_id != end_of_turn


@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_rope_scaled_split_gives_exactly_the_unsplit_logits(tmp_path, case):
    """Every stage builds the same rope tables from the file (rope_freqs / LongRoPE factors are global tensors)."""
    path = case.write(str(tmp_path / "rope.gguf"), layers=4)
    loader = GgufLoader(path)
    assert TransformerModel.from_gguf(loader, LayerRange(1, 3)).config.rope_scaling is not None
    ids = list(case.ids)
    unsplit = window_logits(LocalPipeline.load(loader, None, torch.float32, kv_slots=1, max_seq_len=case.n_ctx), ids)
    split = window_logits(LocalPipeline.load(loader, split_at(4, [1, 3]), torch.float32, kv_slots=1,
                                             max_seq_len=case.n_ctx), ids)
    assert unsplit.abs().max() > 0
    assert torch.equal(split, unsplit)


def test_attention_temperature_caps_the_served_context_where_it_is_exact(tmp_path):
    """Ministral 3 scales q by 1 + s ln(floor(p / original_context) + 1): exactly 1 below original_context."""
    yarn = dict(ROPE_CASES["mistral3-yarn"].metadata)
    plain = write_tiny_gguf(str(tmp_path / "plain.gguf"), _spec("mistral3"), extra_metadata=yarn)
    tempered = write_tiny_gguf(str(tmp_path / "temp.gguf"), _spec("mistral3"),
                               extra_metadata={**yarn, "attention.temperature_scale": 0.1})
    assert ModelConfig.from_gguf(GgufLoader(plain)).context_length == 512
    assert ModelConfig.from_gguf(GgufLoader(tempered)).context_length == yarn["rope.scaling.original_context_length"]


def test_gemma2_output_weight_is_refused_in_one_line(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "untied.gguf"), TinySpec(arch="gemma2", tied=False))
    with pytest.raises(GgufError, match="gemma2 ties its lm_head to token_embd, yet the file carries output.weight") as e:
        TransformerModel.from_gguf(GgufLoader(path), LayerRange(0, 1))
    assert "\n" not in str(e.value)


def test_unknown_rope_scaling_is_refused_in_one_line(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "dynamic.gguf"), _spec("llama"), extra_metadata={"rope.scaling.type": "dynamic"})
    with pytest.raises(UnsupportedArchitecture, match="rope scaling type 'dynamic'") as e:
        TransformerModel.from_gguf(GgufLoader(path))
    assert "\n" not in str(e.value)


def test_a_graph_is_called_directly_only_where_every_argument_maps_to_an_input():
    """DirectCall.bind ties each argument dynamo handed the graph to run_layers' inputs by identity (weights: the same
    tensor at every call) and each int to one of the step's sizes; anything else keeps the graph behind dynamo."""
    from shared.models.compiled_decode import DirectCall, _Graph

    @dataclasses.dataclass
    class Attention:
        positions: torch.Tensor
        scale: float = 1.0

    weight = torch.arange(4.0)

    def inputs(pos: int) -> tuple:
        return (torch.full((1, 4), float(pos)), ((torch.ones(4), torch.zeros(4)), None), Attention(torch.tensor([pos])),
                [torch.zeros(2)], [torch.zeros(2)])

    probes = [(inputs(p), {"context": p + 1, "slot": 2}) for p in (5, 9)]

    def graph_of(args_of):  # a "compiled graph" of weight, hidden, positions, the context and the K cache
        def compiled(w, h, pos, ctx, k):
            k += 1  # the graph writes its KV inputs in place
            return [h * w + pos * ctx]
        graph = _Graph(compiled)
        return graph, lambda i: graph(*args_of(i))[0]

    def args(i):
        return weight, i[0], i[2].positions, i[2].positions.item() + 1, i[3][0]

    graph, call = graph_of(args)
    direct, why = DirectCall.bind(graph, probes, call)
    assert why == "" and direct is not None
    fresh = inputs(20)
    assert torch.equal(direct(fresh, {"context": 21, "slot": 2}), fresh[0] * weight + 20 * 21)
    assert torch.equal(fresh[3][0], torch.ones(2))  # written in place through the direct call
    # an argument made afresh at every call that is none of the inputs (dynamo computed it): refused
    graph, call = graph_of(lambda i: (weight.clone(), *args(i)[1:]))
    assert DirectCall.bind(graph, probes, call) == (
        None, "graph argument 0 changes from call to call but is none of the step's inputs")
    # an int that is none of the step's sizes
    graph, call = graph_of(lambda i: (*args(i)[:3], 7, args(i)[4]))
    direct, why = DirectCall.bind(graph, probes, call)
    assert direct is None and "graph argument 3 (7) is not one of the step's sizes" in why
    # one probe cannot tell an input from a weight (a cache too short for two contexts)
    graph, call = graph_of(args)
    assert DirectCall.bind(graph, probes[:1], call)[0] is None
    # a graph that gives another output than dynamo's call (a graph break would): refused
    graph, _ = graph_of(args)
    direct, why = DirectCall.bind(graph, probes, lambda i: graph(*args(i))[0] + 1)
    assert direct is None and "did not give dynamo's call's output" in why
