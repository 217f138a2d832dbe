"""Tool calling (OpenAI's `tools`): how tool definitions, the assistant's calls and their results reach the prompt,
and how calls are read back out of the generated text.

The format is the one Hermes and Qwen models are trained on and their templates write: the tools as JSON inside
<tools></tools> in the system message, each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
each result inside <tool_response></tool_response> in a user turn. It is rendered into ordinary messages here, so
every chat template -- with or without tool support of its own -- gets the same prompt (docs/openai.md#tools).
With tool_choice "required" or a named function, the grammar makes the whole answer one call's JSON object
(`forced_call_schema`), so its arguments always parse and follow the function's schema."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Union

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PREAMBLE = (
    "You can call functions to help with the user's request. The functions, each described by a JSON schema:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a <tool_call></tool_call> block per call holding a JSON object with the function's "
    "name and its arguments:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n</tool_call>")


def _call_text(call: dict) -> str:
    fn = call["function"]
    return f'{CALL_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": {fn["arguments"]}}}\n{CALL_CLOSE}'


def tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages (as parse_messages gives them) -> plain {role, content} messages holding the tools, the calls and
    their results as text. Consecutive tool results become one user turn (templates that insist on alternating
    roles accept it)."""
    out: list[dict] = []
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": preamble})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            out.append({"role": "assistant", "content": "\n".join(parts + [_call_text(c) for c in m["tool_calls"]])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def forced_call_schema(tools: list[dict], choice: str | dict) -> dict:
    """The JSON schema of the answer when a call is required: {"name": one of the tools, "arguments": its
    parameters}, for one named function or any of them."""
    def call(fn: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}

    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return call(next(t["function"] for t in tools if t["function"]["name"] == name))
    calls = [call(t["function"]) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def new_call_id(request_id: str | None = None, index: int = 0) -> str:
    """A tool call's id: `call_<request id>_<index>` -- the same on every reading of the request's log, so a resumed
    stream names its calls as the first reading did -- or, without a request, a random one."""
    return f"call_{request_id}_{index}" if request_id is not None else "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ContentDelta:
    """Answer text outside any call."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """Call `index` begins: its id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next fragment of call `index`'s arguments (JSON text)."""

    index: int
    fragment: str


ToolEvent = Union[ContentDelta, CallStarted, ArgumentsDelta]


# The forced answer's opening, exactly as the grammar writes it (shared.text.grammar.JSON_STYLE separators).
_FORCED_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


@dataclass
class ToolCallParser:
    """Generated text -> content and tool calls, as it streams. `push(text)` returns ToolEvents in order
    (ContentDelta, CallStarted, ArgumentsDelta); `finish()` the rest.

    forced: the whole text is one call's JSON object (the grammar made it so); its arguments stream as they come,
    less the closing brace. Otherwise content streams until a <tool_call> tag (text that could begin one is held
    back); each tagged call is reported whole once its closing tag arrives, and text after the calls is dropped."""

    forced: bool
    request_id: str | None = None  # names the calls (new_call_id)
    calls: list[dict] = field(default_factory=list)  # {"id", "type": "function", "function": {"name", "arguments"}}
    _buffer: str = ""
    _in_call: bool = False  # (not forced) inside <tool_call>...</tool_call>

    def push(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        return self._forced() if self.forced else self._tagged()

    def finish(self) -> list[ToolEvent]:
        if self.forced:
            events = self._forced()
            if self.calls:  # the rest, less the object's closing brace
                rest = self._buffer[:-1] if self._buffer.endswith("}") else self._buffer
                self._buffer = ""
                if rest:
                    self.calls[-1]["function"]["arguments"] += rest
                    events.append(ArgumentsDelta(0, rest))
            return events
        if self._in_call or not self._buffer:
            return []  # an unfinished call is not a call
        text, self._buffer = self._buffer, ""
        return [ContentDelta(text)] if not self.calls else []

    def _forced(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self.calls:
            m = _FORCED_HEAD.match(self._buffer)
            if m is None:
                return events
            name = json.loads(f'"{m.group(1)}"')
            self.calls.append({"id": new_call_id(self.request_id), "type": "function",
                               "function": {"name": name, "arguments": ""}})
            events.append(CallStarted(0, self.calls[0]["id"], name))
            self._buffer = self._buffer[m.end():]
        if len(self._buffer) > 1:  # hold back the last character: it may be the object's closing brace
            fragment, self._buffer = self._buffer[:-1], self._buffer[-1:]
            self.calls[0]["function"]["arguments"] += fragment
            events.append(ArgumentsDelta(0, fragment))
        return events

    def _tagged(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE):]
                self._in_call = False
                events.extend(self._call(body))
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                if start and not self.calls:
                    events.append(ContentDelta(self._buffer[:start]))
                self._buffer = self._buffer[start + len(CALL_OPEN):]
                self._in_call = True
                continue
            if self.calls:  # after a call only further calls count; whitespace between them is kept for now
                keep = _open_prefix(self._buffer)
                self._buffer = self._buffer[len(self._buffer) - keep:] if keep else ""
                return events
            keep = _open_prefix(self._buffer)
            emit = self._buffer[:len(self._buffer) - keep]
            if emit:
                events.append(ContentDelta(emit))
            self._buffer = self._buffer[len(emit):]
            return events

    def _call(self, body: str) -> list[ToolEvent]:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            return []  # not a call this parser can report; dropped rather than shown half-parsed
        index = len(self.calls)
        args = json.dumps(obj["arguments"])
        self.calls.append({"id": new_call_id(self.request_id, index), "type": "function",
                           "function": {"name": obj["name"], "arguments": args}})
        return [CallStarted(index, self.calls[index]["id"], obj["name"]), ArgumentsDelta(index, args)]


def _open_prefix(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of <tool_call> (held back: it may begin one)."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
