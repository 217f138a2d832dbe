"""OpenAI's Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A Responses request is translated, once, into the chat request the gateway already runs (its input items into chat
messages, `instructions` into the system message, `text.format` into `response_format`, flat function tools into
chat's): tokenizing, tools, structured output and the prefix cache are the chat path's. What is new here is the
shape and what outlives the connection:

- ResponseShape turns the request's client events (its event log, services/gateway/frontend/events.py) into the Responses
  stream events, each numbered by `sequence_number`, and the response object. It is deterministic: every reading of
  the same log makes the same events with the same numbers and ids, so a stream resumed `starting_after` N is the
  tail of the first reading, with no gap and no duplicate, without keeping the events themselves.
- Responses are stored (services/gateway/api/response_store.py) unless `store: false`: `GET` reads one back (from the
  log while it runs), `previous_response_id` continues its conversation (its prompt starts with the earlier one,
  so the prefix cache serves it), `background: true` runs it detached from any connection.

docs/openai.md#responses-api says what is kept, for how long, and how to resume."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.api import sse
from services.gateway.api.response_store import ResponseStore, StoredResponse
from services.gateway.engine.replicas import SESSION_HEADER
from services.gateway.frontend.events import KEEP_ENDED, KEEP_ENDED_S, RequestHandle
from services.gateway.frontend.frontend import GATEWAY, Gateway, json_body, tool_parser
from services.gateway.frontend.output import ClientEvent, DoneEvent, ErrorEvent, TokenEvent, Usage
from services.gateway.frontend.schemas import (
    MAX_MESSAGES,
    MAX_TOOLS,
    TOOL_NAME,
    GenerationSpec,
    Path,
    RequestError,
    bool_field,
    cache_tenant,
    check_field_tables,
    path_text,
    unicode_text,
)
from services.gateway.frontend.tools import ArgumentsDelta, CallStarted, ContentDelta, ToolEvent

RESPONSES = web.AppKey("responses", ResponseStore)
CANCEL_WAIT_S = 10.0  # POST .../cancel waits this long for the request to end before answering

# ---- the request: validated at the edge, in this endpoint's names, then translated to a chat request ---------------

# Every top-level field, by what it does here (docs/openai.md#responses-api lists them). Null = left out.
READ_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                         "tools", "tool_choice", "parallel_tool_calls", "text", "background", "store",
                         "previous_response_id", "metadata", "seed", "user", "prompt_cache_key",
                         "ignore_eos"})  # ignore_eos: the chat path's vLLM extension (exactly max_output_tokens)
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "safety_identifier": (str,), "service_tier": (str,), "stream_options": (dict,),
    "prompt_cache_retention": (str,),
}
NOT_YET_FIELDS: dict[str, tuple[Any, str, str]] = {
    "truncation": (lambda v: v == "disabled", '"disabled"', "drops input items that do not fit the context"),
    "include": (lambda v: v == [], "[]", "adds logprobs or tool outputs to the response"),
    "top_logprobs": (lambda v: not isinstance(v, bool) and v == 0, "0", "each token's most likely alternatives"),
    "reasoning": (lambda v: False, "null", "sets a reasoning model's effort and summaries"),
    "max_tool_calls": (lambda v: False, "null", "caps built-in tool calls"),
    "prompt": (lambda v: False, "null", "a stored prompt template"),
    "conversation": (lambda v: False, "null", "a stored conversation; chain responses with previous_response_id"),
}
# chat input roles (developer instructions are system messages to a chat template)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"}}
NOT_TEXT_PARTS = ("input_image", "input_file", "input_audio", "refusal")
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
MAX_METADATA = 16  # OpenAI's bounds: pairs, key characters, value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


@dataclass
class ResponsesRequest:
    """A validated `POST /v1/responses` body: the chat request it runs as, and what the response shows of it."""

    chat_body: dict  # for Gateway.start(chat=True)
    echo: dict  # the request's fields as the response object shows them
    messages: list[dict]  # the conversation it answers (the previous response's and its input), no instructions
    origins: list[str] = field(default_factory=list)  # chat_body's message i came from this field
    stream: bool = False
    background: bool = False
    store: bool = True

    def name(self, path: Path) -> str:
        """A chat path's field -> this endpoint's: messages[i] the input item (or field) that message came from,
        messages `input`, max_tokens max_output_tokens, response_format text.format, tools[k].function. tools[k]."""
        head, rest = path[0], path[1:]
        if head == "messages":
            if not rest:
                return "input"
            i = rest[0]
            where = self.origins[i] if isinstance(i, int) and i < len(self.origins) else "input"
            return where + (path_text(("", *rest[1:])) if rest[1:] else "")
        if head == "tools" and rest[1:2] == ("function",):
            return path_text(("tools", rest[0], *rest[2:]))
        if path[:3] == ("response_format", "json_schema", "schema"):
            return path_text(("text", "format", "schema", *path[3:]))
        if head == "response_format":
            return path_text(("text", "format", *rest))
        if head in ("max_tokens", "max_completion_tokens"):
            return path_text(("max_output_tokens", *rest))
        return path_text(path)


def parse_request(body: Any, previous: Callable[[str], list[dict]]) -> ResponsesRequest:
    """A Responses body -> ResponsesRequest, or RequestError naming the field. `previous(id)` is the conversation
    of a stored response (its input and output), or raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_field_tables(body, READ_FIELDS, IGNORED_FIELDS, NOT_YET_FIELDS)
    stream, background = bool_field(body, "stream"), bool_field(body, "background")
    store = bool_field(body, "store", True)
    if background and not store:
        raise RequestError("'background': true needs 'store': true (a background response is read back by its id)",
                           "background")
    chat_tools, echo_tools = _tools(body.get("tools"))
    names = [t["name"] for t in echo_tools]
    chat_choice, echo_choice = _tool_choice(body.get("tool_choice"), names)
    response_format, echo_format = _text_format(body.get("text"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string (the system message)", "instructions")
    pid = body.get("previous_response_id")
    if pid is not None and not (isinstance(pid, str) and pid):
        raise RequestError("'previous_response_id' must be the id of a stored response ('resp_...')",
                           "previous_response_id")
    prior = previous(pid) if pid is not None else []
    if body.get("input") is None:
        raise RequestError("'input' is required: a string, or a list of input items", "input")
    new, new_origins = _conversation(body["input"], prior, names if chat_tools else None)
    messages, origins = prior + new, ["previous_response_id"] * len(prior) + new_origins
    if instructions:
        messages_with_system = [{"role": "system", "content": unicode_text(instructions, "instructions")}, *messages]
        origins = ["instructions", *origins]
    else:
        messages_with_system = messages
    metadata = _metadata(body.get("metadata"))
    chat = {"messages": messages_with_system, "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "seed": body.get("seed"),
            "user": body.get("user"), "prompt_cache_key": body.get("prompt_cache_key"), "tools": chat_tools,
            "tool_choice": chat_choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": response_format, "ignore_eos": body.get("ignore_eos")}
    temperature, top_p = body.get("temperature"), body.get("top_p")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": 1.0 if temperature is None else temperature, "top_p": 1.0 if top_p is None else top_p,
            "tools": echo_tools, "tool_choice": echo_choice,
            "parallel_tool_calls": bool_field(body, "parallel_tool_calls", True), "text": {"format": echo_format},
            "metadata": metadata, "store": store, "previous_response_id": pid, "truncation": "disabled",
            "user": body.get("user"), "prompt_cache_key": body.get("prompt_cache_key")}
    return ResponsesRequest({k: v for k, v in chat.items() if v is not None}, echo, messages, origins, stream,
                            background, store)


def _text_parts(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A message's (or a tool output's) content, a string or text parts of the given kinds, as one string."""
    if isinstance(content, str):
        return unicode_text(content, param)
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or a list of content parts", param)
    texts = []
    for k, part in enumerate(content):
        p = f"{param}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_TEXT_PARTS:
            raise RequestError(f"{p} is an {kind!r} part: this server reads text only ({' or '.join(kinds)} parts)",
                               f"{p}.type", code="unsupported_parameter")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise RequestError(f"{p} must be {{'type': {kinds[0]!r}, 'text': ...}}", p)
        for key in part:
            if key not in ("type", "text", "annotations", "logprobs"):
                raise RequestError(f"Unrecognized content part field supplied: {p}.{key}", f"{p}.{key}",
                                   code="unknown_parameter")
        texts.append(part["text"])
    return unicode_text("".join(texts), param)


def _json_object_text(value: Any, param: str) -> str:
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RequestError(f"'{param}' must be a JSON object's text (as the response gave it), got {str(value)[:80]!r}",
                           param)
    return unicode_text(value, param)


def _conversation(value: Any, prior: list[dict], tool_names: list[str] | None) -> tuple[list[dict], list[str]]:
    """`input` -> chat messages, and for each the input item it came from. Consecutive function calls (and the
    assistant message before them) are one assistant turn; a function_call_output answers a call made before it,
    here or earlier in the conversation; with tools given, every call names one of them."""
    if isinstance(value, str):
        if not value:
            raise RequestError("'input' must be a non-empty string or a list of input items", "input")
        return [{"role": "user", "content": unicode_text(value, "input")}], ["input"]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a non-empty string or a list of input items (messages, function_call, "
                           "function_call_output)", "input")
    if len(value) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} input items per request", "input")
    called = {c["id"] for m in prior for c in m.get("tool_calls", ())}
    out: list[dict] = []
    origins: list[str] = []
    for j, item in enumerate(value):
        p = f"input[{j}]"
        if not isinstance(item, dict):
            raise RequestError(f"{p} must be an input item: a message, a function_call or a function_call_output", p)
        kind = item.get("type") or ("message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in ITEM_KEYS:
            code = "unsupported_parameter" if isinstance(kind, str) else "invalid_request"
            raise RequestError(f"{p}.type is {kind!r}: this server reads message, function_call and "
                               "function_call_output items", f"{p}.type", code=code)
        for key, v in item.items():
            if key not in ITEM_KEYS[kind] and v is not None:
                raise RequestError(f"Unrecognized input item field supplied: {p}.{key}; a {kind} item has "
                                   f"{', '.join(sorted(ITEM_KEYS[kind]))}", f"{p}.{key}", code="unknown_parameter")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise RequestError(f"{p}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{p}.role")
            kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            out.append({"role": ROLES[role], "content": _text_parts(item.get("content"), f"{p}.content", kinds)})
            origins.append(p)
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not (isinstance(item.get(key), str) and item[key]):
                    raise RequestError(f"{p}.{key} must be a non-empty string", f"{p}.{key}")
            if tool_names is not None and item["name"] not in tool_names:
                raise RequestError(f"{p} calls {item['name']!r}, which is not among 'tools' "
                                   f"({', '.join(sorted(tool_names))})", f"{p}.name")
            call = {"id": unicode_text(item["call_id"], f"{p}.call_id"), "type": "function",
                    "function": {"name": unicode_text(item["name"], f"{p}.name"),
                                 "arguments": _json_object_text(item.get("arguments"), f"{p}.arguments")}}
            called.add(call["id"])
            if out and out[-1]["role"] == "assistant":  # the same assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                origins.append(p)
        else:
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise RequestError(f"{p} answers call {call_id!r}, which no earlier function_call of this "
                                   "conversation made", f"{p}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text_parts(item.get("output"), f"{p}.output", ("input_text",))})
            origins.append(p)
    return out, origins


def _tools(value: Any) -> tuple[list[dict] | None, list[dict]]:
    """Flat function tools -> (chat's tools, or None; the tools as the response shows them). The chat path checks
    each name and schema (its refusals renamed back)."""
    if value is None or value == []:
        return None, []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} function tools", "tools")
    chat, echo = [], []
    for k, t in enumerate(value):
        p = f"tools[{k}]"
        if not isinstance(t, dict):
            raise RequestError(f"{p} must be {{'type': 'function', 'name', 'description', 'parameters'}}", p)
        if t.get("type") != "function":
            raise RequestError(f"{p} is a {t.get('type')!r} tool: this server calls function tools only "
                               "({'type': 'function', 'name', 'description', 'parameters'})", f"{p}.type",
                               code="unsupported_parameter")
        for key, v in t.items():
            if key not in TOOL_KEYS and v is not None:
                raise RequestError(f"Unrecognized tool field supplied: {p}.{key}; a function tool has "
                                   f"{', '.join(sorted(TOOL_KEYS))}", f"{p}.{key}", code="unknown_parameter")
        if not (isinstance(t.get("name"), str) and TOOL_NAME.fullmatch(t["name"])):
            raise RequestError(f"{p}.name must be a name of 1-64 letters, digits, _ or -, got {t.get('name')!r}",
                               f"{p}.name")
        chat.append({"type": "function", "function": {key: t[key] for key in ("name", "description", "parameters",
                                                                                 "strict") if t.get(key) is not None}})
        echo.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": t.get("strict", True)})
    return chat, echo


def _tool_choice(value: Any, names: list[str]) -> tuple[str | dict | None, str | dict]:
    """tool_choice -> (chat's, as the response shows it)."""
    if value is None:
        return None, "auto"
    if value in ("none", "auto", "required"):
        return value, value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {"type", "name"}:
        if value.get("name") not in names:
            raise RequestError(f"'tool_choice' names {value.get('name')!r}, which is not among 'tools' "
                               f"({', '.join(sorted(map(str, names)))})", "tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}, dict(value)
    raise RequestError("'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}",
                       "tool_choice")


FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


def _text_format(value: Any) -> tuple[dict | None, dict]:
    """text: {"format": ...} -> (chat's response_format or None, the format as the response shows it)."""
    if value is None:
        return None, {"type": "text"}
    if not isinstance(value, dict):
        raise RequestError("'text' must be an object: {'format': {...}}", "text")
    for key, v in value.items():
        if key not in ("format", "verbosity") and v is not None:
            raise RequestError(f"Unrecognized field supplied: text.{key}", f"text.{key}", code="unknown_parameter")
    if value.get("verbosity") not in (None, "medium"):
        raise RequestError("'text.verbosity' (a reasoning model's length) is not supported by this server yet; "
                           "leave it out or send \"medium\"", "text.verbosity", code="unsupported_parameter")
    fmt = value.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or (kind == "text" and set(fmt) == {"type"}):
        return None, {"type": "text"}
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}, {"type": "json_object"}
    if kind == "json_schema" and set(fmt) <= FORMAT_KEYS:
        name = fmt.get("name")
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)):
            raise RequestError(f"'text.format.name' must be 1-64 letters, digits, _ or -, got {name!r}",
                               "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("'text.format.schema' must be a JSON schema object", "text.format.schema")
        for key, kinds in (("strict", (bool,)), ("description", (str,))):
            if fmt.get(key) is not None and not isinstance(fmt[key], kinds):
                raise RequestError(f"'text.format.{key}' must be a {kinds[0].__name__}", f"text.format.{key}")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}, {"type": "json_schema", **inner}
    raise RequestError("'text.format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                       "'name': ..., 'schema': {...}, 'strict': true}", "text.format")


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if not (isinstance(value, dict) and len(value) <= MAX_METADATA and all(
            isinstance(k, str) and 0 < len(k) <= MAX_METADATA_KEY and isinstance(v, str)
            and len(v) <= MAX_METADATA_VALUE for k, v in value.items())):
        raise RequestError(f"'metadata' must be an object of at most {MAX_METADATA} string values (keys of at most "
                           f"{MAX_METADATA_KEY} characters, values of at most {MAX_METADATA_VALUE})", "metadata")
    return value


# ---- the response: its stream events and object, made from its client events -----------------------------------

FINISH_STATUS = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}  # else: incomplete
TERMINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                  "cancelled": "response.incomplete", "failed": "response.failed"}


def responses_usage(usage: Usage) -> dict:
    """The Responses API's usage (cached_tokens: prompt tokens the prefix cache supplied)."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


class ResponseShape:
    """One response's stream events and object, made from its request's client events in order: `start()` (created,
    in_progress), then `push(event)` for each. Deterministic -- ids come from the response's id, not from chance --
    so every reading of the same log numbers the same events the same way.

    Output: at most one `message` item (text before any call), then one `function_call` item per call."""

    def __init__(self, record: StoredResponse, spec: GenerationSpec):
        self.record = record
        self.key = record.request_id
        self.parser = tool_parser(spec, record.request_id)
        self.seq = 0
        self.status = "queued" if record.background else "in_progress"
        self.output: list[dict] = []
        self.open: dict | None = None  # the output item being written (the last one)
        self.usage: dict | None = None
        self.error: dict | None = None
        self.incomplete: dict | None = None

    def response(self) -> dict:
        r = self.record
        return {"id": r.id, "object": "response", "created_at": r.created_at, "status": self.status,
                "background": r.background, "error": self.error, "incomplete_details": self.incomplete, **r.echo,
                "output": copy.deepcopy(self.output), "usage": self.usage}

    def turn(self) -> dict:
        """What this response adds to its conversation: one assistant message (its text and calls)."""
        msg = {"role": "assistant", "content": "".join(p["text"] for item in self.output if item["type"] == "message"
                                                       for p in item["content"])}
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = calls
        return msg

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        created = self._event("response.created", response=self.response())
        self.status = "in_progress"
        return [created, self._event("response.in_progress", response=self.response())]

    def replay(self, events: list[ClientEvent]) -> None:
        self.start()
        for ev in events:
            self.push(ev)

    def push(self, ev: ClientEvent) -> list[dict]:
        if isinstance(ev, TokenEvent):
            if not ev.text:
                return []
            return self._tool_events(self.parser.push(ev.text) if self.parser else [ContentDelta(ev.text)])
        if isinstance(ev, ErrorEvent):
            out = self._close("incomplete")
            self.status, self.error = "failed", {"code": ev.code, "message": ev.message}
            return out + [self._event("response.failed", response=self.response())]
        assert isinstance(ev, DoneEvent)
        out = self._tool_events(self.parser.finish()) if self.parser else []
        status = FINISH_STATUS.get(ev.finish_reason, "incomplete")
        if not self.output and status == "completed":  # an answer that ended by itself has its message, if empty
            out += self._open_message()
        out += self._close("completed" if status == "completed" else "incomplete")
        self.status, self.usage = status, responses_usage(ev.usage)
        if ev.finish_reason == "length":
            self.incomplete = {"reason": "max_output_tokens"}
        return out + [self._event(TERMINAL_EVENT[status], response=self.response())]

    def _tool_events(self, events: list[ToolEvent]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                if self.open is None or self.open["type"] != "message":
                    out += self._close("completed") + self._open_message()
                part = self.open["content"][0]
                part["text"] += ev.text
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=len(self.output) - 1, content_index=0, delta=ev.text,
                                       logprobs=[]))
            elif isinstance(ev, CallStarted):
                out += self._close("completed")
                item = {"id": f"fc_{self.key}_{ev.index}", "type": "function_call", "status": "in_progress",
                        "call_id": f"call_{self.key}_{ev.index}", "name": ev.name, "arguments": ""}
                out += self._add(item)
            else:
                assert isinstance(ev, ArgumentsDelta) and self.open is not None
                self.open["arguments"] += ev.fragment
                out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                       output_index=len(self.output) - 1, delta=ev.fragment))
        return out

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=copy.deepcopy(item))]

    def _open_message(self) -> list[dict]:
        out = self._add({"id": f"msg_{self.key}", "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"].append(part)
        return out + [self._event("response.content_part.added", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, content_index=0, part=copy.deepcopy(part))]

    def _close(self, status: str) -> list[dict]:
        """End the open output item (if any) with `status`: its done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.output) - 1, []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=copy.deepcopy(part)))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        return out + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


def settle(store: ResponseStore, record: StoredResponse) -> None:
    """An ended response, made final once: its object and conversation turn from its log; its handle let go (the
    log stays readable as long as the gateway keeps ended requests' logs). No-op while it runs or once settled."""
    handle = record.handle
    if record.final is not None or handle is None or not handle.log.ended:
        return
    shape = ResponseShape(record, handle.spec)
    shape.replay(handle.log.events)
    record.final, record.output_messages = shape.response(), [shape.turn()]
    record.ended_at, record.handle = handle.ended_at, None
    store.save(record)


def response_object(store: ResponseStore, record: StoredResponse) -> dict:
    """The response as it stands: final once ended, else made from its log so far."""
    settle(store, record)
    if record.final is not None:
        return record.final
    shape = ResponseShape(record, record.handle.spec)
    shape.replay(list(record.handle.log.events))
    return shape.response()


# ---- the handlers ------------------------------------------------------------------------------------------------

async def _stream(request: web.Request, gw: Gateway, record: StoredResponse, handle: RequestHandle,
                  after: int = -1) -> web.StreamResponse:
    """The response's events with sequence numbers after `after` (each event's id), following its log to its end. A
    cursor past the last event gets an error event saying so."""
    out = await sse.SSEStream.open(request)
    shape = ResponseShape(record, handle.spec)

    async def send(events: list[dict]) -> None:
        await out.send_frames([sse.frame(ev, event=ev["type"], id=ev["sequence_number"]) for ev in events
                               if ev["sequence_number"] > after])

    await send(shape.start())
    async with contextlib.aclosing(gw.events(handle)) as events:
        async for _, ev in events:
            await send(shape.push(ev))
    if after >= shape.seq:
        await _error_event(out, sse.past_the_end(after, shape.seq - 1, "starting_after"), after)
    return await out.close()


async def _error_event(out: sse.SSEStream, e: RequestError, after: int) -> None:
    """An error as the stream's last event, without an id (not an event of the response: a reconnecting client keeps
    its cursor)."""
    await out.send({"type": "error", "code": e.code, "param": e.param, "message": e.message,
                    "sequence_number": after + 1}, event="error")


# a stored response is its tenant's (schemas.cache_tenant: its request's `user` or `prompt_cache_key`, as the prefix
# cache scopes them): any other tenant, or a request naming none, is told it does not exist -- the same answer as for
# an id never stored, so nothing tells one tenant what another keeps
OTHER_TENANT = ("or it was created with another `user` / `prompt_cache_key` (send the same ones: in the body, or "
                "as query parameters of GET, DELETE and cancel)")


def _find(store: ResponseStore, rid: str, tenant: str) -> StoredResponse | None:
    record = store.get(rid)
    return record if record is not None and record.tenant == tenant else None


async def _record(request: web.Request) -> StoredResponse:
    rid = request.match_info["id"]
    await request.app[GATEWAY].wait_readopted()  # a restarted gateway's background responses are back first
    record = _find(request.app[RESPONSES], rid, cache_tenant(request.query))
    if record is None:
        raise RequestError(f"no response {rid[:80]!r} here: it was created with store: false, deleted, forgotten "
                           f"(an ended response is kept {request.app[GATEWAY].config.stored_responses_ttl_s:g} s), "
                           f"never existed, {OTHER_TENANT}", status=404, code="response_not_found")
    return record


def _previous(store: ResponseStore, pid: str, tenant: str) -> list[dict]:
    record = _find(store, pid, tenant)
    if record is None:
        raise RequestError(f"previous response {pid[:80]!r} not found: it was created with store: false, deleted, "
                           f"forgotten, never existed, {OTHER_TENANT}", "previous_response_id",
                           code="previous_response_not_found")
    settle(store, record)
    if not record.ended:
        raise RequestError(f"previous response {pid!r} is still in progress; continue it once it has ended",
                           "previous_response_id")
    return [*record.messages, *record.output_messages]


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    gw, store = request.app[GATEWAY], request.app[RESPONSES]
    body = await json_body(request)
    req = parse_request(body, lambda pid: _previous(store, pid, cache_tenant(body)))
    echo = {"model": gw.config.model_id, **req.echo}
    try:  # a background response is logged with what its record needs, to come back after a gateway restart
        handle = await gw.start(req.chat_body, chat=True, session=request.headers.get(SESSION_HEADER),
                                cancel_on_leave=not req.background, keep_log=req.store,
                                detached={"echo": echo, "messages": req.messages} if req.background else None)
    except RequestError as e:
        raise e.named(req.name) from None
    record = StoredResponse(f"resp_{handle.id}", handle.created, echo, req.messages, req.background, handle)
    if req.store:
        store.save(record)
    try:
        if req.stream:
            return await _stream(request, gw, record, handle)
        shape = ResponseShape(record, handle.spec)
        if req.background:  # queued; read it back by its id
            return web.json_response(shape.response())
        tokens, done = await gw.collect(handle)  # an error event raises as the HTTP error
        shape.replay([*tokens, done])
        return web.json_response(shape.response())
    finally:
        if not req.background:  # a background response runs on without readers: only cancel or its deadline end it
            gw.leave(handle)
        if req.store:
            settle(store, record)


def _query_flag(request: web.Request, key: str) -> bool:
    raw = request.query.get(key, "false").lower()
    if raw not in ("true", "false", "1", "0", ""):
        raise RequestError(f"'{key}' must be true or false, got {raw[:40]!r}", key)
    return raw in ("true", "1")


async def get_response(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id}: the response object, or with ?stream=true its events after `starting_after`."""
    gw, store = request.app[GATEWAY], request.app[RESPONSES]
    record = await _record(request)
    if not _query_flag(request, "stream"):
        return web.json_response(response_object(store, record))
    after = sse.sequence_cursor(request)
    handle = record.handle or gw.requests.get(record.request_id)
    if handle is None:  # settled, and its log forgotten since
        out = await sse.SSEStream.open(request)
        await _error_event(out, RequestError(
            f"the events of {record.id} are no longer kept (a stream stays readable {KEEP_ENDED_S:g} s after it "
            f"ends, the {KEEP_ENDED} most recent); GET /v1/responses/{record.id} without stream=true returns the "
            "whole response", code="stream_expired"), after)
        return await out.close()
    try:
        return await _stream(request, gw, record, handle, after)
    finally:
        settle(store, record)


async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: ends a background response (its object, status cancelled, once ended)."""
    gw, store = request.app[GATEWAY], request.app[RESPONSES]
    record = await _record(request)
    if not record.background:
        raise RequestError(f"only a response created with background: true can be cancelled; {record.id} was not",
                           code="not_cancellable")
    handle = record.handle
    if handle is not None and not handle.log.ended:
        gw.replicas.cancel(handle.seq)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_S), contextlib.aclosing(gw.events(handle)) as events:
                async for _ in events:
                    pass
    return web.json_response(response_object(store, record))


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forgets it -- its object, its events and its rows in the durable log (and ends it,
    if it still runs)."""
    gw, store = request.app[GATEWAY], request.app[RESPONSES]
    record = await _record(request)
    gw.forget(record.request_id)
    store.delete(record.id)
    return web.json_response({"id": record.id, "object": "response.deleted", "deleted": True})


def readopted_into(store: ResponseStore) -> Callable[[RequestHandle, dict], None]:
    """The Gateway's on_readopt for the Responses API (given to its constructor): a background response a restarted
    gateway took back from its request log (Gateway.readopt) is stored again, running."""
    def readopted(handle: RequestHandle, logged: dict) -> None:
        store.save(StoredResponse(f"resp_{handle.id}", handle.created, logged["echo"], logged["messages"], True,
                                  handle))

    return readopted


def add_responses_api(app: web.Application, store: ResponseStore) -> None:
    """The Responses API's routes on `app` (whose GATEWAY they serve, made with on_readopt=readopted_into(store)),
    its responses kept in `store`."""
    app[RESPONSES] = store
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", get_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)
    app.router.add_post("/v1/responses/{id}/cancel", cancel_response)
