"""OpenAI's Responses API (issue 57, item 2): `POST /v1/responses` translated onto the chat path, its stream events
numbered by sequence_number, stored responses read back, resumed `starting_after` N, cancelled, deleted and chained
by `previous_response_id`. The request validator, the store and the event shape alone, then the real `openai` SDK
against one real `stagemesh up` (1 stage, SmolLM2), the one test_openai_api and test_anthropic_api share
(tests/conftest.py's smollm2_gateway)."""

import asyncio
import json
import os
import sqlite3
import time
import uuid
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, Field

from services.gateway.api.response_store import MemoryResponseStore, StoredResponse
from services.gateway.api.responses import ResponseShape, add_responses_api, parse_request
from services.gateway.engine.request import Request
from services.gateway.frontend import durable
from services.gateway.frontend.events import EventLog, RequestHandle, RequestRegistry
from services.gateway.frontend.frontend import GATEWAY
from services.gateway.frontend.output import DoneEvent, ErrorEvent, TokenEvent, Usage
from services.gateway.frontend.schemas import GenerationSpec, RequestError, parse_generation
from tests.conftest import DEFAULT_MAX_TOKENS as CAP
from tests.conftest import lazy_import
from tests.test_events import FrontEnd

openai = lazy_import("openai")

VOCAB = 49152  # SmolLM2's
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]
CALL_WEATHER = {"type": "function", "name": "get_weather"}


def no_previous(pid: str) -> list[dict]:
    raise AssertionError(f"asked for {pid}")


def refused(body: dict, previous=no_previous) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_request(body, previous)
    assert e.value.status == 400
    return e.value


# ---- the request, validated at the edge and translated to a chat request (no processes) -----------------------

def test_input_items_become_the_chat_conversation_the_answer_continues():
    prior = [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Sure."}]
    req = parse_request({
        "model": "m", "instructions": "Be brief.", "previous_response_id": "resp_1", "input": [
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                            {"type": "input_text", "text": "in Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
             "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'}],
        "tools": TOOLS, "max_output_tokens": 9, "text": {"format": {"type": "json_object"}}, "tool_choice": "none",
    }, lambda pid: prior if pid == "resp_1" else no_previous(pid))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert req.messages == [*prior, {"role": "system", "content": "Use metric units."},
                            {"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    assert req.chat_body["messages"] == [{"role": "system", "content": "Be brief."}, *req.messages]
    assert req.origins == ["instructions", "previous_response_id", "previous_response_id", "input[0]", "input[1]",
                           "input[2]", "input[4]"]
    assert (req.chat_body["max_tokens"], req.chat_body["response_format"]) == (9, {"type": "json_object"})
    assert req.chat_body["tools"] == [{"type": "function", "function": {k: TOOLS[0][k] for k in
                                                                        ("name", "description", "parameters")}}]
    assert req.store and not req.background and not req.stream
    spec = parse_generation(req.chat_body, True, 8192, VOCAB)  # the chat path takes it as it is
    assert spec.max_tokens == 9 and spec.tools is None  # tool_choice none: the tools stay out of the prompt


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": [1]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "me"}]}, "input[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}], "tools": TOOLS},
     "input[0].name"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{**TOOLS[0], "function": {}}]}, "tools[0].function"),
    ({"input": "hi", "tools": [{**TOOLS[0], "name": "bad name"}]}, "tools[0].name"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": 3}}}, "text.format.schema"),
    ({"input": "hi", "text": {"verbosity": "high"}}, "text.verbosity"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "hi", "previous_response_id": 7}, "previous_response_id"),
])
def test_bad_input_is_a_400_naming_the_field(body, param):
    assert refused(body).param == param


ODD_VALUES = [None, True, 0, -1, 1.5, "", "x", [], ["x"], [[]], [None], {}, {"type": ["x"]}, {"a": []}, "\ud800"]
ITEM = {"type": "message", "role": "user", "content": "hi"}


def test_no_value_in_any_field_is_anything_but_accepted_or_a_400():
    """Every top-level field, every field of an input item, of a content part, of a tool, of text.format: each odd
    value either parses or is a RequestError -- never another exception (a 500)."""
    from services.gateway.api.responses import READ_FIELDS

    bodies = [{"input": "hi", key: v} for key in READ_FIELDS for v in ODD_VALUES]
    bodies += [{"input": [{**ITEM, key: v}]} for key in ("type", "role", "content", "id") for v in ODD_VALUES]
    bodies += [{"input": [{**ITEM, "content": [{"type": "input_text", "text": "a", key: v}]}]}
               for key in ("type", "text", "annotations") for v in ODD_VALUES]
    bodies += [{"input": [{"type": kind, "call_id": "c", "name": "get_weather", "arguments": "{}", "output": "o",
                           key: v}]} for kind in ("function_call", "function_call_output")
               for key in ("call_id", "name", "arguments", "output") for v in ODD_VALUES]
    bodies += [{"input": "hi", "tools": [{**TOOLS[0], key: v}]} for key in ("type", "name", "parameters")
               for v in ODD_VALUES]
    bodies += [{"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": v}} for v in ODD_VALUES]
    bodies += [{"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, key: v}}}
               for key in ("type", "name", "schema", "strict") for v in ODD_VALUES]
    for body in bodies:
        try:
            req = parse_request(body, lambda pid: [])
            parse_generation(req.chat_body, True, 8192, VOCAB)
        except RequestError as e:
            assert e.status == 400 and (e.param is None or isinstance(e.param, str)), body


@pytest.mark.parametrize("body,param,word", [
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"tools": [{**TOOLS[0], "parameters": {"type": "array"}}]}, "tools[0].parameters", "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "loop", "schema": {"$ref": "#"}}}}, "text.format.schema",
     "'text.format.schema'"),
    ({"tools": TOOLS, "tool_choice": "auto", "text": {"format": {"type": "json_object"}}}, "text.format",
     "'text.format'"),
])
def test_the_chat_paths_refusals_name_this_endpoints_fields(body, param, word):
    req = parse_request({"input": "hi", **body}, no_previous)
    with pytest.raises(RequestError) as e:
        parse_generation(req.chat_body, True, 8192, VOCAB)
    renamed = e.value.named(req.name)
    assert renamed.param == param and word in renamed.message and "function" not in renamed.param


def test_a_message_refused_by_the_chat_path_is_named_by_its_input_item():
    req = parse_request({"instructions": "x", "input": [{"role": "user", "content": "a"},
                                                        {"role": "user", "content": "b"}]}, no_previous)
    with pytest.raises(RequestError) as e:  # the chat path's own refusal of messages[2] (instructions are [0])
        parse_generation({**req.chat_body, "messages": [*req.chat_body["messages"][:2],
                                                        {"role": "user", "content": "b\ud800"}]}, True, 8192, VOCAB)
    err = e.value.named(req.name)
    assert e.value.param == "messages[2].content" and "'messages[2].content'" in e.value.message
    assert err.param == "input[1].content" and err.message.startswith("'input[1].content' holds an unpaired")
    assert RequestError("the prompt is too long", "messages").named(req.name).param == "input"


# ---- the store's bounds (no processes) ---------------------------------------------------------------------------

def stored(rid: str, ended_s_ago: float | None) -> StoredResponse:
    """A response that ended `ended_s_ago` seconds ago (settled), or None: one still running (its log open)."""
    record = StoredResponse(rid, 0, {}, [])
    if ended_s_ago is None:
        record.handle = RequestHandle(Request(seq_id=rid.removeprefix("resp_"), prompt_ids=[1]), GenerationSpec(),
                                      processor=None)
    else:
        record.final, record.ended_at = {"id": rid}, time.monotonic() - ended_s_ago
    return record


def test_the_store_keeps_running_responses_and_the_newest_ended_within_its_age():
    store = MemoryResponseStore(max_count=3, ttl_s=60)
    for rid, ago in (("resp_old", 30), ("resp_run1", None), ("resp_mid", 20), ("resp_run2", None), ("resp_new", 10)):
        store.save(stored(rid, ago))
    # 5 records, 3 allowed: the two oldest ended ones go; running ones are never dropped
    assert [rid for rid in ("resp_old", "resp_run1", "resp_mid", "resp_run2", "resp_new") if store.get(rid)] == \
        ["resp_run1", "resp_run2", "resp_new"]
    store.save(stored("resp_stale", 61))
    assert store.get("resp_stale") is None and len(store) == 3  # past its age
    assert store.delete("resp_new") and not store.delete("resp_new") and store.get("resp_new") is None


# ---- the stream events, made from a request's event log (no processes) ---------------------------------------------

USAGE = Usage(prompt_tokens=7, cached_tokens=0, completion_tokens=3)


def shape_of(log: EventLog, spec: GenerationSpec, background: bool = False) -> tuple[list[dict], dict]:
    shape = ResponseShape(StoredResponse("resp_abc", 1, {"model": "m"}, [], background), spec)
    events = shape.start()
    for ev in log.events:
        events += shape.push(ev)
    return events, shape.response()


def test_every_reading_of_a_log_makes_the_same_numbered_events():
    log = EventLog()
    for i, text in enumerate(["Hel", "", "lo"]):
        log.append(TokenEvent(i, text, i, None))
    log.append(DoneEvent("length", USAGE, {}))
    events, response = shape_of(log, GenerationSpec())
    assert (events, response) == shape_of(log, GenerationSpec())  # ids and numbers come from the response, not chance
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    (message,) = response["output"]
    assert message["content"][0]["text"] == "Hello" and message["status"] == "incomplete"
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 3
    background, _ = shape_of(log, GenerationSpec(), background=True)
    assert background[0]["response"]["status"] == "queued"


def test_a_forced_call_streams_its_arguments_and_a_failure_ends_the_stream_failed():
    spec = GenerationSpec(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    log = EventLog()
    for i, text in enumerate(['{"name": "get_weather", "arguments": ', '{"city": ', '"Paris"}', "}"]):
        log.append(TokenEvent(i, text, i, None))
    log.append(DoneEvent("stop", USAGE, {}))
    events, response = shape_of(log, spec)
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    (call,) = response["output"]
    assert json.loads(deltas) == json.loads(call["arguments"]) == {"city": "Paris"}
    assert (call["type"], call["name"], call["call_id"], call["status"]) == \
        ("function_call", "get_weather", "call_abc_0", "completed")
    failing = EventLog()
    failing.append(TokenEvent(0, "Hi", 0, None))
    failing.append(ErrorEvent("timeout", "the request exceeded its deadline"))
    events, response = shape_of(failing, GenerationSpec())
    assert events[-1]["type"] == "response.failed" and response["error"]["code"] == "timeout"
    assert response["output"][0]["content"][0]["text"] == "Hi"


# ---- through the real SDK, against a real gateway and stage ------------------------------------------------------

@pytest.fixture(scope="module")
def gateway(smollm2_gateway):  # the up test_openai_api and test_anthropic_api share (tests/conftest.py)
    return smollm2_gateway


@pytest.fixture
def client(openai_client):
    return openai_client


def scope() -> str:
    """A prefix-cache scope of its own: the request prefills in full, and reports cached tokens only of its own."""
    return f"t-{uuid.uuid4().hex[:12]}"


def test_create_answers_as_chat_completions_does_for_the_same_conversation(client):
    ask = "Name three colours."
    key = scope()  # the response is its tenant's: read back with the same key
    r = client.responses.create(model="smollm2", instructions="Answer briefly.", input=ask, max_output_tokens=12,
                                temperature=0, prompt_cache_key=key)
    c = client.chat.completions.create(model="smollm2", messages=[{"role": "system", "content": "Answer briefly."},
                                                                  {"role": "user", "content": ask}],
                                       max_tokens=12, temperature=0, prompt_cache_key=scope())
    assert r.output_text and r.output_text == c.choices[0].message.content  # greedy: the same tokens
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smollm2"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    stored = client.responses.retrieve(r.id, extra_query={"prompt_cache_key": key})  # store defaults to true
    assert stored.model_dump() == r.model_dump()


def test_a_stream_sends_the_sdks_events_in_order_with_consecutive_sequence_numbers(client):
    ask = {"model": "smollm2", "input": "Say hello in one word.", "max_output_tokens": 40, "temperature": 0}
    # each of the three in a cache scope of its own: each prefills in full, so greedy gives the same tokens (a cache
    # hit's last prompt row, computed alone, may take another kernel than in the full prefill: prefix-cache.md)
    with client.responses.stream(**ask, prompt_cache_key=scope()) as stream:
        events = list(stream)
        final = stream.get_final_response()  # raises unless response.completed came
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"] and n > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text and final.status == "completed"
    raw = list(client.responses.create(**ask, stream=True, prompt_cache_key=scope()))  # without the helper
    assert [e.type for e in raw] == kinds and "".join(e.delta for e in raw if e.type.endswith("text.delta")) == text
    assert client.responses.create(**ask, prompt_cache_key=scope()).output_text == text


def test_a_function_call_round_trip_by_previous_response_id_and_by_items(client):
    ask = "What is the weather in Paris?"
    r1 = client.responses.create(model="smollm2", input=ask, tools=TOOLS, tool_choice=CALL_WEATHER, temperature=0,
                                 max_output_tokens=40)
    (call,) = r1.output
    assert (call.type, call.name, r1.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 21})}
    chained = client.responses.create(model="smollm2", previous_response_id=r1.id, input=[result], tools=TOOLS,
                                      temperature=0, max_output_tokens=CAP)
    # the SDK's own loop: the earlier input, the response's output items as they came, the call's result
    by_items = client.responses.create(model="smollm2", input=[{"role": "user", "content": ask}, *r1.output, result],
                                       tools=TOOLS, temperature=0, max_output_tokens=CAP)
    assert chained.output[0].type == "message" and chained.output_text == by_items.output_text
    assert chained.usage.input_tokens == by_items.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as e:  # a result for a call nobody made
        client.responses.create(model="smollm2", previous_response_id=r1.id, tools=TOOLS, max_output_tokens=2,
                                input=[{**result, "call_id": "call_nobody_made"}])
    assert e.value.param == "input[0].call_id"


def test_a_streamed_call_sends_its_arguments_as_they_are_generated(client):
    with client.responses.stream(model="smollm2", input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                                 temperature=0, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (call,) = final.output
    assert len(deltas) > 1 and "".join(deltas) == events[-3].arguments == call.arguments
    assert "city" in json.loads(call.arguments)


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    colour: str = Field(pattern="^(red|green|yellow)$")


def test_text_format_json_schema_gives_json_that_follows_it(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "colour": {"enum": ["red", "green", "yellow"]}},
              "required": ["name", "colour"], "additionalProperties": False}
    ask = {"model": "smollm2", "input": "Describe one fruit.", "max_output_tokens": 30, "temperature": 0}
    r = client.responses.create(**ask, text={"format": {"type": "json_schema", "name": "fruit", "schema": schema,
                                                        "strict": True}})
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "colour"} and obj["colour"] in ("red", "green", "yellow")
    assert r.text.format.type == "json_schema" and r.text.format.name == "fruit"
    with pytest.raises(ValueError):  # the same request's free text is no JSON: the format did the work
        json.loads(client.responses.create(**ask).output_text)
    parsed = client.responses.parse(**ask, text_format=Fruit).output_parsed
    assert isinstance(parsed, Fruit) and parsed.colour in ("red", "green", "yellow")
    assert isinstance(json.loads(client.responses.create(**ask, text={"format": {"type": "json_object"}}).output_text),
                      dict)


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client):
    system = "You are a careful assistant who answers in plain English. " * 6
    key = scope()
    r1 = client.responses.create(model="smollm2", instructions=system, input="Name a colour of the sky.",
                                 max_output_tokens=12, temperature=0, prompt_cache_key=key)
    r2 = client.responses.create(model="smollm2", instructions=system, previous_response_id=r1.id,
                                 input="And at night?", max_output_tokens=4, temperature=0, prompt_cache_key=key)
    assert r1.usage.input_tokens_details.cached_tokens == 0 and r2.previous_response_id == r1.id
    cached = r2.usage.input_tokens_details.cached_tokens
    assert r1.usage.input_tokens - 16 < cached < r2.usage.input_tokens  # the first turn's prompt, in 16-token blocks
    chat = client.chat.completions.create(  # the conversation the chain stands for, sent whole
        model="smollm2", max_tokens=4, temperature=0, prompt_cache_key=scope(),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Name a colour of the sky."},
                  {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And at night?"}])
    assert chat.usage.prompt_tokens == r2.usage.input_tokens and chat.choices[0].message.content == r2.output_text


def test_a_background_response_is_retrieved_and_resumed_after_any_sequence_number(client):
    ask = {"model": "smollm2", "input": "Tell me a long story about a river.", "max_output_tokens": 24,
           "temperature": 0}
    key = scope()  # the response is its tenant's: every read names the same key
    mine = {"extra_query": {"prompt_cache_key": key}}
    r = client.responses.create(**ask, background=True, prompt_cache_key=key)
    assert (r.status, r.background, r.output) == ("queued", True, [])
    first = []
    with client.responses.retrieve(r.id, stream=True, **mine) as stream:  # read a few events, then drop the connection
        for ev in stream:
            first.append(ev)
            if len(first) == 5:
                break
    n = first[-1].sequence_number
    rest = list(client.responses.retrieve(r.id, stream=True, **mine, starting_after=n))
    whole = list(client.responses.retrieve(r.id, stream=True, **mine))  # later, from the start
    dump = [e.model_dump() for e in whole]
    assert [e.sequence_number for e in whole] == list(range(len(whole))) and whole[-1].type == "response.incomplete"
    assert [e.model_dump() for e in first] == dump[:n + 1] and [e.model_dump() for e in rest] == dump[n + 1:]
    final = client.responses.retrieve(r.id, **mine)
    assert final.model_dump() == whole[-1].response.model_dump() and final.usage.output_tokens == 24
    assert final.output_text == "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert final.output_text == client.responses.create(**ask, prompt_cache_key=scope()).output_text  # as if in front
    assert list(client.responses.retrieve(r.id, stream=True, **mine, starting_after=len(whole) - 1)) == []  # nothing after
    (past,) = list(client.responses.retrieve(r.id, stream=True, **mine, starting_after=len(whole) + 5))
    assert past.type == "error" and past.code == "cursor_out_of_range" and str(len(whole) - 1) in past.message


def wait_ended(client, rid: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{rid} still {r.status}"
        time.sleep(0.2)
    return r


def test_a_background_stream_outlives_its_connection_and_a_foreground_one_does_not(client):
    ask = {"model": "smollm2", "input": "Count from 1 to 300, separated by commas.", "temperature": 0}
    ids = {}
    for background in (True, False):
        stream = client.responses.create(**ask, background=background, stream=True, max_output_tokens=32)
        for ev in stream:
            if ev.type == "response.created":
                ids[background] = ev.response.id
            if ev.type == "response.output_text.delta":
                break
        stream.close()  # the connection drops mid-answer
    detached, foreground = (wait_ended(client, ids[b]) for b in (True, False))
    assert detached.status == "incomplete" and detached.usage.output_tokens == 32  # ran to its max_output_tokens
    assert foreground.status == "cancelled" and foreground.usage.output_tokens < 32


def test_cancel_ends_a_background_response_and_only_one(client):
    r = client.responses.create(model="smollm2", input="Count from 1 to 500, separated by commas.", background=True,
                                max_output_tokens=400, temperature=0)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 400
    assert client.responses.retrieve(r.id).status == "cancelled"
    last = list(client.responses.retrieve(r.id, stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    foreground = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(foreground.id)
    assert e.value.code == "not_cancellable"


def test_delete_forgets_a_response_and_store_false_never_keeps_one(client):
    r = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input="Hi", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.param == "previous_response_id"
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    assert unstored.status in ("completed", "incomplete") and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_sdks_bad_requests_are_400s_naming_the_field(client, gateway):
    cases = [({"temperature": 3}, "temperature"), ({"max_output_tokens": 0}, "max_output_tokens"),
             ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
             ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}},
              "text.format.schema"),
             ({"extra_body": {"frobnicate": 1}}, "frobnicate"), ({"background": True, "store": False}, "background"),
             ({"previous_response_id": "resp_never"}, "previous_response_id")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "smollm2", "input": "Hi", **kwargs})
        assert e.value.param == param and e.value.status_code == 400, kwargs
    r = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, metadata={"k": "v"})
    assert r.metadata == {"k": "v"}  # still serving; accepted fields echo


async def test_raw_http_errors_are_openai_shaped_never_a_500(gateway):
    async with aiohttp.ClientSession() as s:
        for body in (b"{nope", b"[1]", json.dumps({"input": [[]]}).encode(), json.dumps({"input": "\ud800"}).encode()):
            async with s.post(gateway.url + "/v1/responses", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error", body
        async with s.post(gateway.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1}) as r:
            rid = (await r.json())["id"]
        async with s.get(f"{gateway.url}/v1/responses/{rid}?stream=true&starting_after=x") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "starting_after"
        async with s.get(f"{gateway.url}/v1/responses/resp_{'0' * 16}") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
        async with s.get(f"{gateway.url}/v1/responses/{rid}?stream=true", headers={"Last-Event-ID": "1"}) as r:
            lines = (await r.text()).split("\n")  # an EventSource reconnecting: after the event id it last had
        assert "id: 2" in lines and "id: 1" not in lines and "event: response.output_item.added" in lines


async def test_a_stream_whose_log_is_no_longer_kept_says_so_and_the_response_stays(tiny_path):
    """In process: the real Gateway and engine computing on a tiny GGUF (tests/test_events.py's FrontEnd), keeping no
    ended request's log, and the Responses API's routes over real HTTP on loopback."""
    fe = FrontEnd(tiny_path)
    fe.gw.requests = RequestRegistry(keep_ended=0)  # an ended request's events are forgotten at once
    app = web.Application()
    app[GATEWAY] = fe.gw
    add_responses_api(app, MemoryResponseStore(max_count=8, ttl_s=60))
    async with TestClient(TestServer(app)) as http:
        posting = asyncio.create_task(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3}))
        deadline = time.monotonic() + 60
        while not posting.done():  # the engine computes what it sends, the handler runs in between
            assert time.monotonic() < deadline, "the response did not end"
            await fe.h.step()
            if fe.h.client.sent:
                fe.h.client.deliver()
            await asyncio.sleep(0.001)
        r = await posting
        assert r.status == 200
        response = await r.json()
        assert response["status"] in ("completed", "incomplete") and response["usage"]["output_tokens"] >= 1
        r = await http.get(f"/v1/responses/{response['id']}?stream=true&starting_after=3")
        text = await r.text()
        r = await http.get(f"/v1/responses/{response['id']}")
        assert await r.json() == response  # the object is kept longer than its events
    (event,) = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert event["type"] == "error" and event["code"] == "stream_expired" and "no longer kept" in event["message"]
    assert "\nid:" not in text  # not an event of the response: a reconnecting client keeps its cursor


# ---- what is deleted is gone (issue 69, item 1) --------------------------------------------------------------------

def _log_rows(gateway, request_id: str) -> int:
    """The rows the shared up's durable request log (its default --state-dir) holds for one request: read through
    SQLite itself, as anyone with access to the file would."""
    path = os.path.join(durable.default_state_dir(urlsplit(gateway.url).port), "requests.sqlite")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM requests WHERE id = ?", (request_id,)).fetchone()[0] + \
            db.execute("SELECT COUNT(*) FROM outputs WHERE id = ?", (request_id,)).fetchone()[0]
    finally:
        db.close()


async def _stream_status(s: aiohttp.ClientSession, gateway, stream_id: str) -> tuple[int, str]:
    async with s.get(f"{gateway.url}/v1/streams/{stream_id}") as r:
        return r.status, await r.text()


async def test_delete_and_store_false_forget_the_text_and_only_resumable_requests_replay(client, gateway):
    secret = "Account 55-1234-99 belongs to Dana. Repeat the account number."
    r = client.responses.create(model="smollm2", input=secret, background=True, max_output_tokens=4, temperature=0)
    rid = r.id.removeprefix("resp_")
    wait_ended(client, r.id)
    deadline = time.monotonic() + 10
    while _log_rows(gateway, rid) == 0:  # logged (a background response comes back after a restart)
        assert time.monotonic() < deadline, "the background response was never logged"
        await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as s:
        assert (await _stream_status(s, gateway, rid))[0] == 404  # not sent as resumable: not replayed there
        client.responses.delete(r.id)
        deadline = time.monotonic() + 5
        while _log_rows(gateway, rid):  # gone from the log at rest too (within a flush)
            assert time.monotonic() < deadline, "DELETE left the request's rows in the durable log"
            await asyncio.sleep(0.1)
        async with s.get(f"{gateway.url}/v1/responses/{r.id}?stream=true") as got:
            assert got.status == 404
        unstored = client.responses.create(model="smollm2", input=secret, max_output_tokens=2, store=False)
        plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": secret}],
                                               max_tokens=2)
        async with s.post(gateway.url + "/v1/messages", json={"model": "smollm2", "max_tokens": 2, "messages": [
                {"role": "user", "content": secret}]}, headers={"anthropic-version": "2023-06-01"}) as m:
            message = await m.json()
        for stream_id in (unstored.id.removeprefix("resp_"), plain.id, message["id"].removeprefix("msg_")):
            status, text = await _stream_status(s, gateway, stream_id)
            assert status == 404 and "Dana" not in text, (stream_id, status, text[:200])
        resumable = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, stream=True, extra_body={"resumable": True})
        sent = [c for c in resumable]
        status, text = await _stream_status(s, gateway, sent[0].id)
        assert status == 200 and text.endswith("data: [DONE]\n\n")  # what was sent as resumable replays


def test_a_stored_response_is_its_tenants_alone(client):
    """Issue 69 item 7: stored responses are scoped as the prefix cache's tenants are (`user`, `prompt_cache_key`):
    another tenant, or a request naming none, finds no such response -- to read, stream, chain, cancel or delete."""
    alice = client.responses.create(model="smollm2", input="The vault code is 4417. Say OK.", user="alice",
                                    background=True, max_output_tokens=300, temperature=0)
    as_alice, as_mallory = {"user": "alice"}, {"user": "mallory"}
    for scope in (as_mallory, {"prompt_cache_key": "alice"}, {}):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(alice.id, extra_query=scope)
        with pytest.raises(openai.NotFoundError):
            list(client.responses.retrieve(alice.id, stream=True, extra_query=scope))
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel(alice.id, extra_query=scope)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(alice.id, extra_query=scope)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="smollm2", input="And the code?", previous_response_id=alice.id,
                                    max_output_tokens=2, **scope)
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    assert client.responses.retrieve(alice.id, extra_query=as_alice).status in ("queued", "in_progress")
    assert client.responses.cancel(alice.id, extra_query=as_alice).status == "cancelled"
    chained = client.responses.create(model="smollm2", input="And the code?", previous_response_id=alice.id,
                                      max_output_tokens=2, user="alice")
    assert chained.status in ("completed", "incomplete")
    client.responses.delete(alice.id, extra_query=as_alice)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alice.id, extra_query=as_alice)


async def test_background_and_unread_resumable_work_is_bounded_per_user(client, gateway):
    """Issue 69 item 10: one client (its `user`) holds at most --max-detached-per-user (16) requests that run
    without a reader -- background responses, and resumable streams whose connection went -- and the next one is
    a 429 with Retry-After; another user is not held back, and a slot freed is a slot to use."""
    # ignore_eos: each runs its 600 tokens (a counting answer can end at EOS within a few tokens, and an ended request
    # holds nothing)
    user, ask = scope(), {"model": "smollm2", "input": "Count from 1 to 900.", "max_output_tokens": 600,
                          "extra_body": {"ignore_eos": True}}
    held = [client.responses.create(**ask, background=True, user=user) for _ in range(15)]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to 900."}], "max_tokens": 200,
            "stream": True, "resumable": True, "user": user, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gateway.url + "/v1/chat/completions", json=body) as r:
                await r.content.readline()  # its first event, then the connection drops: unread from here
            # the gateway sees the connection gone at the stream's next write (later if it waits in the queue of a
            # gateway other tests share): until then a 17th is taken, and cancelled here at once
            deadline = time.monotonic() + 60
            while True:
                try:
                    extra = client.responses.create(**ask, background=True, user=user)
                except openai.RateLimitError as e:
                    refused = e
                    break
                client.responses.cancel(extra.id, extra_query={"user": user})
                assert time.monotonic() < deadline, "the dropped resumable stream never counted as unattended"
                await asyncio.sleep(0.5)
            assert refused.code == "too_many_detached" and "--max-detached-per-user" in refused.message
            assert refused.response.headers["Retry-After"]
            async with s.post(gateway.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 429 and r.headers["Retry-After"]
            other = client.responses.create(**ask, background=True, user=scope())  # another client's own 16
            client.responses.cancel(other.id, extra_query={"user": other.user})
            client.responses.cancel(held.pop().id, extra_query={"user": user})
            held.append(client.responses.create(**ask, background=True, user=user))  # room again
    finally:
        for r in held:
            client.responses.cancel(r.id, extra_query={"user": user})
