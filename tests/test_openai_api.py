"""The OpenAI API as real clients use it (issue 30): every request field read, accepted-and-ignored, or refused with
a 400 naming it; `max_tokens` left out. The validator alone, then the real `openai` SDK against one real
`stagemesh up` (1 stage, SmolLM2) shared by the module."""

import asyncio
import json
import os
import time
from enum import Enum
from typing import Literal

import aiohttp
import pytest
from pydantic import BaseModel, Field

from services.gateway.frontend.schemas import IGNORED_FIELDS, NOT_YET_FIELDS, RequestError, parse_generation
from tests.conftest import DEFAULT_MAX_TOKENS, lazy_import

openai = lazy_import("openai")

CAP = DEFAULT_MAX_TOKENS  # the gateway's --default-max-tokens (the shared smollm2_gateway, tests/conftest.py)

VOCAB = 49152  # SmolLM2's, the model of the module's up
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"prompt": "Hi"}


def refused(body: dict, chat: bool) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_generation(body, chat, 8192, VOCAB)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("field,value", [("frobnicate", 1), ("temprature", 0.5), ("max_token", 5)])
def test_an_unknown_field_is_a_400_naming_it(chat, field, value):
    err = refused({**(CHAT if chat else COMPLETION), field: value}, chat)
    assert err.param == field and f"'{field}'" in err.message and err.code == "unknown_parameter"


@pytest.mark.parametrize("field,value", [("echo", True), ("best_of", 2),
                                         ("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("suffix", "end"), ("audio", {"voice": "x"})])
def test_a_known_field_not_implemented_yet_is_a_400_unless_neutral(field, value):
    err = refused({**CHAT, field: value}, True)
    assert err.param == field and err.code == "unsupported_parameter" and f"'{field}'" in err.message
    _, neutral, _ = NOT_YET_FIELDS[field]
    parse_generation({**CHAT, field: json.loads(neutral)}, True, 8192, VOCAB)  # the neutral value as the message writes it


def test_ignored_fields_are_accepted_with_their_type_checked():
    samples = {str: "someone", dict: {"k": "v"}, bool: True}
    for field, types in IGNORED_FIELDS.items():
        parse_generation({**CHAT, field: samples[types[0]]}, True, 8192, VOCAB)
        err = refused({**CHAT, field: 12345}, True)
        assert err.param == field


def test_null_is_left_out_and_fields_of_the_other_endpoint_are_named():
    spec = parse_generation({**CHAT, "presence_penalty": None, "frobnicate": None, "n": None}, True, 8192, VOCAB)
    assert spec.max_tokens is None
    assert refused({**CHAT, "prompt": "x"}, True).param == "prompt"
    assert refused({**COMPLETION, "max_completion_tokens": 3}, False).param == "max_completion_tokens"


@pytest.mark.parametrize("n", [2, 0, "1"])
def test_n_other_than_1_is_a_clear_400(n):
    err = refused({**CHAT, "n": n}, True)
    assert err.param == "n" and "parallel requests" in err.message


def test_min_p_is_read_and_range_checked():
    assert parse_generation({**CHAT, "min_p": 0.2}, True, 8192, VOCAB).sampling.min_p == 0.2
    assert refused({**CHAT, "min_p": 2}, True).param == "min_p"


def test_logit_bias_is_read_and_checked():
    spec = parse_generation({**CHAT, "logit_bias": {"42": 5, "7": -100.0}}, True, 8192, VOCAB)
    assert spec.sampling.logit_bias == ((7, -100.0), (42, 5.0))
    for bad in ({"-1": 5}, {str(VOCAB): 5}, {"x": 1}, {"42": 101}, {"42": True}, [42], {str(i): 1 for i in range(301)}):
        assert refused({**CHAT, "logit_bias": bad}, True).param == "logit_bias", bad


def test_completions_logprobs_integer_is_the_number_of_alternatives():
    for lp, top in ((0, 0), (True, 0), (2, 2), (5, 5)):
        spec = parse_generation({**COMPLETION, "logprobs": lp}, False, 8192, VOCAB)
        assert spec.logprobs is spec.sampling.logprobs is True and spec.sampling.top_logprobs == top
    spec = parse_generation({**COMPLETION, "logprobs": False}, False, 8192, VOCAB)
    assert spec.logprobs is False and spec.sampling.top_logprobs == 0
    for bad in (6, -1, 2.0, "2"):
        assert refused({**COMPLETION, "logprobs": bad}, False).param == "logprobs"
    assert refused({**CHAT, "logprobs": 1}, True).param == "logprobs"
    assert refused({**COMPLETION, "logprobs": 2, "top_logprobs": 2}, False).param == "top_logprobs"


def test_chat_top_logprobs_is_0_to_20_and_needs_logprobs():
    spec = parse_generation({**CHAT, "logprobs": True, "top_logprobs": 20}, True, 8192, VOCAB)
    assert spec.sampling.top_logprobs == 20 and spec.sampling.logprobs is True
    assert parse_generation({**CHAT, "top_logprobs": 0}, True, 8192, VOCAB).sampling.top_logprobs == 0
    for body in ({"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1},
                 {"logprobs": True, "top_logprobs": True}, {"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 3}):
        err = refused({**CHAT, **body}, True)
        assert err.param == "top_logprobs" and "'top_logprobs'" in err.message, body


@pytest.fixture(scope="module")
def gateway(smollm2_gateway):  # the up test_responses_api and test_anthropic_api share (tests/conftest.py)
    return smollm2_gateway


@pytest.fixture
def client(openai_client):
    return openai_client


def test_sdk_unknown_and_unsupported_parameters_are_400s_naming_them(client):
    msgs = [{"role": "user", "content": "Say hi."}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, extra_body={"frobnicate": 1})
    assert e.value.param == "frobnicate" and "frobnicate" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a known field not implemented yet, at another value than null
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, reasoning_effort="high")
    assert e.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, echo=True)
    assert e.value.param == "echo"
    # the gateway keeps serving, and fields that cannot change the output pass
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, user="u-1", store=False,
                                       metadata={"k": "v"}, presence_penalty=0, n=1)
    assert r.usage.completion_tokens >= 1


def test_the_next_turn_of_a_chat_reports_the_history_it_did_not_prefill_again(client, gateway):
    """A multi-turn chat through the SDK: the second turn's prompt starts with the first turn's (rendered by the
    chat template), so the stages start it from the first turn's cached K/V; the SDK reads how many tokens in
    usage.prompt_tokens_details.cached_tokens, as OpenAI reports them."""
    system = {"role": "system", "content": "You are a careful assistant who answers in plain English. " * 6}
    turn1 = [system, {"role": "user", "content": "Name a colour of the sky."}]
    r1 = client.chat.completions.create(model="smollm2", messages=turn1, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And at night?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens - 16 < cached < r2.usage.prompt_tokens and cached % 16 == 0
    assert gateway.metric("stagemesh_gateway_prefix_cache_reused_tokens_total") >= cached


def test_max_tokens_left_out_runs_to_the_servers_cap(client):
    r = client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", temperature=0, max_tokens=CAP + 3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == CAP + 3  # an explicit max_tokens is not capped


async def test_websocket_envelope_is_not_an_unknown_field_but_a_stray_one_is(gateway):
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway.url.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send_json({"type": "generate", "id": "a", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        await ws.send_json({"type": "generate", "id": "b", "prompt": "Hi", "max_tokens": 2, "frobnicate": 1})
        seen: dict[str, str] = {}
        while len(seen) < 2:
            ev = await ws.receive_json(timeout=60)
            if ev["type"] in ("done", "error"):
                seen[ev["id"]] = ev["type"] if ev["type"] == "done" else ev["message"]
        assert seen["a"] == "done"
        assert "frobnicate" in seen["b"]


def test_message_fields_that_would_be_dropped_are_refused_and_nulls_pass():
    def msg(**kw):
        return {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", **kw}]}

    parse_generation(msg(refusal=None, tool_calls=None, audio=None), True, 8192, VOCAB)
    assert refused(msg(name="bob"), True).param == "messages[1].name"
    assert refused(msg(tool_calls=[{"id": "c"}]), True).param == "messages[1].tool_calls"  # malformed
    assert refused(msg(function_call={"name": "f"}), True).code == "unsupported_parameter"
    err = refused(msg(colour="red"), True)
    assert err.param == "messages[1].colour" and err.code == "unknown_parameter"


def test_min_p_reaches_the_last_stage(client):
    """min_p 1 keeps only the most likely token: a hot seeded draw becomes the greedy text; without it, it is not."""
    kw = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    hot = {**kw, "temperature": 2.0, "seed": 3}
    assert client.completions.create(**hot).choices[0].text != greedy
    kw["extra_body"] = {"ignore_eos": True, "min_p": 1.0}
    assert client.completions.create(temperature=2.0, seed=3, **kw).choices[0].text == greedy


def test_logit_bias_reaches_the_last_stage(client):
    """Banning the greedy answer's first token changes the greedy answer, and it never appears first again; the
    openai SDK sends logit_bias as it is."""
    kw = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**kw).choices[0]
    first = client.completions.create(**{**kw, "max_tokens": 1}).choices[0].text
    from shared.runtime.model_files import ModelFiles

    banned = ModelFiles.open("smollm2").tokenizer.encode(first)[0]
    biased = client.completions.create(**kw, logit_bias={str(banned): -100}).choices[0]
    assert biased.text != plain.text and not biased.text.startswith(first)


class Item(BaseModel):  # bounded strings and lists: the answer ends on any machine's rounding, not only this one's
    name: str = Field(max_length=24)
    quantity: int
    price: float


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Order(BaseModel):
    customer: str = Field(max_length=24)
    colour: Colour
    size: Literal["S", "M", "L"]
    items: list[Item] = Field(max_length=2)


def test_sdk_parse_returns_a_nested_pydantic_object(client):
    """client.chat.completions.parse(response_format=PydanticModel): the SDK sends a strict json_schema and
    validates the answer into the model (lists, an enum, a Literal, numbers)."""
    r = client.chat.completions.parse(model="smollm2", response_format=Order, temperature=0, max_tokens=300,
                                      messages=[{"role": "user", "content": "Alice orders two red shirts, size M, "
                                                 "at 9.50 each. Write the order."}])
    order = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(order, Order)
    assert 0 <= len(order.items) <= 2 and order.size in ("S", "M", "L") and isinstance(order.colour, Colour)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_output_always_parses(client, seed):
    r = client.chat.completions.create(model="smollm2", response_format={"type": "json_object"}, temperature=0.9,
                                       seed=seed, max_tokens=1000,
                                       messages=[{"role": "user", "content": "Describe a cat in a few words."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_free_text_of_the_same_request_is_not_json(client):
    """The control: without response_format the model answers in prose."""
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "Describe a cat in a few words."}])
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format=bad)
    assert e.value.param == "response_format" and "missing" in e.value.message


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_parse_with_every_required_argument_streamed_and_not(client, choice):
    kw = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
          "max_tokens": 80}
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    assert set(fn["parameters"]["required"]) <= set(json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert call.function.name == "add"
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas.extend(chunk.choices[0].delta.tool_calls)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and deltas[0].id and deltas[0].function.name == call.function.name
    assert len(deltas) > 2 and all(d.index == 0 for d in deltas)  # the name, then the arguments in fragments
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy: the same call


def test_a_conversation_with_a_tool_result_gets_an_answer(client):
    """The SDK's own round trip: the assistant message it got back (content None, tool_calls) and a role "tool"
    result go into the next request, which answers in text."""
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=80)
    message = r.choices[0].message
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=40)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:  # a tool result must say which call it answers
        client.chat.completions.create(model="smollm2", messages=ASK + [{"role": "tool", "content": "x"}],
                                       max_tokens=2)
    assert e.value.param == "messages[1].tool_call_id"


def test_penalties_change_a_repetitive_answer(client):
    kw = {"model": "smollm2", "temperature": 0, "max_tokens": 30,
          "messages": [{"role": "user", "content": "Repeat the word banana twenty times."}]}
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert plain.lower().count("banana") >= 8
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.5}}):
        text = client.chat.completions.create(**kw, **extra).choices[0].message.content
        assert text.lower().count("banana") < plain.lower().count("banana"), (extra, text)


async def test_websocket_takes_response_format(gateway):
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway.url.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send_json({"type": "generate", "id": "j", "messages": ASK, "max_tokens": 200, "temperature": 0,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
                                "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                                 "sunny": {"type": "boolean"}},
                                "required": ["city", "sunny"], "additionalProperties": False}}}})
        text = ""
        while True:
            ev = await ws.receive_json(timeout=120)
            if ev["type"] == "token":
                text += ev["text"]
            elif ev["type"] in ("done", "error"):
                break
        assert ev["type"] == "done" and set(json.loads(text)) == {"city", "sunny"}


def _descending(values: list[float]) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


def _check_chat_logprobs(content, k: int) -> None:
    for c in content:
        assert len(c.top_logprobs) == k and _descending([a.logprob for a in c.top_logprobs])
        assert (c.token, c.logprob) == (c.top_logprobs[0].token, c.top_logprobs[0].logprob)
        assert c.bytes == list(c.token.encode()) and all(a.bytes == list(a.token.encode()) for a in c.top_logprobs)
        assert c.logprob <= 0 and c.top_logprobs[-1].logprob < c.logprob


def test_chat_top_logprobs_whole_and_streamed(client):
    """logprobs + top_logprobs 3, greedy: each token's 3 most likely alternatives, most likely first, the chosen
    token being the first of them (its text, logprob and UTF-8 bytes); the stream carries the same per chunk.
    A first run caches the prompt, so the two compared runs start from the same cached prefix and take the same
    kernels (a prompt computed whole and a one-token remainder after a cached prefix may run on different kernels:
    in CI, bf16 dense matmuls against the integer-dot ones, their logprobs 0.14 apart)."""
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three fruits."}], "max_tokens": 5,
          "temperature": 0, "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == whole.message.content
    _check_chat_logprobs(content, 3)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    _check_chat_logprobs(streamed, 3)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=0.02)


def test_completions_logprobs_k_returns_k_alternatives(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and "".join(lp.tokens) == r.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and _descending(list(top.values()))
        assert next(iter(top.items())) == (token, logprob)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [list(t) for s in streamed for t in s.top_logprobs] == [list(t) for t in lp.top_logprobs]


def test_sdk_top_logprobs_out_of_range_or_without_logprobs_is_a_400_naming_it(client):
    msgs = [{"role": "user", "content": "Hi"}]
    for kw in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 3}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, **kw)
        assert e.value.param == "top_logprobs" and "top_logprobs" in e.value.message, kw


async def test_websocket_token_events_carry_top_logprobs(gateway):
    """A chat message (logprobs + top_logprobs) and a prompt (completions' logprobs k) over the websocket: every
    token event holds k alternatives by token id, the greedy token first."""
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway.url.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send_json({"type": "generate", "id": "chat", "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 4,
                            "ignore_eos": True})
        await ws.send_json({"type": "generate", "id": "text", "prompt": "Hi", "max_tokens": 3, "temperature": 0,
                            "logprobs": 2, "ignore_eos": True})
        tokens: dict[str, list[dict]] = {"chat": [], "text": []}
        done = set()
        while len(done) < 2:
            ev = await ws.receive_json(timeout=60)
            assert ev["type"] != "error", ev
            if ev["type"] == "done":
                done.add(ev["id"])
            else:
                tokens[ev["id"]].append(ev)
    for rid, k in (("chat", 4), ("text", 2)):
        assert len(tokens[rid]) == 3
        for ev in tokens[rid]:
            top = ev["top_logprobs"]
            assert len(top) == k and _descending([a["logprob"] for a in top])
            assert (top[0]["token_id"], top[0]["logprob"], top[0]["text"]) == (ev["token_id"], ev["logprob"],
                                                                               ev["token_text"])


# ---- a model whose file carries no chat template (issue: the documented second model could not chat) ---------------

@pytest.mark.reference  # the real Gemma 3 270M file comes with the reference packages (make install-reference)
def test_gemma3_270m_chats_through_the_sdk_under_the_name_it_is_served_as(gemma_gateway):
    client = openai.OpenAI(base_url=gemma_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["gemma-small"]
    reply = client.chat.completions.create(model="gemma-small", max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}])
    answer = reply.choices[0].message.content
    assert reply.model == "gemma-small" and answer and answer.strip(), reply
    assert "<start_of_turn>" not in answer and "<end_of_turn>" not in answer  # the turn ended on its marker
    assert reply.usage.prompt_tokens > 10  # the template's turns around the messages
    stream = client.chat.completions.create(model="gemma-small", max_tokens=16, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "What colour is the sky?"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()


# ---- schemas, tools and their history (the third hostile pass's low findings) ----------------------------------------

TREE = {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"},
                                                            "children": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}


@pytest.mark.parametrize("schema, cycle", [
    (TREE, "#/$defs/node -> #/$defs/node"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
      "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}, "#/$defs/a -> #/$defs/b"),
    ({"type": "object", "properties": {"self": {"$ref": "#"}}}, "# -> #"),
], ids=["tree", "two-step", "root"])
def test_a_schema_that_refers_to_itself_is_refused_naming_the_loop(schema, cycle):
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
    err = refused(body, chat=True)
    named = err.message.split("(")[1].split(")")[0]  # the loop, from wherever the walk entered it
    assert "refers to itself" in err.message and all(ref in named for ref in cycle.split(" -> ")), err.message
    tools = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    assert "refers to itself" in refused(tools, chat=True).message
    shared = {"$defs": {"leaf": {"type": "string"}}, "type": "object",  # a $ref used twice is no loop
              "properties": {"a": {"$ref": "#/$defs/leaf"}, "b": {"$ref": "#/$defs/leaf"}}}
    ok = parse_generation({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": shared}}}, True, 8192, VOCAB)
    assert ok.json_schema == shared


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_tool_parameters_must_describe_an_object_and_the_history_must_hold_together():
    err = refused({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
                  chat=True)
    assert err.param == "tools[0].function.parameters" and "object" in err.message
    history = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    assert parse_generation({"messages": history, "tools": [TOOL]}, True, 8192, VOCAB).messages[2]["role"] == "tool"
    orphan = [*history[:1], {"role": "tool", "tool_call_id": "call_9", "content": "12 C"}]
    err = refused({"messages": orphan, "tools": [TOOL]}, chat=True)
    assert err.param == "messages[1].tool_call_id" and "call_9" in err.message
    err = refused({"messages": history, "tools": [{**TOOL, "function": {**TOOL["function"], "name": "other"}}]},
                  chat=True)
    assert err.param == "messages[1].tool_calls" and "get_weather" in err.message


def test_a_grammar_that_fails_mid_answer_is_the_requests_fault_not_a_retry(smollm2):
    """The output left its grammar (llguidance refused a token its own mask allowed, e.g. past one of its limits):
    the request ends with code grammar_failed and a 400, not a 503 inviting the same request again."""
    from services.gateway.engine.request import Request
    from services.gateway.engine.scheduler import Scheduler
    from services.gateway.frontend.frontend import error_status
    from services.gateway.frontend.output import ErrorEvent, OutputProcessor
    from shared.config import SchedulerConfig
    from shared.text.grammar import json_schema_grammar

    grammar = smollm2.grammars.matcher(json_schema_grammar({"type": "object"}))
    req = Request(seq_id="g", prompt_ids=[1, 2], max_tokens=8, grammar=grammar)
    s = Scheduler(1, SchedulerConfig(prefix_cache=False))
    s.submit(req, 0.0)
    (batch,) = s.schedule(0.0).batches
    off_grammar = smollm2.tokenizer.encode("x")[0]  # a JSON object cannot begin with it
    from shared.wire.protocol import BatchResult

    update = s.on_result(batch.mb_id, BatchResult(batch.mb_id, ["g"], [off_grammar], [None]), None, 0.0)
    (_, out), = update.outputs
    assert (out.finish_reason, out.code) == ("error", "grammar_failed") and "grammar" in out.error
    (event,) = [e for e in OutputProcessor(req, smollm2.tokenizer).process(out) if isinstance(e, ErrorEvent)]
    err = error_status(event)
    assert (err.status, err.code) == (400, "grammar_failed")


# ---- a stream that outlives its connection (resumable; GET /v1/streams/{id}) -----------------------------------------

async def _sse(resp, limit: int | None = None) -> list[tuple[str | None, dict | str]]:
    """(event id, parsed data) of an SSE response, at most `limit` events (then the connection is dropped)."""
    events, current_id = [], None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            current_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((current_id, data if data == "[DONE]" else json.loads(data)))
            current_id = None
            if limit is not None and len(events) == limit:
                break
    return events


def _text(events) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events
                   if isinstance(d, dict) and d.get("choices"))


async def test_a_resumable_stream_outlives_its_connection_and_resumes_after_its_last_event(gateway):
    body = {"messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 40, "seed": 11,
            "temperature": 0.9, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        # each in a cache scope of its own: both prefill in full, so their numbers (and seeded draws) are the same
        async with s.post(gateway.url + "/v1/chat/completions", json={**body, "cache_salt": "whole"}) as r:
            whole = await _sse(r)  # the same request, read whole
        async with s.post(gateway.url + "/v1/chat/completions", json={**body, "resumable": True,
                                                                       "cache_salt": "resumed"}) as r:
            first = await _sse(r, limit=6)  # ... and this connection drops here
        rid = first[0][1]["id"]
        assert all(eid and eid.count(":") == 1 for eid, _ in first)  # every event has an id
        async with s.get(f"{gateway.url}/v1/streams/{rid}", headers={"Last-Event-ID": first[-1][0]}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            rest = await _sse(r)
        offsets = [int(eid.split(":")[1]) for eid, _ in first + rest if eid]
        assert offsets == sorted(offsets) and offsets[len(first)] == offsets[len(first) - 1] + 1  # no gap, no repeat
        assert rest[-1][1] == "[DONE]" and rest[-2][1]["usage"]["completion_tokens"] == 40
        assert _text(first + rest) == _text(whole) and _text(whole)  # the answer, as if never interrupted
        async with s.get(f"{gateway.url}/v1/streams/{rid}?starting_after={first[2][0]}") as r:  # read again, later
            again = await _sse(r)
        assert [d for _, d in again] == [d for _, d in first[3:] + rest]
        async with s.get(f"{gateway.url}/v1/streams/{rid}", headers={"Last-Event-ID": "0000dead:3"}) as r:
            assert r.status == 410 and (await r.json())["error"]["code"] == "stream_expired"
        async with s.get(f"{gateway.url}/v1/streams/chatcmpl-{'0' * 16}") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "stream_not_found"


def _frames(raw: bytes) -> list[bytes]:
    """An SSE body's events, byte for byte (each with its id line), in order."""
    return [f + b"\n\n" for f in raw.split(b"\n\n") if f]


async def test_resuming_after_any_chunk_gives_exactly_the_rest_byte_for_byte(gateway):
    """Issue 69 item 2: one id per SSE event. A stream with a role chunk, a forced tool call (several chunks from
    one token, at times), a final chunk and a usage chunk, resumed after each of its chunks in turn: each resumed
    reading is the rest of the first one byte for byte, ids included -- no gap, no duplicate."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True},
            "resumable": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway.url + "/v1/chat/completions", json=body) as r:
            whole = _frames(await r.read())
        assert whole[-1] == b"data: [DONE]\n\n"
        ids = [f.split(b"\n", 1)[0].decode() for f in whole[:-1]]
        assert all(i.startswith("id: ") for i in ids) and len(set(ids)) == len(ids)  # one id per event
        chunks = [json.loads(f.split(b"data: ", 1)[1]) for f in whole[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and "usage" in chunks[-1]
        assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
        assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("tool_calls")) for c in chunks) > 2
        rid = chunks[0]["id"]
        for k, eid in enumerate(ids):
            async with s.get(f"{gateway.url}/v1/streams/{rid}", headers={"Last-Event-ID": eid[4:]}) as r:
                assert r.status == 200
                assert _frames(await r.read()) == whole[k + 1:], f"resumed after chunk {k} ({eid})"
        epoch, _, last = ids[-1][4:].rpartition(":")
        async with s.get(f"{gateway.url}/v1/streams/{rid}?starting_after={epoch}:{int(last) + 1}") as r:
            past = _frames(await r.read())  # issue 69 item 8: a cursor past the end is an error, not [DONE]
        (error,) = [json.loads(f.split(b"data: ", 1)[1])["error"] for f in past]
        assert error["code"] == "cursor_out_of_range" and last in error["message"], past


async def test_a_stream_not_marked_resumable_ends_with_its_connection(gateway):
    """... and is never replayed (issue 69 item 1: /v1/streams serves what was sent as resumable, nothing else)."""
    body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    cancelled = gateway.metric("stagemesh_gateway_requests_total", outcome="cancelled")
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway.url + "/v1/completions", json=body) as r:
            first = await _sse(r, limit=3)
        rid = first[0][1]["id"]
        deadline = time.monotonic() + 30
        while gateway.metric("stagemesh_gateway_requests_total", outcome="cancelled") == cancelled:
            assert time.monotonic() < deadline, "the request went on after its only reader left"
            await asyncio.sleep(0.1)  # its reader left: it was cancelled
        async with s.get(f"{gateway.url}/v1/streams/{rid}", headers={"Last-Event-ID": first[-1][0]}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "stream_not_found"


async def test_a_websocket_generation_is_resumed_on_another_socket_after_its_last_event(gateway):
    gen = {"type": "generate", "id": "a", "prompt": "Once upon a time", "max_tokens": 24, "seed": 5,
           "temperature": 0.9, "ignore_eos": True, "resumable": True, "cache_salt": "resumed"}
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(gateway.url + "/v1/stream") as ws:
            await ws.send_json(gen)
            first = [await ws.receive_json(timeout=60) for _ in range(5)]
        # the socket closed mid-answer; the generation goes on
        rid = first[0]["request_id"]
        assert [e["offset"] for e in first] == list(range(5)) and all(e["id"] == "a" for e in first)
        async with s.ws_connect(gateway.url + "/v1/stream") as ws:
            await ws.send_json({"type": "resume", "id": "b", "request_id": rid, "after": first[-1]["offset"]})
            rest = []
            while not rest or rest[-1]["type"] == "token":
                rest.append(await ws.receive_json(timeout=60))
            await ws.send_json({"type": "resume", "id": "c", "request_id": "no-such-request", "after": -1})
            missing = await ws.receive_json(timeout=60)
        async with s.ws_connect(gateway.url + "/v1/stream") as ws:  # the same request, read whole, for comparison
            await ws.send_json({**gen, "id": "w", "resumable": False, "cache_salt": "whole"})  # prefilled in full too
            whole = []
            while not whole or whole[-1]["type"] == "token":
                whole.append(await ws.receive_json(timeout=60))
    assert [e["offset"] for e in rest] == list(range(5, 5 + len(rest))) and all(e["id"] == "b" for e in rest)
    assert rest[-1]["type"] == "done" and rest[-1]["usage"]["completion_tokens"] == 24
    text = "".join(e["text"] for e in first + rest if e["type"] == "token")
    assert text == "".join(e["text"] for e in whole if e["type"] == "token") and text
    assert missing["type"] == "error" and missing["code"] == "stream_not_found" and missing["id"] == "c"


# ---- the prefix cache is no cross-tenant oracle (cache_salt, prompt_cache_key, user) --------------------------------

def test_a_tenants_cached_prefix_is_invisible_to_every_other_tenant(client):
    """The third hostile pass's oracle: a victim's long message ending in a PIN is cached; an attacker who knows the
    rest tries PINs and reads cached_tokens. Under any other scope (the shared one, another cache_salt,
    prompt_cache_key or user) the right PIN finds nothing of the victim's: each guess, in a scope of its own, reports
    exactly what a wrong one does. Within the victim's own scope the cache still serves."""
    for field in ("cache_salt", "prompt_cache_key", "user"):
        secret = ("My account statement follows, please keep it private. " * 12) + "My PIN is 4817."
        # a system turn of its own: the template's default one is every request's, and so is its first block
        system = {"role": "system", "content": f"Bank assistant {field} {os.urandom(4).hex()}, careful with numbers."}

        def cached(pin: str, secret: str = secret, system: dict = system, **scope) -> int:
            guess = [system, {"role": "user", "content": secret.replace("4817", pin)}]
            return client.chat.completions.create(model="smollm2", messages=guess, max_tokens=1, temperature=0,
                                                  extra_body=scope).usage.prompt_tokens_details.cached_tokens

        assert cached("4817", **{field: "victim"}) == 0  # the victim's message, cached in its scope
        assert cached("4817") == 0  # the shared scope holds nothing of it (asked first: nothing of its own yet)
        for n, other in enumerate({field, "cache_salt"}):  # the victim's kind of scope, and a salt
            right, wrong = cached("4817", **{other: f"attacker-right-{n}"}), cached("0000", **{other: f"attacker-wrong-{n}"})
            assert right == wrong == 0, (field, other, right, wrong)  # the guess tells nothing
        mine = cached("4817", **{field: "victim"})
        assert mine >= 128 and mine % 16 == 0  # its own scope: all but the message's last block or two


@pytest.mark.parametrize("field", ["cache_salt", "prompt_cache_key", "user"])
def test_a_cache_scope_must_be_a_short_string(field):
    assert refused({**CHAT, field: 7}, chat=True).param == field
    assert refused({**CHAT, field: "x" * 257}, chat=True).param == field
    assert parse_generation({**CHAT, field: "t1"}, True, 8192, VOCAB).cache_tenant == f"{field}:t1"


def test_continue_final_message_needs_an_assistant_message_with_text_last():
    asked = [{"role": "user", "content": "Count to ten."}]
    spec = parse_generation({"messages": [*asked, {"role": "assistant", "content": "One, two,"}],
                             "continue_final_message": True}, True, 8192, VOCAB)
    assert spec.continue_final
    assert not parse_generation({"messages": asked}, True, 8192, VOCAB).continue_final
    for messages in (asked, [*asked, {"role": "assistant", "content": " "}]):
        with pytest.raises(RequestError, match="continues the last message") as e:
            parse_generation({"messages": messages, "continue_final_message": True}, True, 8192, VOCAB)
        assert e.value.param == "continue_final_message"
    with pytest.raises(RequestError, match="continue_final_message"):  # a chat field: completions have no messages
        parse_generation({"prompt": "One, two,", "continue_final_message": True}, False, 8192, VOCAB)
