"""The Anthropic Messages API: POST /v1/messages (a whole message, or Anthropic's SSE events) and
POST /v1/messages/count_tokens, what Claude-style agent clients attach to.

A request is translated into the chat completions request it means (`translate`) and runs down the one chat path:
its validation (schemas.parse_generation), the chat template with tools written in (tools.py), the engine and the
request's event log. Here its events are shaped back into a message's content blocks (`MessageShape`): text, and
tool calls (read by the chat path's ToolCallParser) as tool_use blocks. Errors leave in Anthropic's shape
(RequestError.anthropic_body, chosen by path in app.py); an error the chat path raises names the field as the client
sent it (`Translation.name`, from the error's field path). docs/messages.md says what is supported."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.api import sse
from services.gateway.engine.replicas import SESSION_HEADER
from services.gateway.frontend.events import RequestHandle
from services.gateway.frontend.frontend import GATEWAY, error_status, json_body, tool_parser
from services.gateway.frontend.output import DoneEvent, ErrorEvent, TokenEvent, Usage
from services.gateway.frontend.schemas import Path, RequestError, check_field_tables, path_text
from services.gateway.frontend.tools import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser

MESSAGES_PATH = "/v1/messages"  # and every path below it: errors in Anthropic's shape

# The top-level fields each endpoint reads; a field sent as null counts as left out.
MESSAGES_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                             "stop_sequences", "stream", "tools", "tool_choice", "metadata"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice"})
# Accepted and ignored: they cannot change the tokens generated (the prefix cache needs no marks). Their type is checked.
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {"service_tier": (str,), "inference_geo": (str,), "speed": (str,),
                                               "cache_control": (dict,)}
# Known fields not implemented: accepted only at the value that changes nothing. (is it neutral, as written, what)
NOT_YET_FIELDS: dict[str, tuple[Any, str, str]] = {
    "thinking": (lambda v: isinstance(v, dict) and v.get("type") == "disabled", '{"type": "disabled"}',
                 "extended thinking"),
    "mcp_servers": (lambda v: v == [], "[]", "remote MCP servers"),
    "container": (lambda v: False, "null", "a code execution container"),
    "context_management": (lambda v: False, "null", "server-side context editing"),
    "output_config": (lambda v: v == {}, "{}", "an output format or effort"),
}

# The keys each content block may carry (a key sent as null counts as left out); cache_control is accepted and
# ignored (the prefix cache needs no marks), as is a tool_use's caller.
BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"type", "thinking", "signature"}, "redacted_thinking": {"type", "data"}}
NOT_TEXT = {"image": "an image", "document": "a document", "search_result": "a search result",
            "container_upload": "a file upload"}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": one named function


def _refuse(message: str, param: str, code: str = "invalid_request") -> RequestError:
    return RequestError(message, param, code=code)


@dataclass
class Origin:
    """Where one chat message of a translation came from, in the Messages request's own names: the message (or
    block), its content, and its k-th tool call's tool_use block."""

    base: str
    content: str
    calls: dict[int, str] = field(default_factory=dict)


@dataclass
class Translation:
    """A Messages request as the chat completions request it means, and where each of that request's messages came
    from (so an error the chat path finds names the client's own field: `name`)."""

    body: dict
    origins: dict[int, Origin] = field(default_factory=dict)  # chat message j -> where it came from

    _TOOL_FIELDS = {"parameters": "input_schema", "name": "name", "description": "description"}
    _NAMES = {("stop",): "stop_sequences", ("user",): "metadata.user_id"}

    def name(self, path: Path) -> str:
        """A chat path's field -> the Messages field it came from: messages[j] its message or block (its content,
        tool_use_id, tool_use blocks), tools[k].function.parameters tools[k].input_schema, stop stop_sequences,
        user metadata.user_id."""
        if path in self._NAMES:
            return self._NAMES[path]
        if len(path) >= 4 and path[0] == "tools" and path[2] == "function" and path[3] in self._TOOL_FIELDS:
            return path_text(("tools", path[1], self._TOOL_FIELDS[path[3]], *path[4:]))
        origin = self.origins.get(path[1]) if len(path) > 1 and path[0] == "messages" else None
        if origin is None:
            return path_text(path)
        rest = path[2:]
        if rest[:1] == ("content",):
            return origin.content + _tail(rest[1:])
        if rest[:1] == ("tool_call_id",):
            return f"{origin.base}.tool_use_id" + _tail(rest[1:])
        if rest[:1] == ("tool_calls",):
            if len(rest) == 1:
                return origin.content
            return origin.calls[rest[1]] + _tail(rest[2:]) if rest[1] in origin.calls else path_text(path)
        return origin.base + _tail(rest)

    def _came_from(self, j: int, base: str, content: str, calls: dict[int, str] | None = None) -> None:
        """Chat message j came from `base`; its content from `content`; its k-th tool call from calls[k]."""
        self.origins[j] = Origin(base, content, dict(calls or {}))


def _tail(rest: Path) -> str:
    """The rest of a path after a name: ".key" / "[i]" each."""
    return path_text(("", *rest)) if rest else ""


def translate(body: dict, model_id: str, count: bool = False) -> Translation:
    """A Messages request (count: a count_tokens request) -> the chat completions request it means. Refuses, naming
    the field, what has no meaning here; what both APIs share (ranges, schemas, the tool history) is left to the
    chat path's validation, whose errors name this API's fields through `Translation.name`."""
    check_field_tables(body, COUNT_FIELDS if count else MESSAGES_FIELDS, IGNORED_FIELDS, NOT_YET_FIELDS,
                       "count_tokens reads model, messages, system, tools, tool_choice" if count
                       else "the fields this server reads are listed in docs/messages.md")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _refuse(f"'model' is required: the model's name, here {model_id!r}", "model")
    if model != model_id:
        raise RequestError(f"model {model[:100]!r} is not served here: this gateway serves {model_id!r} "
                           "(GET /v1/models)", "model", status=404, code="model_not_found")
    out = Translation({"model": model})
    if not count:
        if body.get("max_tokens") is None:
            raise _refuse("'max_tokens' is required: the most tokens to generate", "max_tokens")
        for key in ("max_tokens", "top_p", "top_k", "stream"):
            if body.get(key) is not None:
                out.body[key] = body[key]
        temperature = body.get("temperature")
        if temperature is not None:
            if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 1:
                raise _refuse(f"'temperature' must be a number between 0 and 1, got {temperature!r}", "temperature")
            out.body["temperature"] = temperature
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise _refuse("'stop_sequences' must be a list of strings", "stop_sequences")
            if stop:
                out.body["stop"] = stop  # counts and lengths: the chat path's limits
        _metadata(body.get("metadata"), out.body)
    tools = _tools(body.get("tools"), out.body)
    _tool_choice(body.get("tool_choice"), tools, out.body)
    chat: list[dict] = []
    system = body.get("system")
    if system is not None and system != "":
        out._came_from(0, "system", "system")
        chat.append({"role": "system", "content": system if isinstance(system, str) else _text_parts(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse("'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        _message(m, i, chat, out)
    _prefill(messages, chat, tools, out.body)
    out.body["messages"] = chat
    return out


def _metadata(value: Any, chat: dict) -> None:
    """metadata.user_id -> the chat request's `user`: the request's prefix-cache scope and pipeline affinity."""
    if value is None:
        return
    if not isinstance(value, dict) or not set(value) <= {"user_id"}:
        raise _refuse("'metadata' must be an object with at most 'user_id'", "metadata")
    if value.get("user_id") is not None:
        chat["user"] = value["user_id"]


def _tools(value: Any, chat: dict) -> list[str]:
    """tools -> the chat request's functions; returns their names."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _refuse("'tools' must be a list of {name, description, input_schema} objects", "tools")
    functions = []
    for k, t in enumerate(value):
        if not isinstance(t, dict):
            raise _refuse(f"tools[{k}] must be an object {{name, description, input_schema}}", f"tools[{k}]")
        if t.get("type") not in (None, "custom"):
            raise _refuse(f"tools[{k}] is a server tool ({str(t['type'])[:60]!r}), which this server does not run; "
                          "send your own tools as {name, description, input_schema}", f"tools[{k}].type",
                          code="unsupported_parameter")
        for key, v in t.items():
            if v is not None and key not in TOOL_KEYS:
                raise _refuse(f"tools[{k}].{key}: unrecognized field (a tool has name, description, input_schema)",
                              f"tools[{k}].{key}", code="unknown_parameter")
        if not isinstance(t.get("input_schema"), dict):
            raise _refuse(f"tools[{k}].input_schema is required: a JSON schema object of the tool's input",
                          f"tools[{k}].input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        functions.append({"type": "function", "function": fn})
    if functions:
        chat["tools"] = functions
    return [t.get("name") for t in value]


def _tool_choice(value: Any, tools: list[str], chat: dict) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (*TOOL_CHOICES, "tool") or not set(value) <= {"type", "name", "disable_parallel_tool_use"}:
        raise _refuse("'tool_choice' must be {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} or "
                      "{'type': 'none'}", "tool_choice")
    if kind == "tool":
        if value.get("name") not in tools:
            raise _refuse(f"tool_choice.name must name one of 'tools' ({', '.join(map(str, tools)) or 'none given'}), "
                          f"got {value.get('name')!r}", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    elif kind != "none" or tools:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _refuse("tool_choice.disable_parallel_tool_use must be true or false",
                          "tool_choice.disable_parallel_tool_use")
        chat["parallel_tool_calls"] = not parallel


def _text_parts(value: Any, param: str) -> list[dict]:
    """A content value of text only (system, a tool result) -> chat text parts."""
    blocks = _blocks(value, param)
    for k, b in enumerate(blocks):
        if b["type"] != "text":
            _not_here(b, f"{param}[{k}]", "text blocks only")
        _text_block(b, f"{param}[{k}]")
    return [{"type": "text", "text": b["text"]} for b in blocks]


def _blocks(value: Any, param: str) -> list[dict]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list) or not value:
        raise _refuse(f"'{param}' must be a string or a non-empty list of content blocks", param)
    for k, b in enumerate(value):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _refuse(f"{param}[{k}] must be a content block {{'type': ..., ...}}", f"{param}[{k}]")
    return value


def _not_here(block: dict, param: str, what: str) -> None:
    kind = block["type"]
    if kind in NOT_TEXT:
        raise _refuse(f"{param} is {NOT_TEXT[kind]} block: this server serves a text-only model; send text",
                      param, code="unsupported_content")
    raise _refuse(f"{param} is a {kind[:40]!r} block, which does not go here ({what})", f"{param}.type")


def _text_block(b: dict, param: str) -> None:
    _keys(b, param)
    if not isinstance(b.get("text"), str):
        raise _refuse(f"{param}.text must be a string", f"{param}.text")
    if b.get("citations") not in (None, []):
        raise _refuse(f"{param}.citations: citations are not supported here; leave them out", f"{param}.citations",
                      code="unsupported_parameter")


def _keys(b: dict, param: str) -> None:
    for key, v in b.items():
        if v is not None and key not in BLOCK_KEYS[b["type"]]:
            raise _refuse(f"{param}.{key}: unrecognized field of a {b['type']} block", f"{param}.{key}",
                          code="unknown_parameter")


def _message(m: Any, i: int, chat: list[dict], out: Translation) -> None:
    """messages[i] -> chat messages appended to `chat`: a user message's tool_result blocks each become a tool
    message and its text one user message; an assistant's text and tool_use blocks one message with tool_calls
    (thinking blocks from earlier turns are dropped, as Anthropic drops them). Consecutive turns of one role are one
    turn, as Anthropic combines them (a template that wants roles to alternate would refuse two): text that follows
    a user message, or an assistant message without tool calls, joins it."""
    param = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        hint = " (the system prompt goes in the top-level 'system')" if role == "system" else ""
        raise _refuse(f"{param}.role must be 'user' or 'assistant', got {role!r}{hint}", f"{param}.role")
    for key, v in m.items():
        if v is not None and key not in ("role", "content"):
            raise _refuse(f"{param}.{key}: unrecognized field (a message has 'role' and 'content')", f"{param}.{key}",
                          code="unknown_parameter")
    blocks = _blocks(m.get("content"), f"{param}.content")
    text: list[dict] = []
    calls: list[dict] = []
    call_blocks: dict[int, str] = {}

    def flush_text() -> None:
        if text and chat and chat[-1]["role"] == "user" and isinstance(chat[-1]["content"], list):
            chat[-1]["content"] += [{"type": "text", "text": "\n\n"}, *text]  # the turn before, continued
        elif text:
            out._came_from(len(chat), param, f"{param}.content")
            chat.append({"role": "user", "content": list(text)})
        text.clear()

    for k, b in enumerate(blocks):
        where, kind = f"{param}.content[{k}]", b["type"]
        if kind == "text":
            _text_block(b, where)
            text.append({"type": "text", "text": b["text"]})
        elif kind == "tool_result" and role == "user":
            _keys(b, where)
            if not isinstance(b.get("tool_use_id"), str):
                raise _refuse(f"{where}.tool_use_id is required: the id of the tool_use block it answers",
                              f"{where}.tool_use_id")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise _refuse(f"{where}.is_error must be true or false", f"{where}.is_error")
            content = "" if b.get("content") is None else _text_parts(b["content"], f"{where}.content")
            if b.get("is_error"):  # the model reads that the tool failed
                content = [{"type": "text", "text": "Error: "}, *(content or [])]
            flush_text()
            out._came_from(len(chat), where, f"{where}.content")
            chat.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        elif kind == "tool_use" and role == "assistant":
            _keys(b, where)
            if not (isinstance(b.get("id"), str) and b["id"] and isinstance(b.get("name"), str)
                    and isinstance(b.get("input"), dict)):
                raise _refuse(f"{where} must be {{'type': 'tool_use', 'id': str, 'name': str, 'input': object}}", where)
            call_blocks[len(calls)] = where
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            _keys(b, where)
        else:
            other = "an assistant" if role == "user" and kind in ("tool_use", "thinking", "redacted_thinking") \
                else "a user" if kind == "tool_result" else None
            _not_here(b, where, f"it belongs in {other} message" if other else "text, tool_use or tool_result")
    if role == "user":
        flush_text()
    elif text and chat and chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls") \
            and isinstance(chat[-1]["content"], list):  # the turn before, continued (its calls, if any, come last)
        chat[-1]["content"] += [{"type": "text", "text": "\n\n"}, *text]
        if calls:
            out._came_from(len(chat) - 1, param, f"{param}.content", call_blocks)
            chat[-1]["tool_calls"] = calls
    elif text or calls:
        out._came_from(len(chat), param, f"{param}.content", call_blocks)
        msg: dict = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        chat.append(msg)


def _prefill(messages: list, chat: list[dict], tools: list[str], body: dict) -> None:
    """A last message of the assistant's is a prefill: the answer continues its text (the chat path's
    continue_final_message)."""
    last = len(messages) - 1
    if messages[last]["role"] != "assistant":
        return
    param = f"messages[{last}]"
    final = chat[-1] if chat and chat[-1]["role"] == "assistant" else None
    if final is None or final.get("tool_calls"):
        raise _refuse(f"{param}: the last message is the assistant's and holds no text to continue (a tool_use "
                      "goes before the user message with its tool_result)", param)
    if tools:
        raise _refuse(f"{param}: a last assistant message (a prefill to continue) does not go with 'tools' here",
                      param, code="unsupported_parameter")
    text = "".join(p["text"] for p in final["content"])
    if not text.strip() or text != text.rstrip():
        raise _refuse(f"{param}: a last assistant message (a prefill) must hold text and not end with whitespace",
                      f"{param}.content")
    body["continue_final_message"] = True


# ---- answers ---------------------------------------------------------------------------------------------------------

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def messages_usage(usage: Usage) -> dict:
    """The Messages API's usage: input_tokens are the prompt's tokens the prefix cache did not supply."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageShape:
    """One request's client events -> Anthropic's stream events, in order (`start`, then `events` per client
    event); a whole message is those events accumulated (`message`), so both say the same."""

    def __init__(self, handle: RequestHandle, model_id: str):
        self.handle = handle
        self.tools: ToolCallParser | None = tool_parser(handle.spec, handle.id)
        self.base = {"id": "msg_" + handle.id, "type": "message", "role": "assistant", "model": model_id}
        self.block: int | None = None  # index of the open content block
        self.blocks = 0  # content blocks started
        self.called = False

    def start(self) -> list[tuple[str, dict]]:
        """message_start, sent when the first event comes (the prefix cache's share of the prompt is known)."""
        usage = messages_usage(self.handle.prompt_usage())
        return [("message_start", {"type": "message_start", "message": {
            **self.base, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})]

    def events(self, ev: TokenEvent | DoneEvent | ErrorEvent) -> list[tuple[str, dict]]:
        if isinstance(ev, ErrorEvent):
            return [("error", error_status(ev).anthropic_body())]
        out: list[tuple[str, dict]] = []
        if isinstance(ev, TokenEvent):
            for tev in self.tools.push(ev.text) if self.tools is not None else [ContentDelta(ev.text)]:
                out += self._tool_event(tev)
            return out
        for tev in self.tools.finish() if self.tools is not None else []:
            out += self._tool_event(tev)
        if self.blocks == 0:  # an empty answer is one empty text block, as the whole message shows it
            out += self._open({"type": "text", "text": ""})
        out += self._close()
        reason, sequence = self._stop_reason(ev)
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": messages_usage(ev.usage)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _stop_reason(self, done: DoneEvent) -> tuple[str, str | None]:
        if self.called and done.finish_reason == "stop":
            return "tool_use", None
        if done.stop_string is not None:
            return "stop_sequence", done.stop_string
        return STOP_REASONS.get(done.finish_reason, "end_turn"), None

    def _tool_event(self, tev) -> list[tuple[str, dict]]:
        if isinstance(tev, ContentDelta):
            if not tev.text:
                return []
            out = self._open({"type": "text", "text": ""}) if self.block is None else []
            return out + [self._delta({"type": "text_delta", "text": tev.text})]
        if isinstance(tev, CallStarted):
            self.called = True
            return self._open({"type": "tool_use", "id": tool_use_id(tev.id), "name": tev.name, "input": {}})
        assert isinstance(tev, ArgumentsDelta)
        return [self._delta({"type": "input_json_delta", "partial_json": tev.fragment})]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.block, self.blocks = self.blocks, self.blocks + 1
        out.append(("content_block_start", {"type": "content_block_start", "index": self.block,
                                            "content_block": block}))
        if self.block == 0:
            out.append(("ping", {"type": "ping"}))
        return out

    def _close(self) -> list[tuple[str, dict]]:
        if self.block is None:
            return []
        index, self.block = self.block, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta}


def message(events: list[tuple[str, dict]]) -> dict:
    """Stream events accumulated into the whole message. A tool_use whose input did not complete (max_tokens cut
    it) is left out: a client would run the tool with half its input."""
    msg: dict = {}
    parts: dict[int, list[str]] = {}
    for name, data in events:
        if name == "message_start":
            msg = dict(data["message"], content=[])
        elif name == "content_block_start":
            msg["content"].append(dict(data["content_block"]))
            parts[data["index"]] = []
        elif name == "content_block_delta":
            delta = data["delta"]
            parts[data["index"]].append(delta["text"] if delta["type"] == "text_delta" else delta["partial_json"])
        elif name == "message_delta":
            msg.update(data["delta"])
            msg["usage"] = {**msg["usage"], **data["usage"]}
    content = []
    for i, block in enumerate(msg["content"]):
        if block["type"] == "text":
            content.append({**block, "text": "".join(parts[i])})
            continue
        try:
            block["input"] = json.loads("".join(parts[i]) or "{}")
        except ValueError:
            continue
        if isinstance(block["input"], dict):
            content.append(block)
    msg["content"] = content or [{"type": "text", "text": ""}]
    return msg


async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    gw = request.app[GATEWAY]
    if request.headers.get("Last-Event-ID") is not None:  # an EventSource reconnecting: it would take a fresh answer
        raise RequestError("a Messages stream is not resumed (its events carry no ids), so Last-Event-ID cannot be "
                           "answered: send the request again without the Last-Event-ID header, or stream it from "
                           "POST /v1/chat/completions with \"resumable\": true", "Last-Event-ID")
    translation = translate(await json_body(request), gw.config.model_id)
    try:
        handle = await gw.start(translation.body, True, request.headers.get(SESSION_HEADER))
    except RequestError as e:
        raise e.named(translation.name) from None
    shape = MessageShape(handle, gw.config.model_id)
    try:
        if handle.spec.stream:
            return await _stream(request, gw, handle, shape)
        tokens, done = await gw.collect(handle)
        events = shape.start()
        for ev in [*tokens, done]:
            events += shape.events(ev)
        return web.json_response(message(events))
    finally:
        gw.leave(handle)  # no-op when finished; frees KV slots when the client went away


async def _stream(request: web.Request, gw, handle: RequestHandle, shape: MessageShape) -> web.StreamResponse:
    """Anthropic's stream events, named (`event:`) and without ids: a Messages stream is not resumed."""
    out = await sse.SSEStream.open(request)
    started = False
    async with contextlib.aclosing(gw.events(handle)) as log:
        async for _, ev in log:
            events = shape.events(ev)
            if not started and not isinstance(ev, ErrorEvent):
                events, started = shape.start() + events, True
            await out.send_frames([sse.frame(data, event=name) for name, data in events])
    return await out.close()


async def count_message_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's tokens, rendered as a real request would be."""
    gw = request.app[GATEWAY]
    translation = translate(await json_body(request), gw.config.model_id, count=True)
    try:
        return web.json_response({"input_tokens": await gw.count_prompt(translation.body)})
    except RequestError as e:
        raise e.named(translation.name) from None
