"""Chat templates from GGUF, rendered in jinja2's ImmutableSandboxedEnvironment with a time and an output cap.

The sandbox refuses attribute walking (`''.__class__.__mro__...`); the caps stop templates that loop or grow
without bound. The time cap is enforced by a trace function in the rendering thread, so even a loop that
produces no output is stopped.

`render_segments` tells the template's own text from the client's: every string in the messages enters the
template as a `_ClientText` that renders framed by per-render nonce markers and keeps its mark through the
operations templates apply to content (`+`, `~`, `|trim`, `.strip()`, `.split()`, slicing, iteration, case
changes, `%`). The prompt builder tokenizes only the unmarked text with special-token parsing."""

from __future__ import annotations

import re
import secrets
import sys
import time
from datetime import datetime

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.filters import soft_str
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import ChatTemplateError

DEFAULT_TIME_LIMIT_S = 1.0
DEFAULT_OUTPUT_LIMIT = 1 << 20  # characters
_MAX_REPEAT = 1 << 20  # `'x' * n` and `n ** m` are capped too


class _Capped(Exception):
    pass


class _CappedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and right > 64:
            raise SecurityError("exponent too large in chat template")
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > _MAX_REPEAT:
                    raise SecurityError("repetition too large in chat template")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj, attribute):
        return super().getattr(_as_marked(obj), attribute)


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused these messages: {message}")


class _ClientText(str):
    """A client's string inside a template: compares, hashes and measures as its text, renders framed by markers.

    Every str method that returns (part of) the text returns a _ClientText, so the mark survives the ways templates
    use content. A concatenation becomes a _Marked: the markers sit inside its text."""

    OPEN = CLOSE = ""  # set per render on a subclass (see _marking)

    def _wrap(self, value):
        return type(self)(value)

    def __str__(self):
        return f"{self.OPEN}{str.__str__(self)}{self.CLOSE}"

    def __format__(self, spec):
        return str(self) if not spec else f"{self.OPEN}{str.__format__(str.__str__(self), spec)}{self.CLOSE}"

    def __add__(self, other):
        return _Marked(str(self) + str(other)) if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return _Marked(str(other) + str(self)) if isinstance(other, str) else NotImplemented

    def __mul__(self, n):
        return self._wrap(str.__mul__(self, n))

    __rmul__ = __mul__

    def __mod__(self, args):
        return self._wrap(str.__mod__(self, args))

    def __getitem__(self, key):
        return self._wrap(str.__getitem__(self, key))

    def __iter__(self):
        return (self._wrap(c) for c in str.__iter__(self))


def _text_method(name):
    method = getattr(str, name)

    def wrapped(self, *args, **kwargs):
        return self._wrap(method(self, *args, **kwargs))

    wrapped.__name__ = name
    return wrapped


def _list_method(name):
    method = getattr(str, name)

    def wrapped(self, *args, **kwargs):
        parts = method(self, *args, **kwargs)
        return type(parts)(self._wrap(p) for p in parts)

    wrapped.__name__ = name
    return wrapped


for _name in ("strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "casefold", "swapcase",
              "replace", "removeprefix", "removesuffix", "center", "ljust", "rjust", "zfill", "expandtabs"):
    setattr(_ClientText, _name, _text_method(_name))
for _name in ("split", "rsplit", "splitlines", "partition", "rpartition"):
    setattr(_ClientText, _name, _list_method(_name))


# Any render's markers (nonce inside): what _Marked strips see through.
_ANY_MARKER = re.compile("(\ue000[0-9a-f]{16}\ue001|\ue002[0-9a-f]{16}\ue003)")


class _Marked(str):
    """Template text joined with client text: its characters include the markers. Strips see through them."""

    def __str__(self):
        return str.__str__(self)

    def __add__(self, other):
        return _Marked(str.__str__(self) + str(other)) if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return _Marked(str(other) + str.__str__(self)) if isinstance(other, str) else NotImplemented

    def _strip(self, chars, left: bool, right: bool):
        parts = _ANY_MARKER.split(str.__str__(self))  # text, marker, text, marker, ..., text
        texts = list(range(0, len(parts), 2))
        for ends, fn in ((texts if left else [], str.lstrip), (texts[::-1] if right else [], str.rstrip)):
            for k in ends:
                parts[k] = fn(parts[k], chars)
                if parts[k]:
                    break
        return _Marked("".join(parts))

    def strip(self, chars=None):
        return self._strip(chars, True, True)

    def lstrip(self, chars=None):
        return self._strip(chars, True, False)

    def rstrip(self, chars=None):
        return self._strip(chars, False, True)


def _as_marked(value):
    """A plain str that carries markers (from `~`, `|join`, `|replace`) as a _Marked, so strips see through them."""
    return _Marked(value) if type(value) is str and "\ue000" in value else value


def _marking() -> tuple[type[_ClientText], re.Pattern]:
    """A _ClientText class with fresh nonce markers for one render, and the pattern that finds its markers."""
    nonce = secrets.token_hex(8)
    open_, close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
    split = re.compile(f"({re.escape(open_)}|{re.escape(close)})")
    client = type("_Client", (_ClientText,), {"OPEN": open_, "CLOSE": close})
    return client, split


def _mark_strings(value, client: type[_ClientText]):
    """A copy of messages with every string (content, role, names, ...) turned into client text."""
    if isinstance(value, str):
        return client(value)
    if isinstance(value, dict):
        return {k: _mark_strings(v, client) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_strings(v, client) for v in value]
    return value


def _guard_markup(segments: list[tuple[str, bool]], markup: tuple[str, ...]) -> list[str]:
    """The markup strings (longest first) found in the template's own segments, in order."""
    if not markup:
        return []
    pattern = re.compile("|".join(re.escape(m) for m in sorted(markup, key=len, reverse=True)))
    return [m for text, client in segments if not client for m in pattern.findall(text)]


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, output_limit: int = DEFAULT_OUTPUT_LIMIT):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.time_limit_s, self.output_limit = time_limit_s, output_limit
        env = _CappedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["trim"] = lambda value, chars=None: _as_marked(soft_str(value)).strip(chars)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    def render_segments(self, messages: list[dict], add_generation_prompt: bool = True,
                        markup: tuple[str, ...] = (), **extra) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, from_client) pieces whose concatenation equals `render(...)`.

        Pieces with from_client=False are the template's own text (and bos/eos tokens); the others came from the
        messages. `markup` lists the texts of control tokens: if a client string holds one, the prompt is also
        rendered with that text neutralised, and the template's own pieces must hold the same markup both times —
        content that reached the output through a path that loses its mark (e.g. `|tojson`) is refused rather than
        parsed as markup."""
        client, split = _marking()
        plain = self.render(messages, add_generation_prompt, **extra)
        segments = self._segments(self.render(_mark_strings(messages, client), add_generation_prompt, **extra),
                                  split, client)
        if "".join(text for text, _ in segments) != plain:
            raise ChatTemplateError("the chat template transforms message content in a way the prompt builder cannot "
                                    "track (content and template text mixed before a filter); simplify the template")
        if markup and _holds_any(messages, markup):
            neutral = _neutralise(messages, markup)
            again = self._segments(self.render(_mark_strings(neutral, client), add_generation_prompt, **extra),
                                   split, client)
            if _guard_markup(segments, markup) != _guard_markup(again, markup):
                raise ChatTemplateError("message content reaches the prompt through a template path that loses track "
                                        "of it, and it holds special-token text; remove the special-token text from "
                                        "the content or use a template that inserts content directly")
        return segments

    @staticmethod
    def _segments(text: str, split: re.Pattern, client: type[_ClientText]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        depth = 0
        for k, part in enumerate(split.split(text)):
            if k % 2:
                depth += 1 if part == client.OPEN else -1
                if depth < 0:
                    break
            elif part and out and out[-1][1] == (depth > 0):
                out[-1] = (out[-1][0] + part, depth > 0)
            elif part:
                out.append((part, depth > 0))
        if depth != 0:
            raise ChatTemplateError("the chat template cut a message's content apart from its end; the prompt "
                                    "builder cannot tell content from markup; simplify the template")
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        deadline = time.monotonic() + self.time_limit_s
        previous = sys.gettrace()

        def tracer(frame, event, arg):  # runs on calls/lines in this thread only
            if time.monotonic() > deadline:
                raise _Capped(f"chat template ran longer than {self.time_limit_s:.1f} s")
            return tracer

        parts, size = [], 0
        sys.settrace(tracer)
        try:
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                size += len(chunk)
                if size > self.output_limit:
                    raise _Capped(f"chat template output exceeded {self.output_limit} characters")
                parts.append(chunk)
        except _Capped as e:
            raise ChatTemplateError(f"{e}; the template loops or grows without bound") from None
        except SecurityError as e:
            raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from None
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(previous)
        return "".join(parts)



def _holds_any(value, markup: tuple[str, ...]) -> bool:
    if isinstance(value, str):
        return any(m in value for m in markup)
    if isinstance(value, dict):
        return any(_holds_any(v, markup) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_any(v, markup) for v in value)
    return False


def _neutralise(value, markup: tuple[str, ...]):
    """A copy of messages with every markup text in a string replaced by U+FFFC (so it cannot re-form)."""
    if isinstance(value, str):
        for m in sorted(markup, key=len, reverse=True):
            value = value.replace(m, "\ufffc")
        return value
    if isinstance(value, dict):
        return {k: _neutralise(v, markup) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_neutralise(v, markup) for v in value]
    return value


# ---- templates for files that carry none --------------------------------------------------------------------------
# Chat formats by family, as their models were trained on them (the families llama.cpp recognises without a template
# too). A file's own tokenizer.chat_template always wins; --chat-template NAME|FILE chooses one; otherwise
# detect_template() picks the family whose turn markers the vocabulary holds as control tokens.

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"),
    "gemma": ("{{ bos_token }}{%- if messages and messages[0]['role'] == 'system' -%}"
              "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
              "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
              "{%- for m in turns -%}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
              "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim"
              " + '<end_of_turn>\n' }}{%- endfor -%}"
              "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"),
    "llama3": ("{{ bos_token }}{%- for m in messages -%}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
               " + m['content'] | trim + '<|eot_id|>' }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"),
    "phi3": ("{%- for m in messages -%}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"),
    "mistral": ("{{ bos_token }}{%- if messages and messages[0]['role'] == 'system' -%}"
                "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
                "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
                "{%- for m in turns -%}{%- if m['role'] == 'user' -%}"
                "{{ '[INST] ' + (prefix if loop.first else '') + m['content'] + '[/INST]' }}"
                "{%- else -%}{{ m['content'] + eos_token }}{%- endif -%}{%- endfor -%}"),
}
# the family's turn markers (control tokens of its vocabulary), checked in this order
FAMILY_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemma", ("<start_of_turn>", "<end_of_turn>")),
    ("llama3", ("<|start_header_id|>", "<|eot_id|>")),
    ("chatml", ("<|im_start|>", "<|im_end|>")),
    ("phi3", ("<|assistant|>", "<|end|>")),
    ("mistral", ("[INST]", "[/INST]")),
)
MAX_TEMPLATE_FILE_BYTES = 1 << 16


def detect_template(control_texts) -> str | None:
    """The built-in template whose family's turn markers are all control tokens of this vocabulary; None if none."""
    have = set(control_texts)
    return next((name for name, markers in FAMILY_MARKERS if have.issuperset(markers)), None)


NO_TEMPLATE = "none"  # --chat-template none: a text-completion model (a base model, or a file whose template is wrong)


def template_source(choice: str) -> tuple[str | None, str]:
    """--chat-template's value -> (the template's source, how to name it): a built-in name, a file of at most
    MAX_TEMPLATE_FILE_BYTES, or NO_TEMPLATE (None: chat requests are refused, completions served). ChatTemplateError
    says which names exist."""
    if choice == NO_TEMPLATE:
        return None, "none (--chat-template none: text completion only)"
    if choice in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[choice], f"built-in {choice}"
    import os

    if not os.path.isfile(choice):
        raise ChatTemplateError(f"--chat-template {choice!r} is neither a built-in template "
                                f"({', '.join(BUILTIN_TEMPLATES)}), {NO_TEMPLATE!r} nor a file")
    if os.path.getsize(choice) > MAX_TEMPLATE_FILE_BYTES:
        raise ChatTemplateError(f"--chat-template {choice}: larger than {MAX_TEMPLATE_FILE_BYTES} bytes")
    try:
        with open(choice, encoding="utf-8") as f:
            return f.read(), f"file {os.path.basename(choice)}"
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"--chat-template {choice}: cannot be read as UTF-8 text ({e})") from None

