"""The Anthropic Messages API (issue 57 item 4): the translation and the event shaping alone, then the official
`anthropic` SDK against one real `stagemesh up` (1 stage, SmolLM2; the one test_openai_api and test_responses_api
share): create, stream, tool use and its result, count_tokens, bad input; greedy text equal to chat completions'; and
x-api-key or a bearer token on the gateway with an API key test_gateway_edge shares (tests/conftest.py's edge)."""

import json

import aiohttp
import pytest

from services.gateway.api.anthropic import MessageShape, message, translate
from services.gateway.engine.request import Request
from services.gateway.frontend.events import RequestHandle
from services.gateway.frontend.output import DoneEvent, ErrorEvent, TokenEvent, Usage
from services.gateway.frontend.schemas import GenerationSpec, RequestError, parse_generation
from tests.conftest import EDGE_KEY, lazy_import

anthropic = lazy_import("anthropic")
openai = lazy_import("openai")

KEY = "unused"  # the module's gateway has no API key: the SDK sends one anyway (the key tests use edge's)
MODEL = "smollm2"  # the name the module's up serves SmolLM2 under
VOCAB = 49152
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two numbers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}


def body(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": ASK, **kw}


def refused(b: dict, status: int = 400) -> RequestError:
    """The error a Messages body gets, from the translation or from the chat path it runs down (its fields named as
    this API's)."""
    with pytest.raises(RequestError) as e:
        t = translate(b, MODEL)
        try:
            parse_generation(t.body, True, 8192, VOCAB)
        except RequestError as inner:
            raise inner.named(t.name) from None
    assert e.value.status == status, e.value.message
    return e.value


# ---- the translation: what a Messages request means on the chat path ------------------------------------------------

def test_a_conversation_with_tools_becomes_the_chat_request_it_means():
    b = body(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
             tools=[WEATHER], tool_choice={"type": "auto"}, stop_sequences=["\n\n"], temperature=0,
             metadata={"user_id": "u1"}, messages=ASK + [
                 {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {"city": "Paris", "unit": "C"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18"},
                                              {"type": "text", "text": "And tomorrow?"}]}])
    spec = parse_generation(translate(b, MODEL).body, True, 8192, VOCAB)
    assert [(m["role"], m["content"]) for m in spec.messages] == [
        ("system", "Be brief."), ("user", ASK[0]["content"]), ("assistant", "Let me look."), ("tool", "18"),
        ("user", "And tomorrow?")]
    (call,) = spec.messages[2]["tool_calls"]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert spec.messages[3]["tool_call_id"] == "toolu_1"
    assert spec.tools[0]["function"]["parameters"] == WEATHER["input_schema"] and spec.tool_choice == "auto"
    assert spec.stop == ["\n\n"] and spec.sampling.temperature == 0 and spec.cache_tenant == "user:u1"


def test_consecutive_turns_of_one_role_are_one_turn_as_anthropic_combines_them():
    b = body(messages=[{"role": "user", "content": "First part."}, {"role": "user", "content": [
        {"type": "text", "text": "Second part."}]}, {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": [{"type": "text", "text": "Two."}, {"type": "tool_use", "id": "toolu_2",
                                                                            "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "18"}]},
        {"role": "user", "content": "Thanks."}], tools=[WEATHER])
    spec = parse_generation(translate(b, MODEL).body, True, 8192, VOCAB)
    assert [(m["role"], m["content"]) for m in spec.messages] == [
        ("user", "First part.\n\nSecond part."), ("assistant", "One.\n\nTwo."), ("tool", "18"), ("user", "Thanks.")]
    assert spec.messages[1]["tool_calls"][0]["id"] == "toolu_2"


@pytest.mark.parametrize("choice,internal", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                             ({"type": "tool", "name": "add"},
                                              {"type": "function", "function": {"name": "add"}})])
def test_tool_choice_maps_onto_the_chat_paths(choice, internal):
    spec = parse_generation(translate(body(tools=[WEATHER, ADD], tool_choice=choice), MODEL).body, True, 8192, VOCAB)
    assert spec.tool_choice == internal
    spec = parse_generation(translate(body(tools=[WEATHER], tool_choice={"type": "none"}), MODEL).body, True, 8192,
                            VOCAB)
    assert spec.tools is None  # the model neither sees nor calls them


def test_a_last_assistant_message_is_a_prefill_the_answer_continues():
    b = body(messages=ASK + [{"role": "assistant", "content": "The weather in Paris is"}])
    assert parse_generation(translate(b, MODEL).body, True, 8192, VOCAB).continue_final
    assert refused(body(messages=ASK + [{"role": "assistant", "content": "It is "}])).param == "messages[1].content"


@pytest.mark.parametrize("b,param,needle", [
    ({"model": MODEL, "messages": ASK}, "max_tokens", "'max_tokens' is required"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role", "top-level 'system'"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]),
     "messages[0].content[0]", "image"),
    (body(tools=[{**WEATHER, "input_schema": {"type": "string"}}]), "tools[0].input_schema", "object"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema", "required"),
    (body(tools=[{**WEATHER, "name": "bad name"}]), "tools[0].name", "tools[0].name"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type", "server tool"),
    (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "add"}), "tool_choice.name", "get_weather"),
    (body(temperature=1.5), "temperature", "between 0 and 1"),
    (body(stop_sequences="x"), "stop_sequences", "list"),
    (body(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences", "'stop_sequences'"),
    (body(metadata={"user_id": ""}), "metadata.user_id", "'metadata.user_id'"),
    (body(metadata={"tenant": "x"}), "metadata", "user_id"),
    (body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking", "not supported"),
    (body(frobnicate=1), "frobnicate", "'frobnicate'"),
    (body(max_tokens=0), "max_tokens", "'max_tokens'"),
    (body(top_p=2), "top_p", "'top_p'"),
    (body(messages=[]), "messages", "non-empty"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type", "assistant"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]),
     "messages[0].content[0].tool_use_id", "nope"),
    (body(messages=[{"role": "user", "content": "a\ud800b"}]), "messages[0].content", "surrogate"),
    (body(messages=ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}], tools=[WEATHER]),
     "messages[1].content", "messages[1].content[0] calls 'add'"),
])
def test_bad_input_is_a_400_naming_the_field_as_sent(b, param, needle):
    err = refused(b)
    assert err.param == param and needle in err.message, (err.param, err.message)
    assert err.anthropic_body()["error"]["type"] == "invalid_request_error"


def test_another_model_is_a_404_not_found():
    err = refused(body(model="claude-sonnet-4-5"), status=404)
    assert err.anthropic_body() == {"type": "error", "error": {"type": "not_found_error", "message": err.message}}
    assert MODEL in err.message


def test_count_tokens_reads_only_what_makes_the_prompt():
    translate({"model": MODEL, "messages": ASK, "tools": [WEATHER]}, MODEL, count=True)
    with pytest.raises(RequestError) as e:
        translate({"model": MODEL, "messages": ASK, "max_tokens": 5}, MODEL, count=True)
    assert e.value.param == "max_tokens" and "count_tokens" in e.value.message


# ---- the shaping: client events -> Anthropic's stream events and message ---------------------------------------------

def _shape(tools: bool = False, forced: bool = False) -> MessageShape:
    spec = GenerationSpec(messages=ASK, tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}]
                          if tools else None, tool_choice="required" if forced else "auto" if tools else "none")
    seq = Request(seq_id="s1", prompt_ids=[1, 2, 3], max_tokens=8)
    return MessageShape(RequestHandle(seq, spec, None), MODEL)


def _done(reason: str, stop: str | None = None, cached: int = 0) -> DoneEvent:
    return DoneEvent(reason, Usage(prompt_tokens=3, cached_tokens=cached, completion_tokens=2), {}, stop_string=stop)


def _run(shape: MessageShape, texts: list[str], done) -> list[tuple[str, dict]]:
    events = shape.start()
    for i, t in enumerate(texts):
        events += shape.events(TokenEvent(i, t, i, None))
    return events + shape.events(done)


def test_text_streams_as_one_block_between_message_start_and_stop():
    events = _run(_shape(), ["Hel", "", "lo"], _done("stop", "\n", cached=2))
    assert [n for n, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 3, "cache_read_input_tokens": 0, "output_tokens": 0}
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n"}
    assert final["usage"] == {"input_tokens": 1, "cache_read_input_tokens": 2, "output_tokens": 2}
    msg = message(events)
    assert msg["id"] == "msg_s1" and msg["content"] == [{"type": "text", "text": "Hello"}]
    assert msg["stop_reason"] == "stop_sequence" and msg["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("reason,want", [("stop", "end_turn"), ("length", "max_tokens")])
def test_stop_reasons(reason, want):
    assert message(_run(_shape(), ["x"], _done(reason)))["stop_reason"] == want


def test_a_forced_call_streams_as_a_tool_use_block_of_json_deltas():
    events = _run(_shape(tools=True, forced=True), ['{"name": "add", "arg', 'uments": {"a": 1, ', '"b": 2}}'],
                  _done("stop"))
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names.count("content_block_stop") == 1
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "add" and block["id"].startswith("toolu_")
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in deltas)) == {"a": 1, "b": 2}
    msg = message(events)
    assert msg["content"] == [{**block, "input": {"a": 1, "b": 2}}] and msg["stop_reason"] == "tool_use"


def test_text_then_a_tagged_call_are_two_blocks_and_a_cut_call_is_left_out_of_the_message():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    msg = message(_run(_shape(tools=True), ["Adding.\n", call], _done("stop")))
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"] and msg["stop_reason"] == "tool_use"
    assert msg["content"][1]["input"] == {"a": 1, "b": 2}
    cut = message(_run(_shape(tools=True, forced=True), ['{"name": "add", "arguments": {"a": 1'], _done("length")))
    assert cut["content"] == [{"type": "text", "text": ""}] and cut["stop_reason"] == "max_tokens"


def test_an_error_event_is_an_anthropic_error_event():
    ((name, data),) = _shape().events(ErrorEvent("timeout", "the request ran past its deadline"))
    assert name == "error" and data == {"type": "error", "error": {"type": "timeout_error",
                                                                   "message": "the request ran past its deadline"}}


# ---- the official SDK against a real mesh ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gateway(smollm2_gateway):  # the up test_openai_api and test_responses_api share (tests/conftest.py)
    return smollm2_gateway


@pytest.fixture
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0)


@pytest.fixture
def chat(openai_client):
    return openai_client


GREEDY = {"extra_body": {"temperature": 0}}  # the SDK's typed create no longer lists the sampling fields
CONVERSATION = {"system": "You are a helpful assistant.",
                "messages": [{"role": "user", "content": "Name three colours."},
                             {"role": "assistant", "content": "Red, green and blue."},
                             {"role": "user", "content": "Name three more."}]}
AS_CHAT = [{"role": "system", "content": CONVERSATION["system"]}, *CONVERSATION["messages"]]


def test_greedy_text_equals_chat_completions_and_streaming_says_the_same(client, chat):
    c = chat.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=AS_CHAT)
    r = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, **CONVERSATION)
    (block,) = r.content
    assert block.type == "text" and block.text == c.choices[0].message.content and block.text
    assert r.id.startswith("msg_") and r.role == "assistant" and r.model == MODEL
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert r.usage.cache_read_input_tokens > 0  # the same conversation twice: chat's request found it cached

    with client.messages.stream(model=MODEL, max_tokens=24, **GREEDY, **CONVERSATION) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == block.text
    assert final.content[0].text == block.text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens and final.id != r.id


def test_a_stop_sequence_ends_the_text_before_it_and_is_reported(client):
    r = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, **CONVERSATION)
    text = r.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.messages.create(model=MODEL, max_tokens=24, stop_sequences=[stop], **GREEDY, **CONVERSATION)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


async def test_the_raw_stream_is_anthropics_events_in_order(gateway):
    async with aiohttp.ClientSession() as s, s.post(gateway.url + "/v1/messages", headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01"}, json=body(stream=True, temperature=0)) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in raw.strip().split("\n\n")]
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[-2][1]["usage"]["output_tokens"] == 8 and events[-2][1]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"])
def test_tool_use_round_trip(client, choice):
    kw = {"model": MODEL, "max_tokens": 80, **GREEDY, "tools": [WEATHER, ADD], "tool_choice": choice}
    r = client.messages.create(messages=ASK, **kw)
    (use,) = r.content
    assert r.stop_reason == "tool_use" and use.type == "tool_use" and use.id.startswith("toolu_")
    schema = (WEATHER if use.name == "get_weather" else ADD)["input_schema"]
    assert isinstance(use.input, dict) and set(schema["required"]) <= set(use.input)
    if use.name == "get_weather":
        assert use.input["unit"] in ("C", "F") and isinstance(use.input["city"], str)
    if choice["type"] == "tool":
        assert use.name == "get_weather"

    with client.messages.stream(messages=ASK, **kw) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert len(deltas) > 1 and json.loads("".join(deltas)) == use.input  # greedy: the same call, in fragments
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"

    history = ASK + [{"role": "assistant", "content": r.content},  # the SDK's blocks, sent back as they came
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 C and sunny"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, tools=[WEATHER, ADD], messages=history)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:  # a result must answer a call the history made
        client.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=history[:1] + [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert "messages[1].content[0]" in e.value.message and "toolu_nope" in e.value.message


def test_count_tokens_is_the_prompt_a_real_request_has(client, chat):
    counted = client.messages.count_tokens(model=MODEL, **CONVERSATION)
    c = chat.chat.completions.create(model=MODEL, max_tokens=1, messages=AS_CHAT)
    assert counted.input_tokens == c.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model=MODEL, tools=[WEATHER], **CONVERSATION)
    r = client.messages.create(model=MODEL, max_tokens=1, tools=[WEATHER], **CONVERSATION)
    assert with_tools.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens > counted.input_tokens


def test_the_api_key_goes_in_x_api_key_or_bearer(edge):
    keyed = anthropic.Anthropic(base_url=edge.url, api_key=EDGE_KEY, max_retries=0)
    assert keyed.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=edge.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]
    bearer = anthropic.Anthropic(base_url=edge.url, auth_token=EDGE_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    with pytest.raises(openai.AuthenticationError):  # the OpenAI routes: the same key check, OpenAI's shape
        openai.OpenAI(base_url=edge.url + "/v1", api_key="wrong", max_retries=0).models.list()
    status, _ = edge.get("/v1/models")
    assert status == 401


async def test_x_api_key_opens_the_openai_routes_too(edge):
    async with aiohttp.ClientSession() as s, s.get(edge.url + "/v1/models", headers={"x-api-key": EDGE_KEY}) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL


@pytest.mark.parametrize("b,param", [
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     "messages[0].content[1]"),
    (body(tools=[{**WEATHER, "input_schema": {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}}]),
     "tools[0].input_schema"),
], ids=["no-max-tokens", "bad-role", "image", "bad-tool-schema"])
def test_sdk_bad_input_is_a_400_in_anthropics_shape_naming_the_field(client, b, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body=b)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and param in e.value.body["error"]["message"]


def test_sdk_unknown_model_is_not_found_and_the_edge_speaks_anthropic(client, gateway):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="gpt-7-local", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and MODEL in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # not JSON: refused at the edge, in this API's shape
        client.post("/v1/messages", cast_to=object, body=None, options={"headers": {"Content-Type": "application/json"}},
                    content=b"{not json")
    assert e.value.body["type"] == "error" and "not valid JSON" in e.value.body["error"]["message"]


async def test_a_messages_stream_is_not_resumed_and_a_last_event_id_says_so(gateway):
    """Issue 69 item 11: a Messages stream has no event ids and is not resumed; a client reconnecting with
    Last-Event-ID (an EventSource does) gets a 400 naming the header, not a fresh answer it would take for the rest."""
    async with aiohttp.ClientSession() as s, s.post(gateway.url + "/v1/messages", headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01", "Last-Event-ID": "3"},
            json=body(stream=True, temperature=0)) as resp:
        error = await resp.json()
    assert resp.status == 400 and error["type"] == "error", error
    assert "Last-Event-ID" in error["error"]["message"] and "not resumed" in error["error"]["message"], error
