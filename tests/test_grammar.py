"""Constrained decoding without a model: llguidance's masks over SmolLM2's real vocabulary, sampled from random
logits through the very sampler the last stage runs, must always produce text that parses and follows the schema
-- whatever the logits prefer. And the tool-call format, both ways: rendered into messages, parsed out of text."""

import json

import pytest
import torch

from services.gateway.frontend.tools import (
    CALL_OPEN,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ToolCallParser,
    forced_call_schema,
    tool_messages,
)
from shared.batch.sampling import SamplingParams, sample
from shared.runtime.generation import SequenceState
from shared.runtime.model_files import ModelFiles
from shared.text.grammar import GrammarError, json_schema_grammar

ORDER = {"type": "object", "properties": {
    "customer": {"type": "string", "maxLength": 12},
    "size": {"enum": ["S", "M", "L"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 99},
    "price": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
}, "required": ["customer", "size", "count", "price", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def files():
    return ModelFiles.open("smollm2")


def constrained_run(files, schema: dict, seed: int, max_tokens: int = 400) -> tuple[str, str | None]:
    """Sample random logits (a model with no opinion) under the schema's grammar until a stop id; (text, reason)."""
    tok = files.tokenizer
    state = SequenceState("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=seed), max_tokens=max_tokens,
                          stop_ids=tok.eos_ids, grammar=files.grammars.matcher(json_schema_grammar(schema)))
    gen = torch.Generator().manual_seed(seed)
    reason = None
    while reason is None:
        entry, _ = state.next_step(64)
        state.computed = state.prefill_target = len(state.all_ids)  # no model: every step samples
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 4
        (token,) = sample(logits, [entry.sampling], [len(state.all_ids)], [entry.logit_inputs]).tokens
        reason = state.append(token)
    return tok.decode([t for t in state.output_ids if t not in tok.eos_ids]), reason


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_always_give_valid_json(files, seed):
    text, reason = constrained_run(files, ORDER, seed)
    assert reason == "stop", (reason, text)
    obj = json.loads(text)
    assert set(obj) == set(ORDER["properties"]) and obj["size"] in ("S", "M", "L")
    assert isinstance(obj["count"], int) and 1 <= obj["count"] <= 99 and isinstance(obj["price"], (int, float))
    assert len(obj["customer"]) <= 12 and len(obj["tags"]) <= 3 and all(len(t) <= 8 for t in obj["tags"])
    assert text.startswith('{"customer": "')  # the separators models saw in training (shared.text.grammar.JSON_STYLE)


def test_without_the_mask_random_logits_give_no_json(files):
    """The control: the same draws without the grammar are not JSON (so the test above tests the mask)."""
    tok = files.tokenizer
    logits = torch.randn(40, tok.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    tokens = sample(logits, [SamplingParams(temperature=1.0, seed=1)] * 40, list(range(40))).tokens
    with pytest.raises(ValueError):
        json.loads(tok.decode(tokens))


def test_grammars_compile_once_and_bad_schemas_are_named(files):
    grammars = files.grammars
    g = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    before = grammars.cached
    a, b = grammars.matcher(g), grammars.matcher(g)
    assert grammars.cached == before + 1 and a is not b  # one compile, two independent matchers
    assert a.consume(files.tokenizer.encode("{")[0]) and b.allowed() != a.allowed()
    with pytest.raises(GrammarError, match="nope"):
        grammars.matcher(json_schema_grammar({"type": "nope"}))
    with pytest.raises(GrammarError, match="/defs/missing"):
        grammars.matcher(json_schema_grammar({"properties": {"x": {"$ref": "#/defs/missing"}}}))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_under_random_logits_parses_and_has_every_required_argument(files, choice):
    for seed in range(2):
        text, reason = constrained_run(files, forced_call_schema(TOOLS, choice), seed)
        parser = ToolCallParser(forced=True)
        events = []
        for k in range(0, len(text), 3):  # streamed in pieces
            events += parser.push(text[k:k + 3])
        events += parser.finish()
        (call,) = parser.calls
        args = json.loads(call["function"]["arguments"])
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        assert set(fn["parameters"]["required"]) <= set(args)
        if isinstance(choice, dict):
            assert call["function"]["name"] == "add"
        assert "".join(e.fragment for e in events if isinstance(e, ArgumentsDelta)) == call["function"]["arguments"]
        assert isinstance(events[0], CallStarted) and events[0].name == call["function"]["name"]


def test_tagged_calls_are_parsed_out_of_streamed_text_and_content_before_them_kept():
    text = f'Let me check.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "unit": "C"}}}}\n' \
           f'</tool_call>\n{CALL_OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>'
    for step in (1, 4, len(text)):
        parser = ToolCallParser(forced=False)
        events = []
        for k in range(0, len(text), step):
            events += parser.push(text[k:k + step])
        events += parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert content == "Let me check.\n"  # "<tool_c..." was held back, never shown
        assert [c["function"]["name"] for c in parser.calls] == ["get_weather", "add"]
        assert json.loads(parser.calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    plain = ToolCallParser(forced=False)
    assert plain.push("a < b and <tool") == [ContentDelta("a < b and ")]
    assert plain.finish() == [ContentDelta("<tool")] and plain.calls == []  # never a call: shown at the end


def test_tools_calls_and_results_render_into_plain_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = tool_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                          {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": "3", "tool_call_id": "c1"},
                          {"role": "tool", "content": "three", "tool_call_id": "c1"}], TOOLS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == f'{CALL_OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\nthree\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in msgs)
