"""Each architecture beyond llama, on a tiny random GGUF from the factory: loads by layer range (a stage holds only
its layers' tensors), any split gives exactly the unsplit logits (float32), its chat template renders sandboxed as
llama.cpp's formatter renders it, and what it cannot run yet is refused in one line. Logits against llama.cpp:
test_tiny_models.py."""

import pytest
import torch

from shared.chat_template import ChatTemplate
from shared.errors import UnsupportedArchitecture
from shared.generation import window_logits
from shared.gguf_loader import GgufLoader
from shared.layers import LayerRange, split_at
from shared.models import TransformerModel
from shared.runtime import LocalPipeline
from tests.factories import TinySpec, write_tiny_gguf
from tests.test_tiny_models import IDS

ARCHS = ["llama", "qwen2", "qwen3", "starcoder2", "phi3", "phi2", "qwen3moe", "mistral3"]


def _spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, layers=4, tied=False, head_dim=32 if arch == "qwen3" else 16,
                    rope_dim=8 if arch == "phi2" else None)


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


@pytest.mark.parametrize("source,bos,eos,ends_with", [
    (PHI3_TEMPLATE, "<s>", "<|endoftext|>", "<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\n"),
    (STARCODER2_TEMPLATE, "<|endoftext|>", "<|endoftext|>", "### Instruction\nAnd 3+3?\n\n### Response\n"),
], ids=["phi3", "starcoder2"])
def test_chat_template_renders_as_llama_cpp_formats_it(source, bos, eos, ends_with):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render([dict(m) for m in msgs], add_generation_prompt=True)
    ref = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos, add_generation_prompt=True)(messages=msgs).prompt
    assert ours == ref
    assert ours.endswith(ends_with)


def test_longrope_factors_are_refused_in_one_line(tmp_path):
    import numpy as np

    spec = _spec("phi3")
    factors = np.ones(spec.head_dim // 2, dtype=np.float32)
    override = {"rope_factors_long.weight": factors, "rope_factors_short.weight": factors}
    path = write_tiny_gguf(str(tmp_path / "longrope.gguf"), spec, extra_tensors=override)
    with pytest.raises(UnsupportedArchitecture, match="LongRoPE") as e:
        TransformerModel.from_gguf(GgufLoader(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["starcoder2", "phi3", "phi2", "qwen3moe", "mistral3"])
async def test_two_stage_mesh_generates_what_one_process_does(arch, tmp_path):
    """Real stage processes on loopback (float32): greedy tokens through 2 stages == one local process."""
    from services.launch import start_mesh
    from shared.generation import generate_tokens
    from shared.sampling import SamplingParams
    from tests.mesh import generate_group

    path = write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), _spec(arch))
    local = LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1)
    expected = list(generate_tokens(local, IDS, SamplingParams(), 8))
    mesh = start_mesh(path, 2, dtype="float32", log_dir=str(tmp_path))
    try:
        client = mesh.client()
        await client.start()
        try:
            out = await generate_group(client, {"s": IDS}, 8)
        finally:
            await client.close()
    finally:
        mesh.stop()
    assert len(expected) == 8 and out["s"] == expected
