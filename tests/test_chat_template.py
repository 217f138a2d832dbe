"""Chat templates render sandboxed with a time cap and an output cap."""

import os

import pytest

from shared.chat_template import ChatTemplate
from shared.errors import ChatTemplateError

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
