"""Validation of everything a client sends, at the edge. Bad input raises RequestError (-> 4xx in OpenAI's error
shape, or a websocket error event) and never reaches a stage."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.batch.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 128
MAX_MESSAGES = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_COMPLETION_LOGPROBS = 5  # completions' integer logprobs: that many alternatives per token (OpenAI's limit)
ROLES = ("system", "user", "assistant", "tool")


Path = tuple[str | int, ...]  # a field of a request: its keys and list indexes, ("messages", 2, "content")
_PATH_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def path_text(path: Path) -> str:
    """("messages", 2, "content") -> "messages[2].content": a field as the chat path's names write it."""
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def as_path(param: str | Path) -> Path:
    """A field given as its text ("messages[2].content", what the validators write) or as a path -> its path."""
    if isinstance(param, tuple):
        return param
    path = tuple(int(index) if index else key for key, index in _PATH_PART.findall(param))
    return path if path_text(path) == param else (param,)  # a key of brackets or dots: kept whole, as written


class RequestError(Exception):
    """A request refused, with what was wrong (`message`), the field at fault (`path`, structured: its keys and
    indexes), the HTTP status and a code. The message names fields through placeholders -- `{param}` for the field
    at fault, `{<name>}` for fields[name] -- so each API surface renders both in its own names (`named`: the
    Messages or Responses field a chat path's field came from) from the paths, never from the text. `param` and
    `message` are the rendered ones (by default in the chat path's names, path_text)."""

    def __init__(self, message: str, param: str | Path | None = None, status: int = 400,
                 code: str = "invalid_request", fields: dict[str, str | Path] | None = None,
                 namer: Callable[[Path], str] = path_text):
        super().__init__(message)
        self.template, self.status, self.code, self.namer = message, status, code, namer
        self.path: Path | None = None if param is None else as_path(param)
        self.fields = {name: as_path(f) for name, f in (fields or {}).items()}

    @property
    def param(self) -> str | None:
        return None if self.path is None else self.namer(self.path)

    @property
    def message(self) -> str:
        paths = {"param": self.path, **self.fields}

        def field(m: re.Match) -> str:
            path = paths.get(m.group(1))
            return m.group(0) if path is None else self.namer(path)
        return _PLACEHOLDER.sub(field, self.template)

    def __str__(self) -> str:
        return self.message

    def named(self, namer: Callable[[Path], str]) -> RequestError:
        """The same error, its fields named by `namer` (a surface's names for the chat path's fields)."""
        return RequestError(self.template, self.path, self.status, self.code, self.fields, namer)

    def openai_body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_exceeded", 500: "server_error", 503: "server_unavailable"}.get(
                    self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The error in the Anthropic Messages API's shape (its types by status; 503 is its "overloaded")."""
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}.get(
                    self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def parse_json_text(text: str) -> Any:
    """JSON text -> value, or RequestError for anything Python's parser cannot turn into a request: syntax errors,
    nesting deep enough to exhaust the recursion limit, integers longer than Python's 4,300-digit conversion cap.
    (Lone surrogates parse; `unicode_text` refuses them where strings are used.)"""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                           code="invalid_json") from None
    except RecursionError:
        raise RequestError("the JSON is nested too deeply; requests need only a few levels", code="invalid_json") from None
    except ValueError as e:  # int() digit cap: "Exceeds the limit (4300 digits) for integer string conversion"
        raise RequestError(f"the JSON holds a number Python refuses to convert ({str(e).split(':')[0]}); "
                           "send numbers of at most a few digits", code="invalid_json") from None


def unicode_text(value: str, param: str | Path) -> str:
    """A client string that must become UTF-8 (prompt, content, stop): lone surrogates such as "\\ud800" are
    valid JSON but no text, and would fail deep inside the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{{param}}' holds an unpaired surrogate (\\u{ord(value[e.start]):04x}) at character "
                           f"{e.start}; send valid Unicode text", param) from None
    return value


@dataclass
class GenerationSpec:
    """A validated generation request, before tokenization."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False  # each token's logprob; sampling.top_logprobs: that many alternatives with it
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (load testing)
    trace: bool = False  # return per-layer captures (stagemesh trace)
    include_usage: bool = False
    resumable: bool = False  # keeps generating when its connection drops; GET /v1/streams/{id} reads it again
    cache_tenant: str = ""  # whose cached prefixes it may use (cache_salt, prompt_cache_key or user; "": shared)
    prediction: str | None = None  # the output the client expects (OpenAI's Predicted Outputs): drafts to verify
    speculation: bool = True  # false: no n-gram drafts for it (the gateway's --speculation auto otherwise decides)
    timeout_s: float | None = None
    json_schema: dict | None = None  # response_format json_object / json_schema: the output is constrained to it
    tools: list[dict] | None = None  # validated {"type": "function", "function": {name, description, parameters}}
    tool_choice: str | dict = "none"  # none | auto | required | {"type": "function", "function": {"name": ...}}
    continue_final: bool = False  # vLLM's continue_final_message: the last (assistant) message goes on

    @property
    def forced_tool(self) -> bool:
        """The output is exactly one tool call, constrained by the grammar (tool_choice required or a function)."""
        return self.tools is not None and self.tool_choice != "auto" and self.tool_choice != "none"


def _number(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi):
        raise RequestError(f"'{{param}}' must be a number between {lo} and {hi}, got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
        raise RequestError(f"'{{param}}' must be an integer between {lo} and {hi}, got {v!r}", key)
    return v


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{{param}}' must be true or false, got {v!r}", key)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in items):
        raise RequestError(f"'{{param}}' must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings "
                           f"of at most {MAX_STOP_LEN} characters", "stop")
    return [unicode_text(s, "stop") for s in items]


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if isinstance(c, str):
        return unicode_text(c, f"messages[{i}].content")
    if isinstance(c, list):  # OpenAI content parts: only text is supported
        texts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError("{param} parts must be {'type': 'text', 'text': ...}", ("messages", i, "content"))
            texts.append(part["text"])
        return unicode_text("".join(texts), f"messages[{i}].content")
    raise RequestError("{param} must be a string or a list of text parts", ("messages", i, "content"))


# Message fields OpenAI defines that would change the prompt but are not rendered yet (refused unless null).
MESSAGE_NOT_YET = {"name": "the chat template has no participant names",
                   "function_call": "the deprecated form of tool_calls; send tool_calls",
                   "audio": "text only", "refusal": "an assistant refusal is not rendered",
                   "annotations": "not rendered"}
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def _tool_calls(value: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls -> [{"id", "type": "function", "function": {"name", "arguments"}}], with
    arguments a JSON object's text (as the SDK sends them back)."""
    param = ("messages", i, "tool_calls")
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise RequestError("{param} must be a non-empty list of tool calls", param)
    calls = []
    for k, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("id"), str)
                and isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise RequestError("{call} must be {'id': str, 'type': 'function', 'function': {'name': str, "
                               "'arguments': str}}", param, fields={"call": (*param, k)})
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise RequestError(f"{{call}} must be a JSON object's text, got {fn['arguments'][:80]!r}", param,
                               fields={"call": (*param, k, "function", "arguments")})
        calls.append({"id": unicode_text(c["id"], param), "type": "function",
                      "function": {"name": unicode_text(fn["name"], param), "arguments": unicode_text(fn["arguments"], param)}})
    return calls


TOOL_MESSAGE_FIELDS = {"assistant": " and 'tool_calls'", "tool": " and 'tool_call_id'"}


def parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("'{param}' must be a non-empty list of {role, content} objects", "messages")
    if len(value) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{{message}} needs a role among {', '.join(ROLES)}", ("messages", i, "role"),
                               fields={"message": ("messages", i)})
        role = m["role"]
        for key, v in m.items():  # null = left out (the SDK echoes an assistant message with refusal: null, ...)
            if key in ("role", "content") or v is None:
                continue
            if (key == "tool_calls" and role == "assistant") or (key == "tool_call_id" and role == "tool"):
                continue
            if key in MESSAGE_NOT_YET:
                raise RequestError(f"{{param}} is not supported by this server yet ({MESSAGE_NOT_YET[key]}); "
                                   "leave it out", ("messages", i, key), code="unsupported_parameter")
            raise RequestError(f"Unrecognized message field supplied: {{param}}; a {role} message has "
                               f"'role', 'content'{TOOL_MESSAGE_FIELDS.get(role, '')}", ("messages", i, key),
                               code="unknown_parameter")
        msg = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            msg["content"] = "" if m.get("content") is None else _content(m, i)  # null beside tool calls
        else:
            msg["content"] = _content(m, i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError("{message} (a tool result) needs 'tool_call_id': the id of the call it answers",
                                   ("messages", i, "tool_call_id"), fields={"message": ("messages", i)})
            msg["tool_call_id"] = unicode_text(m["tool_call_id"], f"messages[{i}].tool_call_id")
        out.append(msg)
    if sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in out) > MAX_PROMPT_CHARS:
        raise RequestError(f"messages exceed {MAX_PROMPT_CHARS} characters", "messages")
    return out


# Every top-level field a request may carry, by what it does here (docs/openai.md lists them for users). A field
# sent as null is the same as a field left out, as in OpenAI's API.
READ_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                         "stream_options", "logprobs", "n", "ignore_eos", "trace", "timeout", "min_p",
                         "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "response_format", "resumable", "cache_salt", "prompt_cache_key", "user", "prediction",
                         "speculation"})
CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "continue_final_message"})
COMPLETION_FIELDS = frozenset({"prompt"})
# Accepted and ignored: none of them can change the tokens generated (bookkeeping for the caller's own records, or
# options of features this server refuses when they would take effect). Value: the JSON types accepted.
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,), "store": (bool,), "service_tier": (str,), "safety_identifier": (str,),
}


# Known OpenAI (and vLLM/llama.cpp) fields not implemented yet: accepted only at the value that leaves the output
# as it is, refused otherwise. Value: (is the value neutral, the neutral value as a client writes it, what it does).
NOT_YET_FIELDS: dict[str, tuple[Any, str, str]] = {
    "functions": (lambda v: v == [], "[]", "the deprecated form of 'tools'; send tools"),
    "function_call": (lambda v: v == "none", '"none"', "the deprecated form of 'tool_choice'; send tool_choice"),
    "echo": (lambda v: v is False, "false", "returns the prompt with the completion"),
    "best_of": (lambda v: not isinstance(v, bool) and v == 1, "1", "generates several completions, returns the best"),
    "suffix": (lambda v: v == "", '""', "inserts the completion before a suffix"),
    "modalities": (lambda v: v == ["text"], '["text"]', "asks for audio output"),
    "audio": (lambda v: False, "null", "asks for audio output"),
    "reasoning_effort": (lambda v: False, "null", "sets a reasoning model's effort"),
    "web_search_options": (lambda v: False, "null", "searches the web"),
}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse what this server would otherwise silently ignore: an unknown field, or a known one not implemented
    yet at a value that would change the output (each with a 400 naming it)."""
    own, other = (CHAT_FIELDS, COMPLETION_FIELDS) if chat else (COMPLETION_FIELDS, CHAT_FIELDS)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key, v in body.items():
        if v is not None and key not in READ_FIELDS and key not in own and key in other:
            raise RequestError(f"'{key}' belongs to the other endpoint than {endpoint}; "
                               f"use {'messages' if not chat else 'prompt'} here", key, code="unknown_parameter")
    check_field_tables(body, READ_FIELDS | own, IGNORED_FIELDS, NOT_YET_FIELDS)


def check_field_tables(body: dict, read: frozenset[str], ignored: dict[str, tuple[type, ...]],
                       not_yet: dict[str, tuple[Any, str, str]],
                       known: str = "the parameters this server reads are listed in docs/openai.md") -> None:
    """Every field of `body` is one an endpoint reads, accepts and ignores (its type checked), or knows but has not
    implemented yet (accepted only at its neutral value: not_yet[key] = (is it neutral, as written, what it does));
    anything else is a 400 naming it and saying where the known ones are (`known`). Null is left out. Every API
    surface's top-level fields go through here."""
    for key, v in body.items():
        if v is None or key in read:
            continue
        if key in ignored:
            if not isinstance(v, ignored[key]) or (isinstance(v, bool) and bool not in ignored[key]):
                kinds = " or ".join({str: "a string", dict: "an object", bool: "true or false"}[t]
                                    for t in ignored[key])
                raise RequestError(f"'{key}' must be {kinds}, got {str(v)[:60]!r}", key)
        elif key in not_yet:
            neutral, as_written, what = not_yet[key]
            if not neutral(v):
                raise RequestError(f"'{key}' ({what}) is not supported by this server yet; leave it out or send "
                                   f"{as_written}", key, code="unsupported_parameter")
        else:
            raise RequestError(f"Unrecognized request argument supplied: '{key}' ({known})", key,
                               code="unknown_parameter")


MAX_SCHEMA_CHARS = 64 << 10


def _schema(value: Any, param: str | Path) -> dict:
    if not isinstance(value, dict):
        raise RequestError("'{param}' must be a JSON schema object", param)
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise RequestError(f"'{{param}}' is longer than {MAX_SCHEMA_CHARS} characters", param)
    cycle = _ref_cycle(value)
    if cycle:
        raise RequestError(f"'{{param}}' refers to itself ({' -> '.join(cycle)}): a recursive schema has no finite "
                           "answer this server can guarantee; unroll it to a fixed depth", param)
    return value


def _ref_cycle(schema: dict) -> list[str] | None:
    """A chain of local $refs ("#/...") that comes back to where it started, or None. A $ref that leaves the
    document or names nothing is left to the grammar compiler (it refuses it)."""
    def resolve(ref: str):
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def refs(node, out: list[str]) -> list[str]:  # the $refs inside node, not through other $refs
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
                out.append(node["$ref"])
            for v in node.values():
                refs(v, out)
        elif isinstance(node, list):
            for v in node:
                refs(v, out)
        return out

    def visit(ref: str, path: list[str]) -> list[str] | None:
        if ref in path:
            return path[path.index(ref):] + [ref]
        target = resolve(ref)
        for inner in refs(target, []) if target is not None else []:
            found = visit(inner, path + [ref])
            if found:
                return found
        return None

    for ref in refs(schema, []):
        found = visit(ref, [])
        if found:
            return found
    return None


def _response_format(body: dict) -> dict | None:
    """response_format -> the JSON schema the output must follow (None: free text)."""
    v = body.get("response_format")
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or \
                not set(js) <= {"name", "schema", "strict", "description"}:
            raise RequestError("'{json_schema}' must be {'name': str, 'schema': {...}, 'strict': bool}",
                               "response_format", fields={"json_schema": ("response_format", "json_schema")})
        return _schema(js.get("schema", {}), "response_format.json_schema.schema")
    raise RequestError("'{param}' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                       "'json_schema', 'json_schema': {...}}", "response_format")


def _tools(body: dict) -> tuple[list[dict] | None, str | dict]:
    """tools and tool_choice -> (validated tools or None, the choice)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools' to choose from", "tool_choice")
        return None, "none"
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    out, names = [], set()
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and set(fn) <= {"name", "description", "parameters", "strict"}):
            raise RequestError(f"tools[{k}] must be {{'type': 'function', 'function': {{'name', 'description', "
                               "'parameters', 'strict'}}}}", f"tools[{k}]")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or name in names:
            raise RequestError(f"{{param}} must be a unique name of 1-64 letters, digits, _ or -, got {name!r}",
                               ("tools", k, "function", "name"))
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise RequestError("{param} must be a string", ("tools", k, "function", "description"))
        params = _schema(fn.get("parameters") or {"type": "object", "properties": {}},
                         ("tools", k, "function", "parameters"))
        if params.get("type", "object") != "object":
            raise RequestError(f"{{param}} must describe an object (\"type\": \"object\"): a call's arguments are a "
                               f"JSON object, got type {params.get('type')!r}", ("tools", k, "function", "parameters"))
        entry = {"name": name, "parameters": params}
        if desc:
            entry["description"] = unicode_text(desc, f"tools[{k}].function.description")
        out.append({"type": "function", "function": entry})
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(fn, dict) and fn.get("name") in names):
            raise RequestError(f"'tool_choice' must be none, auto, required or {{'type': 'function', 'function': "
                               f"{{'name': one of {sorted(names)}}}}}", "tool_choice")
        choice = {"type": "function", "function": {"name": fn["name"]}}
    elif choice not in ("none", "auto", "required"):
        raise RequestError("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                           "{'name': ...}}", "tool_choice")
    bool_field(body, "parallel_tool_calls", True)
    return out, choice


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias -100..100} (at most MAX_LOGIT_BIAS) -> ((id, bias), ...) sorted."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to "
                           "biases between -100 and 100", "logit_bias")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise RequestError(f"'logit_bias' key {key!r} is not a token id of this model (0..{vocab_size - 1})",
                               "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f"'logit_bias' for token {key} must be a number between -100 and 100, got {bias!r}",
                               "logit_bias")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def parse_generation(body: Any, chat: bool, max_context: int, vocab_size: int) -> GenerationSpec:
    """OpenAI-style body (also the websocket `generate` message, its `id` and `type` taken out) -> GenerationSpec."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body, chat)
    spec = GenerationSpec()
    if chat:
        spec.messages = parse_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", "prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"'prompt' exceeds {MAX_PROMPT_CHARS} characters", "prompt")
        spec.prompt = unicode_text(prompt, "prompt")
    if body.get("n") is not None and body["n"] != 1:
        raise RequestError(f"'n' must be 1 here (one choice per request), got {body['n']!r}; send n parallel "
                           "requests instead", "n", code="unsupported_parameter")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    spec.max_tokens = _integer(body, key, 1, max_context, None)
    spec.stop = _stop(body)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool) and (chat or not isinstance(lp, int)
                                                         or not 0 <= lp <= MAX_COMPLETION_LOGPROBS):
        raise RequestError(f"'logprobs' must be true or false (chat) or an integer 0-{MAX_COMPLETION_LOGPROBS} "
                           "(completions)", "logprobs")
    spec.logprobs = lp if isinstance(lp, bool) else lp is not None  # completions' integer k: the chosen tokens' too
    if chat:
        top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if top_logprobs and not spec.logprobs:
            raise RequestError("'top_logprobs' returns alternatives next to each token's logprob: send it with "
                               "'logprobs': true", "top_logprobs")
    else:
        top_logprobs = 0 if lp is None or isinstance(lp, bool) else lp
    try:
        spec.sampling = SamplingParams(
            temperature=_number(body, "temperature", 0.0, 2.0, 1.0),  # OpenAI default; 0 = greedy
            top_p=_number(body, "top_p", 1e-6, 1.0, 1.0),
            top_k=_integer(body, "top_k", 0, 1_000_000, 0) or 0,
            seed=_integer(body, "seed", 0, 2**62, None),
            min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
            logit_bias=_logit_bias(body, vocab_size),
            logprobs=spec.logprobs,
            presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
            frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 0.01, 10.0, 1.0),
            top_logprobs=top_logprobs,
        )
    except ValueError as e:
        raise RequestError(str(e)) from None
    spec.stream = bool_field(body, "stream")
    spec.ignore_eos = bool_field(body, "ignore_eos")
    spec.trace = bool_field(body, "trace")
    spec.resumable = bool_field(body, "resumable")
    spec.cache_tenant = cache_tenant(body)
    spec.prediction = _prediction(body)
    spec.speculation = bool_field(body, "speculation", True)
    if chat and bool_field(body, "continue_final_message"):
        last = spec.messages[-1]
        if last["role"] != "assistant" or not last["content"].strip() or "tool_calls" in last:
            raise RequestError("'continue_final_message' continues the last message: it must be an assistant message "
                               "with text (and no tool calls)", "continue_final_message")
        if body.get("tools") is not None:
            raise RequestError("'continue_final_message' does not go with 'tools'", "continue_final_message",
                               code="unsupported_parameter")
        spec.continue_final = True
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        spec.include_usage = bool_field(opts, "include_usage")
    spec.timeout_s = _number(body, "timeout", 0.1, 3600.0, None)
    spec.json_schema = _response_format(body)
    if chat:
        spec.tools, spec.tool_choice = _tools(body)
        if spec.tools is not None and spec.tool_choice != "none" and spec.json_schema is not None:
            raise RequestError("'{param}' and 'tools' both decide the output's shape; send one (or "
                               "tool_choice 'none')", "response_format")
        _check_tool_history(spec.messages, spec.tools)
        if spec.tool_choice == "none":
            spec.tools = None  # the model neither sees nor calls them (OpenAI's "none")
    _check_prediction(spec)
    return spec


def _check_prediction(spec: GenerationSpec) -> None:
    """A prediction drafts several positions a step; a grammar (response_format, a forced tool call) or a penalty
    needs one position a step, so with either it would draft nothing: refused rather than silently ignored."""
    if spec.prediction is None:
        return
    against = [name for name, on in (("response_format", spec.json_schema is not None),
                                     ("a forced tool call (tool_choice required or a function)", spec.forced_tool),
                                     ("presence/frequency/repetition penalties", spec.sampling.penalized)) if on]
    if against:
        raise RequestError(f"'prediction' does not go with {' or '.join(against)}: they need one position a step, so "
                           "nothing of the prediction would be drafted; send one or the other", "prediction",
                           code="unsupported_parameter")


def _prediction(body: dict) -> str | None:
    """prediction: {"type": "content", "content": text or [{"type": "text", "text"}]} -> its text."""
    v = body.get("prediction")
    if v is None:
        return None
    content = v.get("content") if isinstance(v, dict) and v.get("type") == "content" and set(v) <= {"type", "content"} \
        else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError("'prediction' must be {'type': 'content', 'content': the text you expect, or a list of "
                           "{'type': 'text', 'text': ...} parts}", "prediction")
    if len(content) > MAX_PROMPT_CHARS:
        raise RequestError(f"'prediction' is longer than {MAX_PROMPT_CHARS} characters", "prediction")
    return content or None


MAX_CACHE_KEY_CHARS = 256
# what scopes a request's prefix cache, first found first: vLLM's cache_salt, OpenAI's prompt_cache_key, OpenAI's user
CACHE_SCOPES = ("cache_salt", "prompt_cache_key", "user")


def cache_tenant(body: dict) -> str:
    """The tenant of a request: prefixes cached under one are invisible to every other (their hash chains share no
    root), so neither `cached_tokens` nor the time to first token tells one tenant what another sent; a stored
    response is its tenant's alone (services/gateway/api/responses.py). A request naming none of CACHE_SCOPES is
    in the shared tenant "" (as vLLM without cache_salt)."""
    for key in CACHE_SCOPES:
        value = body.get(key)
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_CACHE_KEY_CHARS):
            raise RequestError(f"'{{param}}' must be a string of 1-{MAX_CACHE_KEY_CHARS} characters", key)
    key = next((k for k in CACHE_SCOPES if body.get(k) is not None), None)
    return f"{key}:{body[key]}" if key else ""


def _check_tool_history(messages: list[dict] | None, tools: list[dict] | None) -> None:
    """Every tool result answers a call an earlier assistant message made; with tools given, every earlier call
    names one of them."""
    names = {t["function"]["name"] for t in tools} if tools is not None else None
    called: set[str] = set()
    for i, m in enumerate(messages or []):
        for k, c in enumerate(m.get("tool_calls", ())):
            if names is not None and c["function"]["name"] not in names:
                raise RequestError(f"{{call}} calls {c['function']['name']!r}, which is not among 'tools' "
                                   f"({', '.join(sorted(names))})", ("messages", i, "tool_calls"),
                                   fields={"call": ("messages", i, "tool_calls", k)})
            called.add(c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise RequestError(f"{{message}} answers tool call {m['tool_call_id']!r}, which no earlier assistant "
                               "message made", ("messages", i, "tool_call_id"), fields={"message": ("messages", i)})
