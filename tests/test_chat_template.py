"""Chat templates render sandboxed with a time cap and an output cap."""

import os

import pytest

from shared.errors import ChatTemplateError
from shared.runtime.model_files import ModelFiles
from shared.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, detect_template

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.reference
def test_smollm2_template_matches_llama_cpp_python_formatter(smollm2):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    ours = smollm2.chat_template.render(msgs, add_generation_prompt=True)
    ref = Jinja2ChatFormatter(smollm2.loader.chat_template, eos_token="<|im_end|>", bos_token="<|im_start|>",
                              add_generation_prompt=True)(messages=msgs).prompt
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['os'].system('touch {marker}') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ x }}",
])
def test_attribute_walking_is_refused(tmp_path, source):
    marker = tmp_path / "pwned"
    tpl = ChatTemplate(source.replace("{marker}", str(marker)))
    with pytest.raises(ChatTemplateError, match="sandbox|failed"):
        tpl.render([dict(m) for m in MESSAGES])
    assert not os.path.exists(marker)


def test_loop_without_output_is_stopped_by_the_time_cap():
    tpl = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done",
                       time_limit_s=0.3)
    with pytest.raises(ChatTemplateError, match="ran longer than"):
        tpl.render(MESSAGES)


def test_unbounded_growth_is_stopped_by_the_output_cap():
    tpl = ChatTemplate("{% for i in range(100000) %}{{ 'xxxxxxxxxx' * 100 }}{% endfor %}", output_limit=100_000)
    with pytest.raises(ChatTemplateError, match="output exceeded"):
        tpl.render(MESSAGES)


def test_huge_repetition_is_refused():
    with pytest.raises(ChatTemplateError, match="sandbox"):
        ChatTemplate("{{ 'x' * 1000000000 }}").render(MESSAGES)


def test_raise_exception_reaches_the_caller_as_a_clear_error():
    tpl = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tpl.render(MESSAGES)


@pytest.mark.parametrize("source", [
    "{% for m in messages %}<t>{{ m['content'] | trim }}</t>{% endfor %}",
    "{% for m in messages %}{{ '<t>' + m['role'] + '\\n' + m['content'] + '</t>' }}{% endfor %}",
    "{% for m in messages %}{{ ('<t>' ~ m['content'] ~ '  ') | trim }}</t>{% endfor %}",
    "{% for m in messages %}<t>{{ m['content'].split('</think>')[-1].lstrip('\\n') }}</t>{% endfor %}",
    "{% for m in messages %}<t>{{ m['content'][:5] | upper }}|{{ '%s' % m['content'] }}</t>{% endfor %}",
])
def test_render_segments_tell_client_text_from_template_text(source):
    """The pieces join to exactly what render() gives, and every character that came from a message is marked
    as client text (so the tokenizer never parses it for control tokens), whatever the template did to it."""
    tpl = ChatTemplate(source)
    messages = [{"role": "user", "content": "  <t>why</think>\nhello </t> "}]
    segments = tpl.render_segments(messages)
    assert "".join(text for text, _ in segments) == tpl.render(messages)
    template_text = "".join(text for text, client in segments if not client)
    assert "why" not in template_text and "hello" not in template_text.lower() and "user" not in template_text
    assert template_text.count("<t>") == 1 and template_text.count("</t>") == 1  # the template's own, only


# ---- templates for files that carry none (--chat-template, detection by turn markers) -------------------------------

def _conversation(system: bool) -> list[dict]:
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": " And 3+3? "}]
    return ([{"role": "system", "content": "Answer briefly."}] if system else []) + msgs


@pytest.mark.parametrize("name, official, bos, eos, system", [
    ("gemma", "GEMMA3_TEMPLATE", "<bos>", "<eos>", True),  # Gemma 3's own (its system turn joins the first user one)
    ("llama3", "LLAMA3_TEMPLATE", "<|begin_of_text|>", "<|eot_id|>", True),
    ("phi3", "PHI3_TEMPLATE", "<s>", "<|endoftext|>", True),
    ("mistral", "MISTRAL_TEMPLATE", "<s>", "</s>", False),  # Mistral's drops a system turn; ours joins it to the first
], ids=["gemma", "llama3", "phi3", "mistral"])
def test_each_built_in_template_renders_as_its_familys_own(name, official, bos, eos, system):
    from tests import test_architectures, test_prompt_injection

    source = getattr(test_architectures, official, None) or getattr(test_prompt_injection, official)
    for with_system in {system, False}:
        msgs = _conversation(with_system)
        ours = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token=bos, eos_token=eos).render(
            [dict(m) for m in msgs], add_generation_prompt=True)
        theirs = ChatTemplate(source, bos_token=bos, eos_token=eos).render([dict(m) for m in msgs],
                                                                           add_generation_prompt=True)
        assert ours == theirs


def test_chatml_renders_as_smollm2s_own(smollm2):
    msgs = _conversation(True)  # with a system turn: SmolLM2's template adds a default one only when there is none
    ours = ChatTemplate(BUILTIN_TEMPLATES["chatml"]).render([dict(m) for m in msgs], add_generation_prompt=True)
    assert ours == smollm2.chat_template.render([dict(m) for m in msgs], add_generation_prompt=True)


@pytest.mark.parametrize("markers, family", [
    (("<start_of_turn>", "<end_of_turn>", "<eos>"), "gemma"),
    (("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "llama3"),
    (("<|im_start|>", "<|im_end|>"), "chatml"),
    (("<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"), "phi3"),
    (("[INST]", "[/INST]", "</s>"), "mistral"),
    (("<|im_start|>",), None),  # half a family's markers is none
    ((), None),
])
def test_a_family_is_detected_by_all_of_its_turn_markers(markers, family):
    assert detect_template(markers) == family


def test_a_model_without_a_template_is_refused_with_what_to_do_and_no_path(tmp_path):
    from services.testing.tiny_gguf import write_vocab_gguf

    path = write_vocab_gguf(str(tmp_path / "plain.gguf"), model="llama")  # SentencePiece, no turn markers
    files = ModelFiles.open(path)
    assert files.chat_template is None and files.chat_template_origin == "none"
    with pytest.raises(ChatTemplateError) as e:
        files.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    assert "--chat-template" in str(e.value) and "/v1/completions" in str(e.value) and str(tmp_path) not in str(e.value)
    chosen = ModelFiles.open(path, "chatml")
    assert chosen.chat_template_origin == "built-in chatml" and chosen.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert ModelFiles.open(path, str(tmp_path / "mine.jinja")).chat_template.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|b|"
    with pytest.raises(ChatTemplateError, match="neither a built-in template .*chatml.* nor a file"):
        ModelFiles.open(path, "no-such-template")
    # --chat-template none: a file's own template set aside (a base model's, or a wrong one): completion only
    templated = write_vocab_gguf(str(tmp_path / "templated.gguf"), model="llama", chat_template="{{ messages[0].content }}")
    assert ModelFiles.open(templated).chat_template is not None
    plain = ModelFiles.open(templated, "none")
    assert plain.chat_template is None and plain.chat_template_origin.startswith("none")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.chat_prompt_ids([{"role": "user", "content": "Hi"}])


@pytest.mark.reference  # the real Gemma 3 270M file comes with the reference packages (make install-reference)
def test_gemma3_270m_chats_with_its_familys_template():
    files = ModelFiles.open("gemma3-270m")
    assert files.loader.chat_template is None and files.chat_template_origin.startswith("built-in gemma")
    ids = files.chat_prompt_ids(_conversation(True))
    text = files.tokenizer.decode(ids, skip_special=False)
    assert text.startswith("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n")
    assert text.endswith("<start_of_turn>model\n")
    turn = files.tokenizer.control["<start_of_turn>"]
    assert ids.count(turn) == 4  # the markers are control tokens, not text


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_continuing_the_final_message_is_the_generation_prompt_followed_by_its_text(name):
    """continue_final_message (the page's Continue): the prompt stops right after the partial answer, exactly where
    the model would have stood had it generated that text itself; a template that ends elsewhere is refused."""
    from shared.runtime.model_files import _cut_after_final_content

    tpl = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token="<s>", eos_token="</s>")
    asked = [{"role": "user", "content": "Count to ten."}]
    partial = {"role": "assistant", "content": "One, two, three,"}
    segments = tpl.render_segments([*asked, partial], add_generation_prompt=False)
    continued = "".join(text for text, _ in _cut_after_final_content(segments, partial["content"]))
    assert continued == tpl.render([dict(m) for m in asked], add_generation_prompt=True) + partial["content"]
    assert continued != "".join(text for text, _ in segments)  # the end of the turn was cut
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        _cut_after_final_content(segments, "text the prompt does not end with")
